#pragma once
// Helpers of the CUDA tests: CUDA errors as Catch2 failures, bfloat16 bits on the host.

#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <string>

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

}  // namespace flashref::test
