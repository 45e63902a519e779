#pragma once
// bfloat16 bits on the host, for the CUDA tests' device copies.

#include <cstdint>
#include <cstring>

namespace flashref::test {

// The bf16 bits of x, rounded to nearest even (a value bf16 represents keeps its bits; NaN and
// inf keep their class).
inline std::uint16_t bf16_bits(float x) {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  return std::uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float from_bf16_bits(std::uint16_t b) {
  const std::uint32_t u = std::uint32_t(b) << 16;
  float x = 0;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

}  // namespace flashref::test
