#pragma once
// bfloat16 and float16 values as their 16-bit patterns, the storage of the CPU backend's
// half-precision entry (attention.hpp): conversions to and from float, round to nearest even.
// Plain C++ (no instruction set of its own); the kernels convert whole registers.

#include <bit>
#include <cstdint>

namespace flashref::cpu {

// float -> bfloat16 bits, round to nearest even; NaN stays NaN (quiet), ±inf stays ±inf.
inline std::uint16_t bf16_from_float(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((u >> 16) | 0x40u);  // NaN
  return std::uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_to_float(std::uint16_t h) {
  return std::bit_cast<float>(std::uint32_t(h) << 16);
}

// float -> IEEE binary16 bits, round to nearest even (subnormals kept, overflow to ±inf).
inline std::uint16_t f16_from_float(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return std::uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return std::uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                       // below 2^-14: subnormal
    // The value in units of 2^-24, rounded to nearest even: add it to 0.5 (a float whose
    // last mantissa bit is 2^-24) and read the low bits of the rounded sum.
    const float f = std::bit_cast<float>(a) + 0.5f;
    return std::uint16_t(sign | (std::bit_cast<std::uint32_t>(f) - 0x3f000000u));
  }
  const std::uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u;  // rebias 127 -> 15
  return std::uint16_t(sign | (r >> 13));
}

inline float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));  // inf, NaN
  if (e == 0) {  // zero or subnormal: m · 2^-24, exact in float
    const float f = float(m) * 5.9604644775390625e-8f;
    return sign != 0 ? -f : f;
  }
  return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}

}  // namespace flashref::cpu
