// docs/semantics.md's tolerance table must say what default_tolerance() returns.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>
#include <string>

#include "flashref/reference/conformance.hpp"

TEST_CASE("docs/semantics.md tolerance table matches the code", "[docs]") {
  std::ifstream in(std::string(FLASHREF_SOURCE_DIR) + "/docs/semantics.md");
  REQUIRE(in.good());
  std::string line;
  int rows = 0;
  while (std::getline(in, line)) {
    for (auto dtype : {flashref::input_dtype::float32, flashref::input_dtype::bfloat16,
                       flashref::input_dtype::float16}) {
      const std::string prefix = std::string("| ") + flashref::to_string(dtype) + " |";
      if (line.rfind(prefix, 0) != 0) continue;
      CAPTURE(line);
      const flashref::tolerance t = flashref::default_tolerance(dtype, 1.0);
      std::ostringstream want;
      want.precision(12);
      want << prefix << ' ' << t.atol << " | " << t.rtol << " | " << t.atol_lse << " |";
      REQUIRE(line == want.str());
      ++rows;
    }
  }
  REQUIRE(rows == 3);
}
