#pragma once
// merge_partials (SPEC §5): combine two partial results over disjoint key sets.
//   LSE = logaddexp(LSE_a, LSE_b),  O = O_a exp(LSE_a - LSE) + O_b exp(LSE_b - LSE)
// The identity is (0, -inf): merging with an empty part returns the other part, and merging
// two empty parts gives (0, -inf). The operator is associative; the online softmax is a fold
// of it. Used by split-KV decoding, context parallelism and user code.

#include <cstdint>
#include <type_traits>

#include <xtensor/xtensor.hpp>

#include "flashref/reference/online_softmax.hpp"

namespace flashref {

// One row: o_a, o_b and o have dv elements (o may alias o_a or o_b).
template <class T>
inline T merge_partials(const T* o_a, std::type_identity_t<T> lse_a, const T* o_b,
                        std::type_identity_t<T> lse_b, std::int64_t dv, T* o) {
  const merge_weights<T> w = merge_weights_of(lse_a, lse_b);
  for (std::int64_t d = 0; d < dv; ++d)
    o[d] = w.w_a * o_a[d] + w.w_b * o_b[d];
  return w.lse;
}

template <class T>
struct partial_result {
  xt::xtensor<T, 4> o;    // (B, Hq, Lq, Dv)
  xt::xtensor<T, 3> lse;  // (B, Hq, Lq)
};

// Whole tensors; throws problem_error when the shapes of a and b differ.
template <class T>
partial_result<T> merge_partials(const partial_result<T>& a, const partial_result<T>& b);

extern template partial_result<float> merge_partials(const partial_result<float>&,
                                                     const partial_result<float>&);
extern template partial_result<double> merge_partials(const partial_result<double>&,
                                                      const partial_result<double>&);

}  // namespace flashref
