#pragma once
// Test helper: judge a problem's O and LSE (as a backend wrote them) against the naive float64
// golden result with the contract's tolerance (SPEC §3).

#include <algorithm>
#include <cmath>
#include <vector>

#include "flashref/reference/conformance.hpp"
#include "flashref/reference/naive.hpp"
#include "owned_problem.hpp"

namespace flashref::test {

// O and LSE gathered into row-major (B, Hq, Lq, Dv) / (B, Hq, Lq), whatever the O layout.
inline void gather_outputs(const owned_problem& op, std::vector<float>& o,
                           std::vector<float>& lse) {
  const auto& s = op.shape;
  o.resize(std::size_t(s.B * s.Hq * s.Lq * s.Dv));
  lse.resize(std::size_t(s.B * s.Hq * s.Lq));
  std::size_t n = 0, m = 0;
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.Hq; ++h)
      for (std::int64_t i = 0; i < s.Lq; ++i) {
        lse[m++] = op.p.lse(b, h, i);
        for (std::int64_t d = 0; d < s.Dv; ++d)
          o[n++] = op.p.o(b, h, i, d);
      }
}

inline conformance_report check_against_naive(const owned_problem& op,
                                              input_dtype dtype = input_dtype::float32) {
  const reference::golden g = reference::naive_attention(op.p);
  double max_v = 0;
  for (float x : op.v)
    max_v = std::max(max_v, double(std::abs(x)));
  std::vector<float> o, lse;
  gather_outputs(op, o, lse);
  return compare(g, o.data(), lse.data(), default_tolerance(dtype, max_v));
}

// Two runs of one problem agree within `tol` (e.g. different tile sizes); infinite LSEs
// (empty rows) must agree exactly.
#define FLASHREF_REQUIRE_OUTPUTS_CLOSE(a, b, tol)                \
  do {                                                           \
    for (std::size_t n_ = 0; n_ < (a).o.size(); ++n_)            \
      REQUIRE((a).o[n_] == Approx((b).o[n_]).margin(tol));       \
    for (std::size_t n_ = 0; n_ < (a).lse.size(); ++n_) {        \
      if (std::isinf((b).lse[n_])) {                             \
        REQUIRE((a).lse[n_] == (b).lse[n_]);                     \
      } else {                                                   \
        REQUIRE((a).lse[n_] == Approx((b).lse[n_]).margin(tol)); \
      }                                                          \
    }                                                            \
  } while (0)

#define FLASHREF_REQUIRE_CONFORMS(rep)                                                      \
  do {                                                                                      \
    const ::flashref::conformance_report& r_ = (rep);                                       \
    CAPTURE(r_.nan_rows, r_.empty_rows, r_.empty_rows_bad, r_.bad_elements, r_.max_abs_err, \
            r_.max_rel_err, r_.max_lse_err);                                                \
    REQUIRE(r_.nan_rows == 0);                                                              \
    REQUIRE(r_.inf_rows == 0);                                                              \
    REQUIRE(r_.empty_rows_bad == 0);                                                        \
    REQUIRE(r_.bad_elements == 0);                                                          \
  } while (0)

}  // namespace flashref::test
