#pragma once
// The backward pass of SPEC §9. Given a problem whose o and lse hold the forward's O and LSE
// (read, not written), and an upstream gradient dO, compute the gradients of Σ O ∘ dO:
//
//   P_ij    = exp(S_ij - LSE_i)  for a visible pair, exactly 0 otherwise
//   Delta_i = Σ_d dO_id O_id     (= Σ_j P_ij dP_ij)
//   dP_ij   = dO_i · V_j,   dS_ij = P_ij (dP_ij - Delta_i)
//   dQ_i    = scale Σ_j dS_ij K_j,   dK_j = scale Σ_i dS_ij Q_i,   dV_j = Σ_i P_ij dO_i
//
// An empty row (LSE = -inf) has P = 0: dQ_i = 0 and it adds nothing to dK, dV. A key that no
// row sees (masked everywhere, or at or beyond kv_len) gets dK_j = dV_j = 0 exactly. With
// GQA/MQA the dK, dV of a key/value head sum the query heads of its group.

#include <array>
#include <cstdint>
#include <vector>

#include "flashref/reference/naive.hpp"
#include "flashref/reference/problem.hpp"
#include "flashref/reference/tiled.hpp"

namespace flashref {

// The backward's own tensors, beside a problem whose o and lse hold the forward's results.
struct attention_gradients {
  strided<const float, 4> d_o;  // (B, Hq, Lq, Dv)  upstream gradient
  strided<float, 4> dq;         // (B, Hq, Lq, D)   output
  strided<float, 4> dk;         // (B, Hk, Lk, D)   output
  strided<float, 4> dv;         // (B, Hk, Lk, Dv)  output
};

// Throws problem_error naming the first offending field: the problem itself (validate), an
// LSE (the backward needs it), and the shapes of dO, dQ, dK, dV.
void validate_backward(const attention_problem& p, const attention_gradients& g);

// FLOPs of a backward per SPEC §9: 2.5 x the forward's dense count (five matrix products
// instead of two); callers apply the same density and causal factors as for the forward.
double backward_flops(const attention_problem& p);

// SPEC §9's pass criterion for one gradient X of golden value ref:
// |x - ref| <= atol + rtol |ref|, with atol = rtol * max|ref|: float32 inputs rtol = 1e-4,
// bfloat16 2^-5, float16 2^-8.
struct gradient_tolerance {
  double atol = 0;  // already scaled by max|ref|
  double rtol = 0;
};
gradient_tolerance default_gradient_tolerance(input_dtype dtype, double max_abs_ref);

// One gradient tensor judged against its golden value, viewed as (rows, cols) row-major.
// Rows flagged `zero` must be exactly 0: the dQ rows of empty rows, the dK and dV rows of keys
// no row sees. How those fail is counted apart, since that is the backward's own bug class.
struct gradient_report {
  std::int64_t elements = 0;
  std::int64_t bad_elements = 0;  // finite, outside the tolerance, in rows that are not zero rows
  std::int64_t nonfinite = 0;     // NaN or ±inf in rows that are not zero rows
  double max_abs_err = 0;         // over rows that are not zero rows
  double max_ref = 0;             // max|ref|, the scale of atol
  std::int64_t zero_rows = 0;
  std::int64_t zero_rows_nan = 0;      // a zero row holding NaN or ±inf
  std::int64_t zero_rows_nonzero = 0;  // a zero row finite but not exactly 0
  bool pass() const {
    return bad_elements == 0 && nonfinite == 0 && zero_rows_nan == 0 && zero_rows_nonzero == 0;
  }
};

// ref and got: row-major (rows, cols) with rows = ref.size() / cols; zero: (rows) flags, or
// empty for none. The tolerance is default_gradient_tolerance(dtype, max|ref|).
gradient_report compare_gradient(const std::vector<double>& ref, const float* got,
                                 std::int64_t cols, const std::vector<char>& zero,
                                 input_dtype dtype);

}  // namespace flashref

namespace flashref::reference {

struct golden_gradients {
  std::array<std::int64_t, 4> q_shape{};  // (B, Hq, Lq, D)
  std::array<std::int64_t, 4> k_shape{};  // (B, Hk, Lk, D)
  std::array<std::int64_t, 4> v_shape{};  // (B, Hk, Lk, Dv)
  std::vector<double> dq;                 // row-major (B, Hq, Lq, D)
  std::vector<double> dk;                 // row-major (B, Hk, Lk, D)
  std::vector<double> dv;                 // row-major (B, Hk, Lk, Dv)
  std::vector<char> row_empty;            // (B, Hq, Lq) the row sees no key
  std::vector<char> key_unseen;           // (B, Hk, Lk) no row of the group sees the key
};

// The golden gradients in float64 from the inputs and dO alone (d_o: row-major
// (B, Hq, Lq, Dv)): P is materialised from a three-pass softmax, Delta is Σ_j P_ij dP_ij. It
// reads neither the problem's o nor its lse and shares no code with the tiled paths.
golden_gradients naive_attention_backward(const attention_problem& p,
                                          const strided<const float, 4>& d_o);

// The scalar tiled backward in the FlashAttention-2 order: Delta first, then for each key tile
// the query tiles that see it, P recomputed from the stored LSE through the online-softmax
// state's guard. dK, dV are finished per key tile; dQ accumulates over key tiles in key order.
// Accumulates in float64; writes g.dq, g.dk, g.dv.
void tiled_attention_backward(const attention_problem& p, const attention_gradients& g,
                              tile_shape tile = {});

}  // namespace flashref::reference
