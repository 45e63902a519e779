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

}  // namespace flashref::cpu::detail
