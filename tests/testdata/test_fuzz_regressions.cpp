// The inputs fuzzing found (tests/fuzz/corpus/*/regression-*), replayed in the main build:
// each is refused with one problem_error line, read from memory as the harnesses read it and
// from disk as the CLI does. The smoke fuzz replays them too, under the sanitizers.
#include <catch2/catch.hpp>

#include <filesystem>
#include <string>

#include "flashref/testdata/fixture.hpp"
#include "helpers.hpp"

// Under AddressSanitizer (the asan preset) malloc must be allowed to say no, as it does
// without it: libhdf5's 128 TiB request below is refused by malloc and reported by libhdf5.
// (Read by ASan at start-up; unused in other builds.)
extern "C" const char* __asan_default_options() {
  return "allocator_may_return_null=1";
}
// libhdf5 does not free everything of an open that failed on these corrupt files: its leak,
// not flashref's (tests/fuzz/lsan.supp says the same for the harnesses).
extern "C" const char* __lsan_default_suppressions() {
  return "leak:libhdf5_serial.so\n";
}

namespace td = flashref::testdata;
namespace h5 = flashref::testdata::h5;
using Catch::Matchers::Contains;

namespace {

std::filesystem::path corpus(const std::string& harness, const std::string& name) {
  return std::filesystem::path(FLASHREF_FUZZ_CORPUS_DIR) / harness / name;
}

h5::file from_memory(const std::filesystem::path& p) {
  const std::string bytes = flashref::test::read_text(p);
  REQUIRE(!bytes.empty());
  return h5::file::open_image(bytes.data(), bytes.size(), p.filename().string());
}

}  // namespace

TEST_CASE("fuzz regressions: block sizes near 2^63 in a problem file", "[fuzz]") {
  // block_q = 2^63 - 1: ceil(Lq / block_q) overflowed in validate() (UBSan).
  const auto p = corpus("fuzz_problem_file", "regression-block-q-overflow.h5");
  CHECK_THROWS_WITH(td::read_problem(p), Contains("block_mask: expected shape"));
  CHECK_THROWS_WITH(td::read_problem(from_memory(p)), Contains("block_mask: expected shape"));
}

TEST_CASE("fuzz regressions: a header that makes libhdf5 ask for 128 TiB", "[fuzz]") {
  // A corrupt object header: libhdf5 asks malloc for 0x8000000000f8 bytes, malloc refuses and
  // libhdf5 fails the open, which is bad input like any other.
  const auto p = corpus("fuzz_result_file", "regression-hdf5-huge-malloc.h5");
  CHECK_THROWS_WITH(td::read_result_info(p), Contains("expected an intact HDF5 file"));
  CHECK_THROWS_AS(td::read_result_info(from_memory(p)), flashref::problem_error);
}
