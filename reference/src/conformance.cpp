#include "flashref/reference/conformance.hpp"

#include <algorithm>
#include <cmath>
#include <tuple>

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

const char* to_string(failure_kind k) {
  switch (k) {
    case failure_kind::nan:
      return "nan";
    case failure_kind::inf:
      return "inf";
    case failure_kind::empty:
      return "empty";
    case failure_kind::wrong:
      break;
  }
  return "wrong";
}

namespace {

// Worst first: NaN, then inf, then empty rows, then the largest error ratio; ties in row order.
bool worse(const failing_row& a, const failing_row& b) {
  if (a.kind != b.kind) return int(a.kind) < int(b.kind);
  if (a.err_ratio != b.err_ratio) return a.err_ratio > b.err_ratio;
  return std::tie(a.at.b, a.at.h, a.at.i) < std::tie(b.at.b, b.at.h, b.at.i);
}

void keep_worst_rows(std::vector<failing_row>& rows, std::size_t keep) {
  std::sort(rows.begin(), rows.end(), worse);
  if (rows.size() > keep) rows.resize(keep);
}

}  // namespace

template <class T>
conformance_report compare(const reference::golden& g, const T* o, const T* lse,
                           const tolerance& tol, std::size_t keep_worst) {
  conformance_report r;
  const std::int64_t Hq = g.o_shape[1], Lq = g.o_shape[2], Dv = g.o_shape[3];
  r.rows = std::int64_t(g.lse.size());
  r.lse_judged = lse != nullptr;
  for (std::int64_t row = 0; row < r.rows; ++row) {
    const double ref_lse = g.lse[std::size_t(row)];
    // Without an LSE, stand in the golden value: only O is judged.
    const double got_lse = lse != nullptr ? double(lse[row]) : ref_lse;
    const T* o_row = o + row * Dv;
    const double* ref_row = g.o.data() + row * Dv;
    const bool empty = ref_lse == -INFINITY;
    failing_row f;
    f.at = {row / (Hq * Lq), row / Lq % Hq, row % Lq, -1};
    f.lse = got_lse;
    f.golden_lse = ref_lse;
    f.err_ratio = INFINITY;
    // The first non-finite value of the row: an element of O, else the LSE.
    std::int64_t nan_d = -2, inf_d = -2;  // -2: none, -1: the LSE
    for (std::int64_t d = 0; d < Dv; ++d) {
      const double x = double(o_row[d]);
      if (std::isnan(x) && nan_d == -2) nan_d = d;
      if (std::isinf(x) && inf_d == -2) inf_d = d;
    }
    if (nan_d == -2 && std::isnan(got_lse)) nan_d = -1;
    if (inf_d == -2 && (got_lse == INFINITY || (!empty && got_lse == -INFINITY))) inf_d = -1;
    const bool has_nan = nan_d != -2, has_inf = !has_nan && inf_d != -2;
    if (has_nan) {
      ++r.nan_rows;
      f.kind = failure_kind::nan;
      f.at.d = nan_d;
      if (!r.first_nan) r.first_nan = f.at;
    } else if (has_inf) {
      ++r.inf_rows;
      f.kind = failure_kind::inf;
      f.at.d = inf_d;
      if (!r.first_inf) r.first_inf = f.at;
    }
    if (empty) {  // O exactly 0 and LSE exactly -inf
      ++r.empty_rows;
      std::int64_t nonzero_d = -1;
      bool o_nan = false, o_inf = false;
      for (std::int64_t d = 0; d < Dv; ++d) {
        const double x = double(o_row[d]);
        if (x != 0.0 && nonzero_d < 0) nonzero_d = d;
        o_nan = o_nan || std::isnan(x);
        o_inf = o_inf || std::isinf(x);
      }
      if (nonzero_d < 0 && got_lse == -INFINITY) continue;
      ++r.empty_rows_bad;
      if (o_nan) {
        ++r.empty_o_nan;
      } else if (o_inf) {
        ++r.empty_o_inf;
      } else if (nonzero_d >= 0) {
        ++r.empty_o_nonzero;
      }
      if (got_lse == INFINITY) ++r.empty_lse_posinf;
      if (got_lse == 0.0) ++r.empty_lse_zero;
      if (std::isnan(got_lse)) ++r.empty_lse_nan;
      if (std::isfinite(got_lse) && got_lse != 0.0) ++r.empty_lse_finite;
      if (!r.first_empty) r.first_empty = failure_site{f.at.b, f.at.h, f.at.i, nonzero_d};
      if (!has_nan && !has_inf) {
        f.kind = failure_kind::empty;
        f.at.d = nonzero_d;
      }
    } else if (!has_nan && !has_inf) {  // a row that sees keys, all finite: the tolerance
      std::int64_t bad = 0, first_bad_d = -2;
      double worst_ratio = 0, worst_o_ratio = 0;  // over the failing values: all, and O alone
      std::int64_t worst_d = -1;                  // the O element that fails worst
      if (lse != nullptr) {
        const double lse_err = std::abs(got_lse - ref_lse);
        const double lse_unit = std::max(1.0, std::abs(ref_lse));
        r.max_lse_err = std::max(r.max_lse_err, lse_err);
        r.max_lse_rel_err = std::max(r.max_lse_rel_err, lse_err / lse_unit);
        const double ratio = lse_err / (tol.atol_lse * lse_unit);
        r.lse_err_ratio = std::max(r.lse_err_ratio, ratio);
        if (!(lse_err <= tol.atol_lse * lse_unit)) {
          ++bad;
          worst_ratio = ratio;
        }
      }
      for (std::int64_t d = 0; d < Dv; ++d) {
        const double err = std::abs(double(o_row[d]) - ref_row[d]);
        const double allowed = tol.atol + tol.rtol * std::abs(ref_row[d]);
        r.max_abs_err = std::max(r.max_abs_err, err);
        if (std::abs(ref_row[d]) > tol.atol) {
          r.max_rel_err = std::max(r.max_rel_err, err / std::abs(ref_row[d]));
        }
        r.o_err_ratio = std::max(r.o_err_ratio, err / allowed);
        if (!(err <= allowed)) {
          ++bad;
          if (first_bad_d == -2) first_bad_d = d;
          if (worst_d < 0 || err / allowed > worst_o_ratio) {
            worst_o_ratio = err / allowed;
            worst_d = d;
          }
        }
      }
      if (bad == 0) continue;
      if (first_bad_d == -2) first_bad_d = -1;  // only the LSE fails
      r.bad_elements += bad;
      ++r.wrong_rows;
      f.kind = failure_kind::wrong;
      if (!r.first_wrong) r.first_wrong = failure_site{f.at.b, f.at.h, f.at.i, first_bad_d};
      f.at.d = worst_d;
      f.err_ratio = std::max(worst_ratio, worst_o_ratio);
    }
    if (keep_worst == 0) continue;
    if (f.at.d >= 0) {
      f.o = double(o_row[f.at.d]);
      f.golden_o = ref_row[f.at.d];
    }
    r.worst.push_back(f);
    if (r.worst.size() >= 2 * keep_worst + 64) keep_worst_rows(r.worst, keep_worst);
  }
  keep_worst_rows(r.worst, keep_worst);
  return r;
}

template conformance_report compare(const reference::golden&, const float*, const float*,
                                    const tolerance&, std::size_t);
template conformance_report compare(const reference::golden&, const double*, const double*,
                                    const tolerance&, std::size_t);

}  // namespace flashref
