// The kernels compiled for AVX-512 with the bfloat16 dot product (AVX512_BF16: vdpbf16ps).
// bfloat16 problems take the dot-product tile kernel (kernel_bf16_body.inc); everything else
// the AVX-512 fp32 kernels, compiled here again. Only called after a run-time check of the
// processor (attention.cpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "avx512_intrinsics.hpp"
#include "kernel.hpp"

#if defined(__clang__)
#pragma clang attribute push(                                                               \
    __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
#endif

#include "isa_exp.hpp"

namespace flashref::cpu::detail::avx512_bf16 {
namespace {

#include "vec_avx512.inc"

#include "kernel_body.inc"  // after vec

inline __m512bh pair_of(const std::uint16_t* p) {  // one bfloat16 pair, in every lane
  std::uint32_t x;
  std::memcpy(&x, p, sizeof x);
  return __m512bh(_mm512_set1_epi32(int(x)));
}

inline __m512bh pairs_at(const std::uint16_t* p) {  // 16 bfloat16 pairs
  return __m512bh(_mm512_loadu_si512(p));
}

// Sᵀ block (MR keys, NV·16 queries) = K rows (MR, Dkp) · Qᵀ, a pair of d per instruction.
template <int MR, int NV>
inline void qk_block(std::int64_t Dkp, const std::uint16_t* k, std::int64_t ldk,
                     const std::uint16_t* qv, std::int64_t ldq, float* s, std::int64_t lds) {
  reg c[MR][NV];
  FLASHREF_UNROLL
  for (int r = 0; r < MR; ++r) {
    FLASHREF_UNROLL
    for (int v = 0; v < NV; ++v)
      c[r][v] = vec::zero();
  }
  for (std::int64_t d = 0; d < Dkp; d += 2) {
    __m512bh b[NV];
    FLASHREF_UNROLL
    for (int v = 0; v < NV; ++v)
      b[v] = pairs_at(qv + (d / 2) * ldq + v * 2 * W);
    FLASHREF_UNROLL
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = pair_of(k + r * ldk + d);
      FLASHREF_UNROLL
      for (int v = 0; v < NV; ++v)
        c[r][v] = _mm512_dpbf16_ps(c[r][v], a, b[v]);
    }
  }
  FLASHREF_UNROLL
  for (int r = 0; r < MR; ++r) {
    FLASHREF_UNROLL
    for (int v = 0; v < NV; ++v)
      vec::store(s + r * lds + v * W, c[r][v]);
  }
}

// accᵀ block (MR value columns, NV·16 queries) += Vᵀ (MR, keys) · Pᵀ over the keys of the
// runs in order, a pair of keys per instruction; the accumulators stay in registers across
// the runs.
template <int MR, int NV>
inline void pv_block(const vt_run* runs, int nr, std::int64_t c0, const std::uint16_t* pv,
                     std::int64_t ldp, float* acc, std::int64_t lda) {
  reg c[MR][NV];
  FLASHREF_UNROLL
  for (int r = 0; r < MR; ++r) {
    FLASHREF_UNROLL
    for (int u = 0; u < NV; ++u)
      c[r][u] = vec::load(acc + r * lda + u * W);
  }
  const std::uint16_t* pj = pv;  // the run's first pair row
  for (int n = 0; n < nr; ++n) {
    const std::int64_t ldv = runs[n].ldv;
    const std::uint16_t* vt = runs[n].vt + c0 * ldv;
    for (std::int64_t j = 0; j < runs[n].nk32; j += 2, pj += ldp) {
      __m512bh b[NV];
      FLASHREF_UNROLL
      for (int u = 0; u < NV; ++u)
        b[u] = pairs_at(pj + u * 2 * W);
      FLASHREF_UNROLL
      for (int r = 0; r < MR; ++r) {
        const __m512bh a = pair_of(vt + r * ldv + j);
        FLASHREF_UNROLL
        for (int u = 0; u < NV; ++u)
          c[r][u] = _mm512_dpbf16_ps(c[r][u], a, b[u]);
      }
    }
  }
  FLASHREF_UNROLL
  for (int r = 0; r < MR; ++r) {
    FLASHREF_UNROLL
    for (int u = 0; u < NV; ++u)
      vec::store(acc + r * lda + u * W, c[r][u]);
  }
}

struct dot {
  static constexpr int MR = 8, NV = 2;  // 16 accumulators (6 x 4 measured 1-4 % slower here)
  static constexpr std::int64_t kStridePad = 16;  // bf16_layout::ldt

  static void begin() {}
  static void end() {}

  // The peak of vdpbf16ps: 16 independent accumulators, each instruction 16 lanes x 2
  // multiply-adds. The sums grow by 2e-6 a round: never near float32's limits.
  static double peak_loop(std::int64_t iterations) {
    constexpr int N = 16;
    reg a[N];
    for (int k = 0; k < N; ++k)
      a[k] = vec::set1(0.001f * float(k));
    const __m512bh x = __m512bh(_mm512_set1_epi16(std::int16_t(bf16_from_float(1e-3f))));
    for (std::int64_t it = 0; it < iterations; ++it)
      for (int k = 0; k < N; ++k)
        a[k] = _mm512_dpbf16_ps(a[k], x, x);
    reg sum = vec::zero();
    for (int k = 0; k < N; ++k)
      sum = vec::add(sum, a[k]);
    volatile float sink = vec::reduce_add(sum);
    (void)sink;
    return 2.0 * 2.0 * double(W) * double(N) * double(iterations);
  }

  static void qk(std::int64_t nk, std::int64_t nvec, std::int64_t Dkp, const std::uint16_t* k,
                 std::int64_t ldk, const std::uint16_t* qv, std::int64_t ldq, float* s,
                 std::int64_t lds) {
    for (std::int64_t iv = 0; iv < nvec; iv += NV) {
      with_constant<NV>(int(std::min<std::int64_t>(NV, nvec - iv)), [&](auto nv) {
        std::int64_t j = 0;
        for (; j + MR <= nk; j += MR)
          qk_block<MR, nv()>(Dkp, k + j * ldk, ldk, qv + iv * 2 * W, ldq, s + j * lds + iv * W,
                             lds);
        if (j < nk) {
          with_constant<MR - 1>(int(nk - j), [&](auto mr) {
            qk_block<mr(), nv()>(Dkp, k + j * ldk, ldk, qv + iv * 2 * W, ldq, s + j * lds + iv * W,
                                 lds);
          });
        }
      });
    }
  }

  static void pv(const vt_run* runs, int nr, std::int64_t nvec, std::int64_t Dv,
                 const std::uint16_t* p, std::int64_t ldp, float* acc, std::int64_t lda) {
    for (std::int64_t iv = 0; iv < nvec; iv += NV) {
      with_constant<NV>(int(std::min<std::int64_t>(NV, nvec - iv)), [&](auto nv) {
        std::int64_t c = 0;
        for (; c + MR <= Dv; c += MR)
          pv_block<MR, nv()>(runs, nr, c, p + iv * 2 * W, ldp, acc + c * lda + iv * W, lda);
        if (c < Dv) {
          with_constant<MR - 1>(int(Dv - c), [&](auto mr) {
            pv_block<mr(), nv()>(runs, nr, c, p + iv * 2 * W, ldp, acc + c * lda + iv * W, lda);
          });
        }
      });
    }
  }
};

#include "kernel_bf16_body.inc"  // and its table()

}  // namespace

}  // namespace flashref::cpu::detail::avx512_bf16

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace flashref::cpu::detail {
const kernel_table& avx512_bf16_kernels() {
  return avx512_bf16::table();
}
}  // namespace flashref::cpu::detail
