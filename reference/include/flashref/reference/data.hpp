#pragma once
// A problem that owns its storage: the xtensor-facing options, the inputs and the outputs in
// one place. Every part of flashref that holds a problem's data — the fixtures, the CLI's
// commands, the benchmarks, the tests and the umbrella's xtensor entry — uses these types and
// views them as an attention_problem (problem.hpp) to run a backend.

#include <cstdint>
#include <optional>
#include <vector>

#include <xtensor/xtensor.hpp>

#include "flashref/reference/backward.hpp"
#include "flashref/reference/problem.hpp"

namespace flashref {

// Everything of SPEC §2 beside the tensors themselves.
struct attention_options {
  std::optional<double> scale;  // default 1/sqrt(D)
  causal_mode causal = causal_mode::none;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  xt::xtensor<std::uint8_t, 4> block_mask;  // (Bm, Hm, nqb, nkb); empty = no block mask
  std::int64_t block_q = 0;
  std::int64_t block_k = 0;
  std::vector<std::int32_t> kv_len;  // (B) or empty
  input_dtype dtype = input_dtype::float32;
};

// How q, k, v and o are stored: [B, H, L, D] (PyTorch) or [B, L, H, D] (FlashAttention).
enum class tensor_layout { bhld, blhd };

// The outputs of the forward pass and of the backward (SPEC §9).
struct attention_outputs {
  xt::xtensor<float, 4> o;    // (B, Hq, Lq, Dv) in the problem's layout
  xt::xtensor<float, 3> lse;  // (B, Hq, Lq), natural log
  xt::xtensor<float, 4> dq;   // (B, Hq, Lq, D)  in the problem's layout
  xt::xtensor<float, 4> dk;   // (B, Hk, Lk, D)
  xt::xtensor<float, 4> dv;   // (B, Hk, Lk, Dv)
};

// One problem with its storage.
struct problem_data : attention_outputs {
  xt::xtensor<float, 4> q;    // (B, Hq, Lq, D)  — (B, Lq, Hq, D) when layout is blhd
  xt::xtensor<float, 4> k;    // (B, Hk, Lk, D)  — (B, Lk, Hk, D)
  xt::xtensor<float, 4> v;    // (B, Hk, Lk, Dv) — (B, Lk, Hk, Dv)
  xt::xtensor<float, 4> d_o;  // (B, Hq, Lq, Dv) the backward's upstream gradient, or empty
  attention_options opt;
  tensor_layout layout = tensor_layout::bhld;

  // The problem over this storage. O and LSE are (re)allocated first when their shapes are
  // not those the inputs ask for; their values are left as they are otherwise. Not validated:
  // backends validate, and validate(problem()) names the first bad field.
  attention_problem problem();
  // Inputs only (the output views are null): for readers such as the naive reference.
  attention_problem inputs() const;
  // The backward's tensors over this storage: d_o as stored, dQ, dK, dV (re)allocated first
  // when their shapes are not those of q, k, v. Not validated (validate_backward does).
  attention_gradients gradients();
};

// The problem over caller-owned [B, H, L, D] xtensors, without copies; o and lse are allocated
// with the shapes the inputs ask for. Throws problem_error when kv_len has not B entries.
attention_problem make_problem(const xt::xtensor<float, 4>& q, const xt::xtensor<float, 4>& k,
                               const xt::xtensor<float, 4>& v, const attention_options& opt,
                               xt::xtensor<float, 4>& o, xt::xtensor<float, 3>& lse);

}  // namespace flashref
