#pragma once
// Test helper: judge a problem's O and LSE (as a backend wrote them) against the naive float64
// golden result with the contract's tolerance (SPEC §3).

#include <algorithm>
#include <cmath>
#include <vector>

#include "flashref/reference/conformance.hpp"
#include "flashref/reference/naive.hpp"
#include "problem.hpp"

namespace flashref::test {

// O and LSE gathered into row-major (B, Hq, Lq, Dv) / (B, Hq, Lq), whatever the O layout.
inline void gather_outputs(problem_data& d, std::vector<float>& o, std::vector<float>& lse) {
  const attention_problem p = d.problem();
  o.clear();
  lse.clear();
  for (std::int64_t b = 0; b < p.batch(); ++b)
    for (std::int64_t h = 0; h < p.heads_q(); ++h)
      for (std::int64_t i = 0; i < p.len_q(); ++i) {
        lse.push_back(p.lse(b, h, i));
        for (std::int64_t x = 0; x < p.head_dim_v(); ++x)
          o.push_back(p.o(b, h, i, x));
      }
}

inline double max_abs(const xt::xtensor<float, 4>& x) {
  double m = 0;
  for (float e : x)
    m = std::max(m, double(std::abs(e)));
  return m;
}

inline conformance_report check_against_naive(problem_data& d,
                                              input_dtype dtype = input_dtype::float32) {
  const reference::golden g = reference::naive_attention(d.inputs());
  std::vector<float> o, lse;
  gather_outputs(d, o, lse);
  return compare(g, o.data(), lse.data(), default_tolerance(dtype, max_abs(d.v)));
}

// Two runs of one problem agree within `tol` (e.g. different tile sizes); infinite LSEs
// (empty rows) must agree exactly.
#define FLASHREF_REQUIRE_OUTPUTS_CLOSE(a, b, tol)                              \
  do {                                                                         \
    for (std::size_t n_ = 0; n_ < (a).o.size(); ++n_)                          \
      REQUIRE((a).o.data()[n_] == Approx((b).o.data()[n_]).margin(tol));       \
    for (std::size_t n_ = 0; n_ < (a).lse.size(); ++n_) {                      \
      if (std::isinf((b).lse.data()[n_])) {                                    \
        REQUIRE((a).lse.data()[n_] == (b).lse.data()[n_]);                     \
      } else {                                                                 \
        REQUIRE((a).lse.data()[n_] == Approx((b).lse.data()[n_]).margin(tol)); \
      }                                                                        \
    }                                                                          \
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
