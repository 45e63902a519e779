#pragma once
// The pass criterion of SPEC §3, in one place: tolerances per input dtype and the comparison
// of a result (O, LSE) against the float64 golden values.

#include <cstdint>
#include <string>

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

struct conformance_report {
  std::int64_t rows = 0;            // B * Hq * Lq
  std::int64_t empty_rows = 0;      // rows with no visible key (golden LSE == -inf)
  std::int64_t empty_rows_bad = 0;  // empty rows whose O is not exactly 0 or LSE is not -inf
  std::int64_t nan_rows = 0;        // rows with a NaN (or inf) in O or a NaN / +inf in LSE
  std::int64_t bad_elements = 0;    // finite elements outside the tolerance
  double max_abs_err = 0;           // over non-empty rows, O
  double max_rel_err = 0;           // |o - ref| / |ref| over elements with |ref| > atol
  double max_lse_err = 0;           // over non-empty rows
  bool lse_judged = true;           // false when the result carries no LSE (O judged alone)
  // How the empty rows that fail do so — the choices other libraries make for them.
  std::int64_t empty_o_nonzero = 0;   // O not exactly 0
  std::int64_t empty_lse_posinf = 0;  // LSE = +inf (FlashAttention-2)
  std::int64_t empty_lse_zero = 0;    // LSE = 0
  std::int64_t empty_lse_nan = 0;     // LSE = NaN
  std::int64_t empty_lse_finite = 0;  // LSE another finite value
  bool pass() const { return nan_rows == 0 && empty_rows_bad == 0 && bad_elements == 0; }
};

// o: row-major (B, Hq, Lq, Dv), lse: row-major (B, Hq, Lq), both as float or double. lse may
// be null for a result without LSE: O is judged alone and lse_judged is false.
template <class T>
conformance_report compare(const reference::golden& g, const T* o, const T* lse,
                           const tolerance& tol);

extern template conformance_report compare(const reference::golden&, const float*, const float*,
                                           const tolerance&);
extern template conformance_report compare(const reference::golden&, const double*, const double*,
                                           const tolerance&);

}  // namespace flashref
