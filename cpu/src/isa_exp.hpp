#pragma once
// Constants of the vectorised exponential shared by every instruction set (Cephes' expf):
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

}  // namespace flashref::cpu::detail
