#pragma once
// Helpers of the CUDA tests: CUDA errors as Catch2 failures, bfloat16 bits on the host.

#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace flashref::test {

// A CUDA call that must succeed: on failure the assertion shows the error's name.
inline void cuda_check(cudaError_t e) {
  REQUIRE(std::string(cudaGetErrorName(e)) == "cudaSuccess");
}

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

// A (B, H, L, X) tensor read back from the bytes `raw` of its device allocation: element
// (b, h, i, x) at element offset + b s[0] + h s[1] + i s[2] + x s[3], float32 or (f32 false)
// bf16; returned row-major as float.
inline std::vector<float> strided_floats(const std::vector<unsigned char>& raw, bool f32,
                                         std::int64_t offset,
                                         const std::array<std::int64_t, 4>& shape,
                                         const std::array<std::int64_t, 4>& s) {
  std::vector<float> out;
  for (std::int64_t b = 0; b < shape[0]; ++b)
    for (std::int64_t h = 0; h < shape[1]; ++h)
      for (std::int64_t i = 0; i < shape[2]; ++i)
        for (std::int64_t x = 0; x < shape[3]; ++x) {
          const std::int64_t at = offset + b * s[0] + h * s[1] + i * s[2] + x * s[3];
          if (f32) {
            float v = 0;
            std::memcpy(&v, raw.data() + at * 4, 4);
            out.push_back(v);
          } else {
            std::uint16_t v = 0;
            std::memcpy(&v, raw.data() + at * 2, 2);
            out.push_back(from_bf16_bits(v));
          }
        }
  return out;
}

}  // namespace flashref::test
