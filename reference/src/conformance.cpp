#include "flashref/reference/conformance.hpp"

#include <algorithm>
#include <cmath>

namespace flashref {

tolerance default_tolerance(input_dtype dtype, double max_abs_v) {
  const double v = std::max(max_abs_v, 1e-30);
  switch (dtype) {
    case input_dtype::bfloat16:
      return {0x1p-7 * v, 0x1p-7, 1e-4};
    case input_dtype::float16:
      return {0x1p-10 * v, 0x1p-10, 1e-4};
    case input_dtype::float32:
      break;
  }
  return {2e-5 * v, 2e-5, 1e-5};
}

template <class T>
conformance_report compare(const reference::golden& g, const T* o, const T* lse,
                           const tolerance& tol) {
  conformance_report r;
  const std::int64_t Dv = g.o_shape[3];
  r.rows = std::int64_t(g.lse.size());
  r.lse_judged = lse != nullptr;
  for (std::int64_t row = 0; row < r.rows; ++row) {
    const double ref_lse = g.lse[std::size_t(row)];
    // Without an LSE, stand in the golden value: only O is judged.
    const double got_lse = lse != nullptr ? double(lse[row]) : ref_lse;
    const T* o_row = o + row * Dv;
    const double* ref_row = g.o.data() + row * Dv;
    bool nan = std::isnan(got_lse) || got_lse == INFINITY;
    for (std::int64_t d = 0; d < Dv; ++d)
      nan = nan || !std::isfinite(double(o_row[d]));
    if (nan) ++r.nan_rows;
    if (ref_lse == -INFINITY) {  // empty row: O exactly 0 and LSE exactly -inf
      ++r.empty_rows;
      bool o_zero = true;
      for (std::int64_t d = 0; d < Dv; ++d)
        o_zero = o_zero && o_row[d] == T(0);
      if (o_zero && got_lse == -INFINITY) continue;
      ++r.empty_rows_bad;
      if (!o_zero) ++r.empty_o_nonzero;
      if (got_lse == INFINITY) ++r.empty_lse_posinf;
      if (got_lse == 0.0) ++r.empty_lse_zero;
      if (std::isnan(got_lse)) ++r.empty_lse_nan;
      if (std::isfinite(got_lse) && got_lse != 0.0) ++r.empty_lse_finite;
      continue;
    }
    if (nan) continue;
    const double lse_err = std::abs(got_lse - ref_lse);
    r.max_lse_err = std::max(r.max_lse_err, lse_err);
    if (!(lse_err <= tol.atol_lse * std::max(1.0, std::abs(ref_lse)))) ++r.bad_elements;
    for (std::int64_t d = 0; d < Dv; ++d) {
      const double err = std::abs(double(o_row[d]) - ref_row[d]);
      r.max_abs_err = std::max(r.max_abs_err, err);
      if (std::abs(ref_row[d]) > tol.atol) {
        r.max_rel_err = std::max(r.max_rel_err, err / std::abs(ref_row[d]));
      }
      if (!(err <= tol.atol + tol.rtol * std::abs(ref_row[d]))) ++r.bad_elements;
    }
  }
  return r;
}

template conformance_report compare(const reference::golden&, const float*, const float*,
                                    const tolerance&);
template conformance_report compare(const reference::golden&, const double*, const double*,
                                    const tolerance&);

}  // namespace flashref
