#pragma once
// The online-softmax state of one query row (Milakov & Gimelshein 2018, "Online normalizer
// calculation for softmax"; Dao et al. 2022/2023, FlashAttention). Host and device code use
// this one struct; every tiled path in flashref — the scalar reference, the spec function,
// merge_partials, the CPU and CUDA backends — goes through its named steps:
//
//   exp_old = st.update_max(block_max);   // m_new = max(m_old, block_max); exp(m_old - m_new)
//   acc *= exp_old;  st.rescale(exp_old); // rescale the accumulator and the running sum
//   p_j = st.prob(score_j);               // exp(score_j - m_new), 0 for a masked key
//   st.absorb(sum_j p_j);  acc += sum_j p_j * v_j;
//   auto [out_scale, lse] = st.finalize();  // out = acc * out_scale
//
// The backward pass rebuilds a finished row from its LSE alone (FlashAttention's recomputation):
//   p_j = online_softmax<T>::from_lse(lse).prob(score_j);  // exp(score_j - LSE), 0 if masked
//
// Invariant after every step, over the keys seen so far:  s == Σ exp(score_j - m)  and
// acc == Σ exp(score_j - m) v_j, with m the largest score seen (or -inf if none was visible).

#include <cmath>

#include "flashref/reference/config.hpp"

namespace flashref {

namespace detail {
template <class T>
FLASHREF_INLINE T exp_(T x) {
#if defined(__CUDA_ARCH__)
  return ::exp(x);
#else
  return std::exp(x);
#endif
}
template <class T>
FLASHREF_INLINE T log_(T x) {
#if defined(__CUDA_ARCH__)
  return ::log(x);
#else
  return std::log(x);
#endif
}
}  // namespace detail

template <class T>
struct finalized {
  T out_scale;  // 1/s, or 0 for a row with no visible key
  T lse;        // m + log(s), or -inf for a row with no visible key
};

template <class T>
struct online_softmax {
  T m = T(-INFINITY);  // running max of the visible scores
  T s = T(0);          // running sum Σ exp(score_j - m)

  // THE -inf GUARD — the only one in flashref.
  // m == -inf means no visible key has been seen, so s == 0 and acc == 0. Exponents are
  // taken against 0 instead, so -inf - (-inf) = NaN can never be formed; exp(-inf - 0) = 0.
  FLASHREF_INLINE static T exp_base(T m) { return m == T(-INFINITY) ? T(0) : m; }

  // Raise the running max to cover a block whose largest score is block_max and return the
  // factor exp(m_old - m_new) by which s and acc must be rescaled: 1 when the max does not
  // move, < 1 when it rises, and 0 on the first visible block (m_old == -inf: nothing to keep).
  FLASHREF_INLINE T update_max(T block_max) {
    const T m_old = m;
    m = block_max > m ? block_max : m;
    return detail::exp_(m_old - exp_base(m));
  }

  // The unnormalised probability of a score relative to the current max: exp(score - m).
  // A masked key (score == -inf) gives exactly 0.
  FLASHREF_INLINE T prob(T score) const { return detail::exp_(score - exp_base(m)); }

  // A finished row as a state: m = LSE and s = 1, since Σ exp(score_j - LSE) = 1. Its prob()
  // is the backward's recomputation P_j = exp(score_j - LSE) (SPEC §9) through the guard above:
  // an empty row (LSE = -inf, every score masked to -inf) gives exp(-inf - 0) = 0, never the
  // NaN of exp(-inf - (-inf)).
  FLASHREF_INLINE static online_softmax from_lse(T lse) { return {lse, T(1)}; }

  // s = s * exp_old; the caller applies the same factor to its accumulator (acc *= exp_old).
  FLASHREF_INLINE void rescale(T exp_old) { s *= exp_old; }

  // s += Σ p over the block just processed.
  FLASHREF_INLINE void absorb(T p_sum) { s += p_sum; }

  // The one final division, as a scale: an empty sum (no visible key) gives out = 0 and
  // lse = -inf — never 0/0. (A NaN read from an input stays NaN: it is not an empty sum.)
  FLASHREF_INLINE finalized<T> finalize() const {
    if (s == T(0)) return {T(0), T(-INFINITY)};
    return {T(1) / s, m + detail::log_(s)};
  }
};

// Merge weights of two partial results over disjoint key sets (SPEC §5). A partial result
// (O, LSE) acts like a single key with score LSE and value O, so merging is the online softmax
// run over two such keys; the identity (0, -inf) needs no guard of its own.
template <class T>
struct merge_weights {
  T w_a;  // O = w_a * O_a + w_b * O_b
  T w_b;
  T lse;  // logaddexp(LSE_a, LSE_b)
};

template <class T>
FLASHREF_INLINE merge_weights<T> merge_weights_of(T lse_a, T lse_b) {
  online_softmax<T> st;
  st.update_max(lse_a);
  T w_a = st.prob(lse_a);  // acc = w_a * O_a
  st.absorb(w_a);
  const T exp_old = st.update_max(lse_b);
  w_a *= exp_old;  // acc *= exp_old
  st.rescale(exp_old);
  T w_b = st.prob(lse_b);  // acc += w_b * O_b
  st.absorb(w_b);
  const finalized<T> fin = st.finalize();
  return {w_a * fin.out_scale, w_b * fin.out_scale, fin.lse};
}

}  // namespace flashref
