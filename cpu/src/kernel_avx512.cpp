// The kernels compiled for AVX-512 (F + DQ). Only called after a run-time check of the
// processor (attention.cpp); the rest of the library is compiled for the baseline.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

// GCC 12's AVX-512 intrinsics initialise a register from itself (`__m512 __Y = __Y;`, GCC bug
// 105593), which -Wuninitialized reports once the intrinsics are inlined here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include "kernel.hpp"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx2,fma"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx2,fma")
#endif

// After the target pragmas: exp_lanes is compiled for this instruction set.
#include "isa_exp.hpp"

namespace flashref::cpu::detail::avx512 {
namespace {

struct vec {
  using reg = __m512;
  static constexpr int W = 16;
  static constexpr int kQkRows = 8, kQkVecs = 2;  // 16 accumulators
  static constexpr int kPvRows = 8, kPvVecs = 2;
  static constexpr int kPeakAccumulators = 16;
  static constexpr std::int64_t kTileQ = 128, kTileK = 128;

  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg zero() { return _mm512_setzero_ps(); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static float reduce_add(reg x) { return _mm512_reduce_add_ps(x); }
  static float reduce_max(reg x) { return _mm512_reduce_max_ps(x); }
  // The steps of exp_lanes (isa_exp.hpp) that differ per instruction set.
  static __mmask16 below(reg x, reg lo) { return _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ); }
  static reg clamp(reg x, float lo, float hi) {
    return _mm512_min_ps(set1(hi), _mm512_max_ps(set1(lo), x));  // keeps NaN
  }
  static reg fnma(reg a, reg b, reg c) { return _mm512_fnmadd_ps(a, b, c); }
  static reg round_nearest(reg x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static reg scale_pow2(reg y, reg n) { return _mm512_scalef_ps(y, n); }
  static reg zero_where(__mmask16 m, reg y) { return _mm512_maskz_mov_ps(__mmask16(~m), y); }
  static reg exp(reg x) { return exp_lanes<vec>(x); }
};

#include "kernel_body.inc"

#include "backward_body.inc"  // uses the helpers of kernel_body.inc

}  // namespace

const kernel_table& table() {
  static const kernel_table t{isa::avx512,      W,   vec::kTileQ, vec::kTileK,
                              workspace_floats, run, fma_loop,    backward_workspace_floats,
                              run_backward};
  return t;
}

}  // namespace flashref::cpu::detail::avx512

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace flashref::cpu::detail {
const kernel_table& avx512_kernels() {
  return avx512::table();
}
}  // namespace flashref::cpu::detail
