#pragma once
// The pass criterion of SPEC §3, in one place: tolerances per input dtype and the comparison
// of a result (O, LSE) against the float64 golden values.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "flashref/reference/naive.hpp"
#include "flashref/reference/problem.hpp"

namespace flashref {

struct tolerance {
  double atol = 0;      // absolute, already scaled by max|V|
  double rtol = 0;      // relative to |ref|
  double atol_lse = 0;  // LSE: |lse - ref| <= atol_lse * max(1, |ref|)
};

// SPEC §3 (docs/semantics.md has the table): float32 inputs: atol = rtol = 2e-5 * max|V|,
// atol_lse = 1e-5; bfloat16 / float16 inputs (fp32 accumulation, low-precision output):
// atol = rtol = 2^-7 / 2^-10 * max|V|, atol_lse = 1e-4 (the scores are exact products of the
// stored inputs; only fp32 accumulation and the exponent path round).
tolerance default_tolerance(input_dtype dtype, double max_abs_v);

// Where a result breaks the rule: a row (b, h, i) and, for an element of O, its index d.
struct failure_site {
  std::int64_t b = 0, h = 0, i = 0;
  std::int64_t d = -1;  // the O element; -1: the LSE of the row (or the row as a whole)
};

// What is wrong with a failing row, in the order a row is classified: the first that applies.
enum class failure_kind {
  nan,    // a NaN in O or in LSE
  inf,    // ±inf in O, LSE = +inf, or LSE = -inf on a row that sees keys
  empty,  // a row with no visible key whose O is not exactly 0 or whose LSE is not -inf
  wrong,  // finite values outside the tolerance
};
const char* to_string(failure_kind k);

// One failing row with the values that make it fail: the O element with the largest error
// (d = -1 when only the LSE fails), the row's LSE, and the golden values of both.
struct failing_row {
  failure_kind kind = failure_kind::wrong;
  failure_site at;
  double o = 0, golden_o = 0;      // O[b, h, i, d] (when d >= 0)
  double lse = 0, golden_lse = 0;  // LSE[b, h, i] (the golden value when the result has none)
  double err_ratio = 0;            // error / allowed error of that value; inf for nan/inf/empty
};

struct conformance_report {
  std::int64_t rows = 0;            // B * Hq * Lq
  std::int64_t empty_rows = 0;      // rows with no visible key (golden LSE == -inf)
  std::int64_t empty_rows_bad = 0;  // empty rows whose O is not exactly 0 or LSE is not -inf
  std::int64_t nan_rows = 0;        // rows with a NaN in O or in LSE (empty or not)
  std::int64_t inf_rows = 0;        // rows without NaN holding ±inf in O, an LSE of +inf, or an
                                    // LSE of -inf on a row that sees keys
  std::int64_t wrong_rows = 0;    // rows that see keys, all finite, with a value outside tolerance
  std::int64_t bad_elements = 0;  // finite O or LSE values of such rows outside the tolerance
  double max_abs_err = 0;         // over non-empty rows, O
  double max_rel_err = 0;         // |o - ref| / |ref| over elements with |ref| > atol
  double max_lse_err = 0;         // |lse - ref| over non-empty rows
  double max_lse_rel_err = 0;     // |lse - ref| / max(1, |ref|): the unit of atol_lse
  // The errors in the units of the rule: error / allowed error, so that <= 1 passes.
  double o_err_ratio = 0;    // max |o - ref| / (atol + rtol |ref|) over finite O of non-empty rows
  double lse_err_ratio = 0;  // max |lse - ref| / (atol_lse max(1, |ref|)) over finite LSE
  bool lse_judged = true;    // false when the result carries no LSE (O judged alone)
  // How the empty rows that fail do so — the choices other libraries make for them.
  std::int64_t empty_o_nonzero = 0;   // O finite but not exactly 0
  std::int64_t empty_o_nan = 0;       // O holds NaN
  std::int64_t empty_o_inf = 0;       // O holds ±inf (and no NaN)
  std::int64_t empty_lse_posinf = 0;  // LSE = +inf (FlashAttention-2)
  std::int64_t empty_lse_zero = 0;    // LSE = 0 (PyTorch's CPU and memory-efficient kernels)
  std::int64_t empty_lse_nan = 0;     // LSE = NaN
  std::int64_t empty_lse_finite = 0;  // LSE another finite value
  // The first failing row (in row-major order) of each kind, and for O the element (for
  // empty rows: every bad one, NaN and inf included).
  std::optional<failure_site> first_nan, first_inf, first_empty, first_wrong;
  // The worst failing rows (NaN, inf and empty rows first, then by err_ratio, then row order),
  // at most the number compare() was asked to keep.
  std::vector<failing_row> worst;
  bool pass() const {
    return nan_rows == 0 && inf_rows == 0 && empty_rows_bad == 0 && bad_elements == 0;
  }
};

// o: row-major (B, Hq, Lq, Dv), lse: row-major (B, Hq, Lq), both as float or double. lse may
// be null for a result without LSE: O is judged alone and lse_judged is false. keep_worst: how
// many failing rows to keep in report.worst.
template <class T>
conformance_report compare(const reference::golden& g, const T* o, const T* lse,
                           const tolerance& tol, std::size_t keep_worst = 0);

extern template conformance_report compare(const reference::golden&, const float*, const float*,
                                           const tolerance&, std::size_t);
extern template conformance_report compare(const reference::golden&, const double*, const double*,
                                           const tolerance&, std::size_t);

}  // namespace flashref
