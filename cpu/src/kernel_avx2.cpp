// The kernels compiled for AVX2 + FMA (+ F16C, which every AVX2 processor has). Only called after a
// run-time check of the processor (attention.cpp); the rest of the library is compiled for the
// baseline.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <immintrin.h>

#include "kernel.hpp"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

// After the target pragmas: exp_lanes is compiled for this instruction set.
#include "isa_exp.hpp"

namespace flashref::cpu::detail::avx2 {
namespace {

struct vec {
  using reg = __m256;
  static constexpr isa kIsa = isa::avx2;
  static constexpr int W = 8;
  static constexpr int kQkRows = 6, kQkVecs = 2;  // 12 accumulators of 16 registers
  static constexpr int kPvRows = 6, kPvVecs = 2;
  static constexpr int kGemmRows = 6, kGemmVecs = 2;  // the backward's
  static constexpr int kPeakAccumulators = 12;
  static constexpr std::int64_t kTileQ = 128, kTileK = 128;
  static constexpr std::int64_t kFwdTileQ = kTileQ;  // the forward's (kernel_table.inc)

  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg load(const bf16_bits* p) {  // bfloat16 bits are the high half of a float's
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static reg load(const f16_bits* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg zero() { return _mm256_setzero_ps(); }
  // dst[d * ld + i] = src[i * s_row + d] for a W x W block, through registers.
  static void transpose(const float* src, std::int64_t s_row, float* dst, std::int64_t ld) {
    reg r[8], t[8], u[8];
    for (int i = 0; i < 8; ++i)
      r[i] = _mm256_loadu_ps(src + i * s_row);
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int k = 0; k < 4; ++k) {
      _mm256_storeu_ps(dst + k * ld, _mm256_permute2f128_ps(u[k], u[4 + k], 0x20));
      _mm256_storeu_ps(dst + (4 + k) * ld, _mm256_permute2f128_ps(u[k], u[4 + k], 0x31));
    }
  }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static float reduce_add(reg x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float reduce_max(reg x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // The steps of exp_lanes (isa_exp.hpp) that differ per instruction set.
  static reg below(reg x, reg lo) { return _mm256_cmp_ps(x, lo, _CMP_LT_OQ); }
  static reg clamp(reg x, float lo, float hi) {
    return _mm256_min_ps(set1(hi), _mm256_max_ps(set1(lo), x));  // keeps NaN
  }
  static reg fnma(reg a, reg b, reg c) { return _mm256_fnmadd_ps(a, b, c); }
  static reg round_nearest(reg x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static reg scale_pow2(reg y, reg n) {  // 2^n from the exponent bits
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return mul(y, _mm256_castsi256_ps(e));
  }
  static reg zero_where(reg m, reg y) { return _mm256_andnot_ps(m, y); }
  static reg exp(reg x) { return exp_lanes<vec>(x); }
};

#include "kernel_body.inc"

#include "backward_body.inc"  // uses the helpers of kernel_body.inc

#include "kernel_table.inc"  // after both

}  // namespace

}  // namespace flashref::cpu::detail::avx2

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace flashref::cpu::detail {
const kernel_table& avx2_kernels() {
  return avx2::table();
}
}  // namespace flashref::cpu::detail
