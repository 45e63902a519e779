#pragma once
// Test helper for the backward pass: an upstream gradient and gradient storage laid out like
// an owned_problem's tensors, and the judgement of a backend's gradients against the naive
// float64 golden ones with SPEC §9's tolerance.

#include <cmath>
#include <cstdint>
#include <vector>

#include "flashref/reference/backward.hpp"
#include "owned_problem.hpp"

namespace flashref::test {

// Adds about score_offset to every score: Q[..., 0] = K[..., 0] = sqrt(offset / scale), so
// that scale * Q_0 * K_0 = offset for every pair. With an offset of 1000 the scores are ~1e3
// while their spread within a row stays O(1): P is not one-hot, the gradients stay well above
// the float32 rounding of O, and a recomputation that does not start from the stored LSE (a
// fresh block max, say) shows. Storage keeps d innermost in both layouts: element n*D is d = 0.
inline void offset_scores(owned_problem& op, double score_offset) {
  const problem_shape& s = op.shape;
  if (score_offset == 0.0 || s.D == 0) return;
  const float c = float(std::sqrt(score_offset / op.p.softmax_scale()));
  for (std::size_t n = 0; n < op.q.size(); n += std::size_t(s.D))
    op.q[n] = c;
  for (std::size_t n = 0; n < op.k.size(); n += std::size_t(s.D))
    op.k[n] = c;
}

// SPEC §9 scales a gradient's tolerance by its own max|ref|. Every backward that starts from a
// float32 O (Delta = rowsum(dO ∘ O)) carries an error of about
// scale · eps32 · |dO| |O| |K| in dQ and dK, whatever its accumulation precision; when P is
// nearly one-hot in every row (scores of spread ~1e2, value_scale 8) or a single key is visible
// (Lk = 1), dQ and dK shrink far below that and the rule cannot be met by any such backward —
// the float64-accumulating tiled reference fed the CPU forward's O included. Random backward
// problems therefore keep unit-scale inputs and at least two keys; large scores are covered by
// offset_scores below, which keeps P spread.
inline problem_shape well_conditioned(problem_shape s) {
  s.value_scale = 1.0;
  if (s.Lk == 1) s.Lk = 2;
  return s;
}

struct owned_gradients {
  std::vector<float> d_o, dq, dk, dv;
  attention_gradients g;

  // dO ~ N(0, 1) from its own stream of `seed`; dQ, dK, dV poisoned with NaN so that an
  // element a backend forgets to write shows.
  owned_gradients(const owned_problem& op, std::uint64_t seed) {
    const problem_shape& s = op.shape;
    const testdata::counter_rng r(seed, 300);
    d_o.resize(std::size_t(s.B * s.Hq * s.Lq * s.Dv));
    for (std::size_t n = 0; n < d_o.size(); ++n)
      d_o[n] = float(r.normal(n));
    dq.assign(std::size_t(s.B * s.Hq * s.Lq * s.D), NAN);
    dk.assign(std::size_t(s.B * s.Hk * s.Lk * s.D), NAN);
    dv.assign(std::size_t(s.B * s.Hk * s.Lk * s.Dv), NAN);
    auto view = [&](auto* data, std::int64_t H, std::int64_t L, std::int64_t D) {
      using T = std::remove_pointer_t<decltype(data)>;
      return s.blhd ? from_blhd<T>(data, s.B, L, H, D) : contiguous<T, 4>(data, {s.B, H, L, D});
    };
    g.d_o = view(static_cast<const float*>(d_o.data()), s.Hq, s.Lq, s.Dv);
    g.dq = view(dq.data(), s.Hq, s.Lq, s.D);
    g.dk = view(dk.data(), s.Hk, s.Lk, s.D);
    g.dv = view(dv.data(), s.Hk, s.Lk, s.Dv);
  }
  owned_gradients(const owned_gradients&) = delete;
  owned_gradients& operator=(const owned_gradients&) = delete;
};

// A strided (B, H, L, X) view gathered row-major.
inline std::vector<float> gather(const strided<float, 4>& t) {
  std::vector<float> out;
  out.reserve(std::size_t(t.size()));
  for (std::int64_t b = 0; b < t.shape[0]; ++b)
    for (std::int64_t h = 0; h < t.shape[1]; ++h)
      for (std::int64_t i = 0; i < t.shape[2]; ++i)
        for (std::int64_t d = 0; d < t.shape[3]; ++d)
          out.push_back(t(b, h, i, d));
  return out;
}

struct backward_report {
  gradient_report dq, dk, dv;
  bool pass() const { return dq.pass() && dk.pass() && dv.pass(); }
};

inline backward_report check_backward_against_naive(const owned_problem& op,
                                                    const owned_gradients& og,
                                                    input_dtype dtype = input_dtype::float32) {
  const reference::golden_gradients gold = reference::naive_attention_backward(op.p, og.g.d_o);
  const problem_shape& s = op.shape;
  backward_report r;
  r.dq = compare_gradient(gold.dq, gather(og.g.dq).data(), s.D, gold.row_empty, dtype);
  r.dk = compare_gradient(gold.dk, gather(og.g.dk).data(), s.D, gold.key_unseen, dtype);
  r.dv = compare_gradient(gold.dv, gather(og.g.dv).data(), s.Dv, gold.key_unseen, dtype);
  return r;
}

#define FLASHREF_REQUIRE_GRADIENT_CONFORMS(name, rep)                                             \
  do {                                                                                            \
    const ::flashref::gradient_report& g_ = (rep);                                                \
    INFO(name << ": bad " << g_.bad_elements << ", non-finite " << g_.nonfinite << ", max err "   \
              << g_.max_abs_err << " (max|ref| " << g_.max_ref << "), zero rows " << g_.zero_rows \
              << " (NaN " << g_.zero_rows_nan << ", non-zero " << g_.zero_rows_nonzero << ")");   \
    REQUIRE(g_.pass());                                                                           \
  } while (0)

#define FLASHREF_REQUIRE_GRADIENTS_CONFORM(rep)          \
  do {                                                   \
    const ::flashref::test::backward_report& b_ = (rep); \
    FLASHREF_REQUIRE_GRADIENT_CONFORMS("dq", b_.dq);     \
    FLASHREF_REQUIRE_GRADIENT_CONFORMS("dk", b_.dk);     \
    FLASHREF_REQUIRE_GRADIENT_CONFORMS("dv", b_.dv);     \
  } while (0)

}  // namespace flashref::test
