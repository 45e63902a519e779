#pragma once
// Test helper: an attention problem that owns its storage, filled from the deterministic
// generator, with every option of SPEC §2 settable. Used by the reference and backend tests.

#include <cstdint>
#include <string>
#include <vector>

#include "flashref/reference/problem.hpp"
#include "flashref/testdata/random.hpp"

namespace flashref::test {

struct problem_shape {
  std::int64_t B = 1, Hq = 1, Hk = 1, Lq = 8, Lk = 8, D = 4, Dv = 4;
  bool blhd = false;  // store Q/K/V/O as [B, L, H, D] (FlashAttention's layout)
  causal_mode causal = causal_mode::none;
  std::int64_t window_left = -1, window_right = -1;
  std::int64_t block_q = 0, block_k = 0;  // > 0: a random block mask
  double block_density = 0.5;
  bool mask_broadcast_b = false, mask_broadcast_h = false;
  bool use_kv_len = false;
  double value_scale = 1.0;  // inputs ~ N(0, value_scale^2)

  std::string describe() const;
};

struct owned_problem {
  problem_shape shape;
  std::vector<float> q, k, v, o, lse;
  std::vector<std::uint8_t> mask;
  std::vector<std::int32_t> kv_len;
  attention_problem p;

  owned_problem(const problem_shape& s, std::uint64_t seed);
  owned_problem(const owned_problem&) = delete;
  owned_problem& operator=(const owned_problem&) = delete;
  void poison_outputs();  // fill O and LSE with NaN so that unwritten elements show
};

// A random shape (edge cases more likely than uniform sampling would give).
problem_shape random_shape(std::uint64_t seed);

}  // namespace flashref::test
