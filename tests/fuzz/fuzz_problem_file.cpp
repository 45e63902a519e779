// Fuzz harness: bytes as a problem file (SPEC §7), opened from memory through HDF5's file
// image. A problem that reads back is run on the reference and, when small, the CPU backend,
// and so is the backward where the file holds /inputs/do (SPEC §9): whatever the file said,
// reading and running it may only refuse with problem_error.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "flashref/flashref.hpp"
#include "flashref/testdata/fixture.hpp"
#include "harness.hpp"

namespace {
// Problems up to this many multiply-adds are also run, so that a mutated mask or option that
// reads back is exercised by the backends, not only by the reader.
constexpr double kMaxFlops = 1 << 22;
// Inputs (and scale) up to this magnitude keep every score far from float32's range, where the
// contract promises finite outputs.
constexpr float kMaxInput = 1e3f;

// SPEC §2: for finite inputs O is finite and LSE finite or -inf, on every backend.
void require_finite_outputs(const flashref::problem_data& d) {
  for (const float x : d.o)
    flashref::fuzz::require(std::isfinite(x), "finite inputs give a finite O");
  for (const float x : d.lse)
    flashref::fuzz::require(std::isfinite(x) || x == -INFINITY,
                            "finite inputs give an LSE that is finite or -inf");
}

// SPEC §9: finite inputs give finite gradients, on every backend.
void require_finite_gradients(const flashref::problem_data& d) {
  for (const auto* x : {&d.dq, &d.dk, &d.dv})
    for (const float e : *x)
      flashref::fuzz::require(std::isfinite(e), "finite inputs give finite gradients");
}

bool all_finite(const xt::xtensor<float, 4>& x) {
  for (const float e : x)
    if (!std::isfinite(e) || std::fabs(e) > kMaxInput) return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  flashref::fuzz::expect_refusal_only([&] {
    const auto f = flashref::testdata::h5::file::open_image(data, size, "problem.h5");
    flashref::problem_data in = flashref::testdata::read_problem(f);
    if (flashref::dense_flops(in.inputs()) > kMaxFlops) return;
    const bool finite = all_finite(in.q) && all_finite(in.k) && all_finite(in.v) &&
                        std::isfinite(in.inputs().softmax_scale()) &&
                        std::fabs(in.inputs().softmax_scale()) <= kMaxInput;
    const bool backward = in.d_o.size() > 0;
    if (backward && flashref::backward_flops(in.inputs()) > 2.5 * kMaxFlops) return;
    const bool finite_do = backward && all_finite(in.d_o);
    for (const flashref::backend be : {flashref::backend::reference, flashref::backend::cpu}) {
      flashref::problem_data d = in;
      flashref::attention(d.problem(), be);
      if (finite) require_finite_outputs(d);
      if (!backward) continue;
      flashref::attention_backward(d.problem(), d.gradients(), be);
      if (finite && finite_do) require_finite_gradients(d);
    }
  });
  return 0;
}
