#pragma once
// Test helper for the backward pass: an upstream gradient and gradient storage in a
// problem_data, and the judgement of a backend's gradients against the naive float64 golden
// ones with SPEC §9's tolerance.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "flashref/reference/backward.hpp"
#include "flashref/reference/data.hpp"
#include "flashref/testdata/random.hpp"
#include "problem.hpp"

namespace flashref::test {

// Adds about score_offset to every score: Q[..., 0] = K[..., 0] = sqrt(offset / scale), so
// that scale * Q_0 * K_0 = offset for every pair. With an offset of 1000 the scores are ~1e3
// while their spread within a row stays O(1): P is not one-hot, the gradients stay well above
// the float32 rounding of O, and a recomputation that does not start from the stored LSE (a
// fresh block max, say) shows. Storage keeps d innermost in both layouts: element n*D is d = 0.
inline void offset_scores(problem_data& d, double score_offset) {
  const attention_problem p = d.inputs();
  const std::int64_t D = p.head_dim();
  if (score_offset == 0.0 || D == 0) return;
  const float c = float(std::sqrt(score_offset / p.softmax_scale()));
  for (std::size_t n = 0; n < d.q.size(); n += std::size_t(D))
    d.q.data()[n] = c;
  for (std::size_t n = 0; n < d.k.size(); n += std::size_t(D))
    d.k.data()[n] = c;
}

// SPEC §9 scales a gradient's tolerance by its own max|ref|. Every backward that starts from a
// float32 O (Delta = rowsum(dO ∘ O)) carries an error of about
// scale · eps32 · |dO| |O| |K| in dQ and dK, whatever its accumulation precision; when P is
// nearly one-hot in every row (scores of spread ~1e2, value_scale 8) or a single key is visible
// (Lk = 1), dQ and dK shrink far below that and the rule cannot be met by any such backward —
// the float64-accumulating tiled reference fed the CPU forward's O included. Random backward
// problems therefore keep unit-scale inputs and at least two keys; large scores are covered by
// offset_scores above, which keeps P spread.
inline problem_shape well_conditioned(problem_shape s) {
  s.value_scale = 1.0;
  if (s.Lk == 1) s.Lk = 2;
  return s;
}

// dO ~ N(0, 1) from its own stream of `seed`, stored like O; dQ, dK, dV allocated and poisoned
// with NaN so that an element a backend forgets to write shows.
inline void add_upstream_gradient(problem_data& d, std::uint64_t seed) {
  d.problem();  // allocates O in the stored layout
  const testdata::counter_rng r(seed, 300);
  d.d_o = xt::xtensor<float, 4>::from_shape(d.o.shape());
  for (std::size_t n = 0; n < d.d_o.size(); ++n)
    d.d_o.data()[n] = float(r.normal(n));
  d.gradients();
  for (auto* x : {&d.dq, &d.dk, &d.dv})
    std::fill(x->begin(), x->end(), NAN);
}

// A strided (B, H, L, X) view gathered row-major.
inline std::vector<float> gather(const strided<float, 4>& t) {
  std::vector<float> out;
  out.reserve(std::size_t(t.size()));
  for (std::int64_t b = 0; b < t.shape[0]; ++b)
    for (std::int64_t h = 0; h < t.shape[1]; ++h)
      for (std::int64_t i = 0; i < t.shape[2]; ++i)
        for (std::int64_t x = 0; x < t.shape[3]; ++x)
          out.push_back(t(b, h, i, x));
  return out;
}

struct backward_report {
  gradient_report dq, dk, dv;
  bool pass() const { return dq.pass() && dk.pass() && dv.pass(); }
};

// d's gradients against golden gradients of its inputs and upstream gradient.
inline backward_report compare_gradients(problem_data& d, const reference::golden_gradients& gold,
                                         input_dtype dtype = input_dtype::float32) {
  const attention_gradients g = d.gradients();
  const attention_problem p = d.inputs();
  backward_report r;
  r.dq = compare_gradient(gold.dq, gather(g.dq).data(), p.head_dim(), gold.row_empty, dtype);
  r.dk = compare_gradient(gold.dk, gather(g.dk).data(), p.head_dim(), gold.key_unseen, dtype);
  r.dv = compare_gradient(gold.dv, gather(g.dv).data(), p.head_dim_v(), gold.key_unseen, dtype);
  return r;
}

inline reference::golden_gradients golden_gradients_of(problem_data& d) {
  return reference::naive_attention_backward(d.inputs(), d.gradients().d_o);
}

inline backward_report check_backward_against_naive(problem_data& d,
                                                    input_dtype dtype = input_dtype::float32) {
  return compare_gradients(d, golden_gradients_of(d), dtype);
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
