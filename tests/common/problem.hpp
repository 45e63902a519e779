#pragma once
// Test helper: random problems of any shape and mask of SPEC §2, as the library's one owning
// type (flashref::problem_data), filled from the deterministic generator.

#include <cstdint>
#include <string>

#include "flashref/reference/data.hpp"

namespace flashref::test {

struct problem_shape {
  std::int64_t B = 1, Hq = 1, Hk = 1, Lq = 8, Lk = 8, D = 4, Dv = 4;
  bool blhd = false;  // store Q/K/V/O as [B, L, H, D] (FlashAttention's layout)
  causal_mode causal = causal_mode::none;
  std::int64_t window_left = -1, window_right = -1;
  std::int64_t block_q = 0, block_k = 0;  // > 0: a random block mask
  double block_density = 0.5;
  bool mask_broadcast_b = false, mask_broadcast_h = false;
  bool use_kv_len = false;   // batch entry 0 sees no key, the others a random length
  double value_scale = 1.0;  // inputs ~ N(0, value_scale^2)

  std::string describe() const;
};

// The problem of `s` with inputs drawn from `seed`; O and LSE allocated and poisoned.
problem_data random_problem(const problem_shape& s, std::uint64_t seed);

// Fill O and LSE with NaN so that elements a backend leaves unwritten show.
void poison_outputs(problem_data& d);

// Round Q, K, V to the nearest value of `dtype` and label the problem with it, so that the
// golden float64 result on the stored values is also the answer for a half-precision path.
void round_inputs(problem_data& d, input_dtype dtype);

// A random shape (edge cases more likely than uniform sampling would give).
problem_shape random_shape(std::uint64_t seed);

}  // namespace flashref::test
