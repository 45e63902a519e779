#include "flashref/reference/backward.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

namespace flashref {

namespace {

std::string shape_str(const std::array<std::int64_t, 4>& s) {
  std::ostringstream os;
  os << '[' << s[0] << ", " << s[1] << ", " << s[2] << ", " << s[3] << ']';
  return os.str();
}

template <class T>
void check_tensor(const char* name, const strided<T, 4>& t,
                  const std::array<std::int64_t, 4>& want) {
  if (t.shape != want) {
    throw problem_error(std::string(name) + ": expected shape " + shape_str(want) + ", got " +
                        shape_str(t.shape));
  }
  if (t.data == nullptr && t.size() > 0) {
    throw problem_error(std::string(name) + ": expected a data pointer for " +
                        std::to_string(t.size()) + " elements, got null");
  }
}

}  // namespace

void validate_backward(const attention_problem& p, const attention_gradients& g) {
  validate(p);
  // P is recomputed from the stored LSE: without it the backward has nothing to start from.
  if (p.lse.data == nullptr && p.lse.size() > 0) {
    throw problem_error(
        "lse: expected the forward's LSE (the backward recomputes P from it), "
        "got null");
  }
  const std::int64_t B = p.batch(), Hq = p.heads_q(), Hk = p.heads_k();
  const std::int64_t Lq = p.len_q(), Lk = p.len_k(), D = p.head_dim(), Dv = p.head_dim_v();
  check_tensor("d_o", g.d_o, {B, Hq, Lq, Dv});
  check_tensor("dq", g.dq, {B, Hq, Lq, D});
  check_tensor("dk", g.dk, {B, Hk, Lk, D});
  check_tensor("dv", g.dv, {B, Hk, Lk, Dv});
}

double backward_flops(const attention_problem& p) {
  return 2.5 * dense_flops(p);
}

gradient_tolerance default_gradient_tolerance(input_dtype dtype, double max_abs_ref) {
  double rtol = 1e-4;
  if (dtype == input_dtype::bfloat16) rtol = 0x1p-5;
  if (dtype == input_dtype::float16) rtol = 0x1p-8;
  return {rtol * max_abs_ref, rtol};
}

gradient_report compare_gradient(const std::vector<double>& ref, const float* got,
                                 std::int64_t cols, const std::vector<char>& zero,
                                 input_dtype dtype) {
  gradient_report r;
  r.elements = std::int64_t(ref.size());
  for (double x : ref)
    if (std::isfinite(x)) r.max_ref = std::max(r.max_ref, std::abs(x));
  const gradient_tolerance tol = default_gradient_tolerance(dtype, r.max_ref);
  const std::int64_t rows = cols > 0 ? r.elements / cols : 0;
  for (std::int64_t row = 0; row < rows; ++row) {
    const double* want = ref.data() + row * cols;
    const float* x = got + row * cols;
    if (!zero.empty() && zero[std::size_t(row)]) {  // exactly 0, not merely close
      ++r.zero_rows;
      bool nan = false, nonzero = false;
      for (std::int64_t c = 0; c < cols; ++c) {
        nan = nan || !std::isfinite(x[c]);
        nonzero = nonzero || x[c] != 0.0f;
      }
      if (nan) {
        ++r.zero_rows_nan;
      } else if (nonzero) {
        ++r.zero_rows_nonzero;
      }
      continue;
    }
    for (std::int64_t c = 0; c < cols; ++c) {
      if (!std::isfinite(x[c])) {
        // A NaN golden value (a NaN input) is matched by a NaN, nothing else.
        if (!(std::isnan(x[c]) && std::isnan(want[c]))) ++r.nonfinite;
        continue;
      }
      const double err = std::abs(double(x[c]) - want[c]);
      r.max_abs_err = std::max(r.max_abs_err, err);
      if (!(err <= tol.atol + tol.rtol * std::abs(want[c]))) ++r.bad_elements;
    }
  }
  return r;
}

}  // namespace flashref
