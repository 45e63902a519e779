// Fuzz harness: bytes as a golden fixture (SPEC §6) — a problem file plus every fixture
// attribute, /golden and /trace — opened from memory through HDF5's file image.
#include <cstddef>
#include <cstdint>

#include "flashref/testdata/fixture.hpp"
#include "harness.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  flashref::fuzz::expect_refusal_only([&] {
    const auto f = flashref::testdata::h5::file::open_image(data, size, "fixture.h5");
    const flashref::testdata::fixture fx = flashref::testdata::read_fixture(f);
    (void)flashref::testdata::inputs_digest(fx.in);
  });
  return 0;
}
