// Sizes nobody can allocate: a problem file of a few KB that declares tensors of many GiB
// (chunked, never written) is refused from its declared shapes, before a byte is read, with
// one line naming the file, the budget and its source; the budget follows
// FLASHREF_MEMORY_LIMIT, then the machine's and the process's limits.

#include <stdlib.h>

#include <catch2/catch.hpp>

#include <filesystem>
#include <string>

#include "flashref/reference/limits.hpp"
#include "flashref/testdata/cases.hpp"
#include "flashref/testdata/fixture.hpp"
#include "helpers.hpp"

namespace h5 = flashref::testdata::h5;
namespace td = flashref::testdata;
using Catch::Matchers::Contains;
using flashref::problem_error;
using flashref::test::temp_dir;

namespace {

// Sets an environment variable for the scope, restoring the previous value.
class scoped_env {
 public:
  scoped_env(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    ::setenv(name, value, 1);
  }
  ~scoped_env() {
    if (had_) {
      ::setenv(name_, old_.c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

// A chunked float32 dataset of the given dims that is never written: HDF5 stores no chunk, so
// the file stays a few KB whatever the dims say.
void declare(hid_t file, const std::string& path, const std::vector<hsize_t>& dims) {
  const hid_t space = H5Screate_simple(int(dims.size()), dims.data(), nullptr);
  const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
  std::vector<hsize_t> chunk(dims.size(), 1);
  chunk.back() = std::min<hsize_t>(dims.back(), 64);
  H5Pset_chunk(dcpl, int(chunk.size()), chunk.data());
  const hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
  H5Pset_create_intermediate_group(lcpl, 1);
  const hid_t d = H5Dcreate2(file, path.c_str(), H5T_IEEE_F32LE, space, lcpl, dcpl, H5P_DEFAULT);
  REQUIRE(d >= 0);
  H5Dclose(d);
  H5Pclose(lcpl);
  H5Pclose(dcpl);
  H5Sclose(space);
}

// q, k, v of [1, 1, L, 128], declared only.
std::filesystem::path huge_problem(const temp_dir& dir, hsize_t L) {
  const auto p = dir / "huge.h5";
  const flashref::test::raw_file f(p);
  for (const char* name : {"/inputs/q", "/inputs/k", "/inputs/v"})
    declare(f.id, name, {1, 1, L, 128});
  return p;
}

}  // namespace

TEST_CASE("limits: checked products and sums report overflow instead of wrapping", "[limits]") {
  CHECK(flashref::checked_product({}) == 1u);
  CHECK(flashref::checked_product({1u << 24, 128, 4}) == std::uint64_t(1) << 33);
  CHECK(flashref::checked_product({std::uint64_t(1) << 32, std::uint64_t(1) << 32}) ==
        std::nullopt);
  CHECK(flashref::checked_product({0, std::uint64_t(1) << 63, 4}) == 0u);
  CHECK(flashref::checked_sum({~std::uint64_t(0), 1}) == std::nullopt);
  CHECK(flashref::checked_sum({5, 7}) == 12u);
}

TEST_CASE("limits: the memory budget follows FLASHREF_MEMORY_LIMIT, else the machine", "[limits]") {
  {
    const scoped_env env(flashref::kMemoryLimitVariable, "");
    const flashref::memory_budget b = flashref::current_memory_budget();
    CHECK(b.bytes > 0);
    CHECK(b.source != flashref::kMemoryLimitVariable);
  }
  for (const auto& [text, bytes] :
       {std::pair{"4096", std::uint64_t(4096)}, std::pair{"64K", std::uint64_t(64) << 10},
        std::pair{"512M", std::uint64_t(512) << 20}, std::pair{"3G", std::uint64_t(3) << 30},
        std::pair{"2T", std::uint64_t(2) << 40}}) {
    const scoped_env env(flashref::kMemoryLimitVariable, text);
    CAPTURE(text);
    CHECK(flashref::current_memory_budget().bytes == bytes);
    CHECK(flashref::current_memory_budget().source == flashref::kMemoryLimitVariable);
  }
  for (const char* bad : {"lots", "-1", "2GB", "1.5G", "99999999999999999999", "20000000T"}) {
    const scoped_env env(flashref::kMemoryLimitVariable, bad);
    CAPTURE(bad);
    CHECK_THROWS_WITH(flashref::current_memory_budget(),
                      Contains("FLASHREF_MEMORY_LIMIT: expected a byte count") && Contains(bad));
  }
  const scoped_env env(flashref::kMemoryLimitVariable, "1M");
  CHECK_NOTHROW(flashref::check_allocation("x", std::uint64_t(1) << 20, "exactly the budget"));
  CHECK_THROWS_WITH(
      flashref::check_allocation("x", (std::uint64_t(1) << 20) + 1, "one byte over"),
      "x: expected at most 1048576 bytes (1.0 MiB) (FLASHREF_MEMORY_LIMIT), got 1048577 bytes "
      "(1.0 MiB) (one byte over)");
  CHECK_THROWS_WITH(flashref::check_allocation("x", std::nullopt, "d"),
                    Contains("got more than 2^64 bytes (the size overflows) (d)"));
}

TEST_CASE("limits: a small file declaring q, k, v of [1, 1, 2^24, 128] is refused unread",
          "[limits]") {
  temp_dir dir;
  const auto p = huge_problem(dir, hsize_t(1) << 24);
  CHECK(std::filesystem::file_size(p) < 64 * 1024);  // the file really is small
  // 3 x 8 GiB of inputs and 8 GiB of O: more than any budget of this test's machines, and
  // certainly more than 1 GiB.
  const scoped_env env(flashref::kMemoryLimitVariable, "1G");
  CHECK_THROWS_WITH(td::read_problem(p),
                    Contains(p.string() + ": the problem's storage: expected at most 1073741824 "
                                          "bytes (1.0 GiB) (FLASHREF_MEMORY_LIMIT), got ") &&
                        Contains("q [1, 1, 16777216, 128], k [1, 1, 16777216, 128]"));
  CHECK_THROWS_AS(td::read_problem(p), problem_error);
}

TEST_CASE("limits: the machine's own budget refuses what it cannot hold", "[limits]") {
  const scoped_env env(flashref::kMemoryLimitVariable, "");
  const flashref::memory_budget b = flashref::current_memory_budget();
  temp_dir dir;
  // Inputs of L rows of 128 floats: choose L so that q, k, v alone are twice the budget.
  const hsize_t L = hsize_t(b.bytes / (3 * 128 * 4) * 2 + 1);
  const auto p = huge_problem(dir, L);
  CAPTURE(b.bytes, b.source, L);
  CHECK_THROWS_WITH(td::read_problem(p), Contains("the problem's storage: expected at most " +
                                                  std::to_string(b.bytes) + " bytes"));
}

TEST_CASE("limits: shapes whose byte count overflows 64 bits are refused", "[limits]") {
  temp_dir dir;
  const auto p = dir / "overflow.h5";
  {
    const flashref::test::raw_file f(p);
    // Each dataset has 2^62 elements: the HDF5 layer alone would refuse it as over 2^32
    // elements, but 4 bytes each overflow the byte count first.
    for (const char* name : {"/inputs/q", "/inputs/k", "/inputs/v"})
      declare(f.id, name, {hsize_t(1) << 20, hsize_t(1) << 21, hsize_t(1) << 14, 128});
  }
  CHECK_THROWS_WITH(td::read_problem(p), Contains("got more than 2^64 bytes (the size overflows)"));
}

TEST_CASE("limits: a fixture counts its golden float64 O and LSE too", "[limits]") {
  temp_dir dir;
  const auto p = dir / "spec_random.h5";
  td::write_fixture(p, td::generate("spec_random"));
  const td::fixture fx = td::read_fixture(p);
  // q, k, v and the backward's upstream gradient dO, all float32.
  const std::uint64_t in_bytes =
                          4 * (fx.in.q.size() + fx.in.k.size() + fx.in.v.size() + fx.in.d_o.size()),
                      out_bytes = 4 * (fx.in.o.size() + fx.in.lse.size());
  // A budget that holds the problem and its float32 outputs, but not the float64 golden.
  const std::string limit = std::to_string(in_bytes + out_bytes);
  const scoped_env env(flashref::kMemoryLimitVariable, limit.c_str());
  CHECK_NOTHROW(td::read_problem(p));
  CHECK_THROWS_WITH(td::read_fixture(p), Contains("golden float64 O and LSE"));
}
