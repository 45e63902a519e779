#pragma once
// The vectorised exponential, written once for every instruction set (Cephes' expf):
// exp(x) = 2^n · exp(r), n = round(x · log2 e), r = x - n · ln 2 (ln 2 split in two parts so
// that n · kLn2Hi is exact), exp(r) ≈ 1 + r + r² · P(r) on |r| <= ln 2 / 2; about 2 ulp.
// Inputs below kExpLo give exactly 0 (that covers x = -inf, a masked key); NaN stays NaN.

namespace flashref::cpu::detail {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpLo = -87.3365447f;  // exp(kExpLo) == FLT_MIN: below, the result is 0
constexpr float kExpHi = 88.3762626f;   // above, the result would overflow
constexpr float kExpP0 = 1.9875691500e-4f;
constexpr float kExpP1 = 1.3981999507e-3f;
constexpr float kExpP2 = 8.3334519073e-3f;
constexpr float kExpP3 = 4.1665795894e-2f;
constexpr float kExpP4 = 1.6666665459e-1f;
constexpr float kExpP5 = 5.0000001201e-1f;

// exp of every lane of one register of the instruction set V. Besides its arithmetic (set1,
// add, mul, fma), V supplies the steps that differ per instruction set:
//   below(x, lo)        the lanes with x < lo (false for NaN), in V's mask type
//   clamp(x, lo, hi)    x limited to [lo, hi], NaN kept
//   fnma(a, b, c)       c - a · b (fused where the instruction set fuses)
//   round_nearest(x)    to the nearest integer, ties to even
//   scale_pow2(y, n)    y · 2^n for integral n in [-126, 127] (NaN lanes of y stay NaN)
//   zero_where(m, y)    y with the lanes of m set to 0
template <class V>
typename V::reg exp_lanes(typename V::reg x) {
  using reg = typename V::reg;
  const auto under = V::below(x, V::set1(kExpLo));
  x = V::clamp(x, kExpLo, kExpHi);
  const reg n = V::round_nearest(V::mul(x, V::set1(kLog2e)));
  reg r = V::fnma(n, V::set1(kLn2Hi), x);  // r = x - n · ln 2, in two exact-ish steps
  r = V::fnma(n, V::set1(kLn2Lo), r);
  reg y = V::set1(kExpP0);  // P(r) by Horner
  y = V::fma(y, r, V::set1(kExpP1));
  y = V::fma(y, r, V::set1(kExpP2));
  y = V::fma(y, r, V::set1(kExpP3));
  y = V::fma(y, r, V::set1(kExpP4));
  y = V::fma(y, r, V::set1(kExpP5));
  y = V::fma(y, V::mul(r, r), V::add(r, V::set1(1.0f)));  // exp(r) = 1 + r + r² P(r)
  return V::zero_where(under, V::scale_pow2(y, n));       // 2^n · exp(r); 0 below kExpLo
}

// 2^t of the softmax's exponents, t = (s - m) · log2 e <= 0 (-inf for a masked key, NaN
// kept), for every lane of one register of V: n = round(t), 2^(t - n) by a polynomial of degree
// 5 on [-1/2, 1/2] (fitted for relative error: 1.7e-7 at most in float32, exactly 1 at t = 0),
// scaled by 2^n. Below kExp2Lo (2^t < FLT_MIN) the result is exactly 0, as exp_lanes gives
// below kExpLo. Eleven instructions against exp_lanes' seventeen: no upper clamp (t <= 0), and
// the reduction is exact (t - n needs no split ln 2). The error of t itself (the rounding of
// (s - m) · log2 e, relative 2^-24) changes p by at most ln 2 · |t| · 2^-24 relative, under
// 1e-6 wherever p is above 2^-17.
constexpr float kExp2Lo = -126.0f;
constexpr float kExp2P0 = 1.326472731307149e-3f;
constexpr float kExp2P1 = 9.671512991189957e-3f;
constexpr float kExp2P2 = 5.550733581185341e-2f;
constexpr float kExp2P3 = 2.402224242687225e-1f;
constexpr float kExp2P4 = 6.931470036506653e-1f;

// 2^t by that polynomial, scaled by 2^round(t), NaN kept: for t >= kExp2Lo on every V, lower t
// only where V::scale_pow2 takes any integral n (AVX-512's scalef, which the bf16 softmax uses).
template <class V>
typename V::reg exp2_poly_scaled(typename V::reg t) {
  using reg = typename V::reg;
  const reg n = V::round_nearest(t);
  const reg f = V::sub(t, n);
  reg y = V::set1(kExp2P0);
  y = V::fma(y, f, V::set1(kExp2P1));
  y = V::fma(y, f, V::set1(kExp2P2));
  y = V::fma(y, f, V::set1(kExp2P3));
  y = V::fma(y, f, V::set1(kExp2P4));
  y = V::fma(y, f, V::set1(1.0f));
  return V::scale_pow2(y, n);
}

template <class V>
typename V::reg exp2_softmax_lanes(typename V::reg t) {
  const auto under = V::below(t, V::set1(kExp2Lo));
  t = V::max(V::set1(kExp2Lo), t);  // max gives its second operand for a NaN
  return V::zero_where(under, exp2_poly_scaled<V>(t));
}

}  // namespace flashref::cpu::detail
