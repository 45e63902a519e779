// The kernels compiled for AMX (Advanced Matrix Extensions: tile registers and tdpbf16ps)
// beside AVX-512 with AVX512_BF16. bfloat16 problems take the dot-product tile kernel
// (kernel_bf16_body.inc) with its two products on tiles; everything else the AVX-512 fp32
// kernels, compiled here again. Only called after a run-time check of the processor and of
// the operating system's grant of the tile state (amx_granted, attention.cpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "avx512_intrinsics.hpp"
#include "kernel.hpp"

#if defined(__clang__)
#pragma clang attribute push(                                                                      \
    __attribute__((                                                                                \
        target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")
#endif

#include "isa_exp.hpp"

namespace flashref::cpu::detail::amx {
namespace {

#include "vec_avx512.inc"

#include "kernel_body.inc"  // after vec

// Tiles 0-3 hold a 2 x 2 block of float32 results (16 x 16 each), 4-5 the A operands
// (16 rows x 32 bfloat16), 6-7 the B operands (16 pair rows x 16 columns x 2).
struct alignas(64) tile_config {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

struct dot {
  static constexpr std::int64_t kStridePad = 0;  // bf16_layout::ldt

  static void begin() {
    tile_config cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
  }
  static void end() { _tile_release(); }

  // The peak of tdpbf16ps: four independent 16 x 16 float32 result tiles, each product 16 x 16
  // x 32 multiply-adds from two A and two B tiles loaded once.
  static double peak_loop(std::int64_t iterations) {
    alignas(64) std::uint16_t ab[16 * 32];
    std::fill(ab, ab + 16 * 32, bf16_from_float(1e-3f));
    alignas(64) float c[16 * 16];
    begin();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, ab, 64);
    _tile_loadd(5, ab, 64);
    _tile_loadd(6, ab, 64);
    _tile_loadd(7, ab, 64);
    for (std::int64_t it = 0; it < iterations; ++it) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c, 64);
    _tile_stored(2, c, 64);
    _tile_stored(3, c, 64);
    end();
    volatile float sink = c[0];
    (void)sink;
    return 2.0 * 4.0 * 16.0 * 16.0 * 32.0 * double(iterations);
  }

  // Sᵀ rows [0, nk rounded up to 16) = K · Qᵀ, 32 x 32 blocks of four result tiles.
  static void qk(std::int64_t nk, std::int64_t nvec, std::int64_t Dkp, const std::uint16_t* k,
                 std::int64_t ldk, const std::uint16_t* qv, std::int64_t ldq, float* s,
                 std::int64_t lds) {
    const std::int64_t rows = round_up(nk, kDotRow), lanes = nvec * W;
    const long sk = long(ldk * 2), sq = long(ldq * 2), ss = long(lds * 4);  // bytes
    for (std::int64_t j = 0; j < rows; j += 2 * kDotRow) {
      const bool two_j = j + kDotRow < rows;
      for (std::int64_t i = 0; i < lanes; i += 2 * W) {
        const bool two_i = i + W < lanes;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (std::int64_t d = 0; d < Dkp; d += kDotK) {
          _tile_loadd(4, k + j * ldk + d, sk);
          _tile_loadd(6, qv + (d / 2) * ldq + 2 * i, sq);
          _tile_dpbf16ps(0, 4, 6);
          if (two_i) {
            _tile_loadd(7, qv + (d / 2) * ldq + 2 * (i + W), sq);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (two_j) {
            _tile_loadd(5, k + (j + kDotRow) * ldk + d, sk);
            _tile_dpbf16ps(2, 5, 6);
            if (two_i) _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, s + j * lds + i, ss);
        if (two_i) _tile_stored(1, s + j * lds + i + W, ss);
        if (two_j) _tile_stored(2, s + (j + kDotRow) * lds + i, ss);
        if (two_j && two_i) _tile_stored(3, s + (j + kDotRow) * lds + i + W, ss);
      }
    }
  }

  // accᵀ rows [0, Dv rounded up to 16) += Vᵀ · Pᵀ over the keys of the runs, in order (Pv's
  // pairs hold them end to end).
  static void pv(const vt_run* runs, int nr, std::int64_t nvec, std::int64_t Dv,
                 const std::uint16_t* p, std::int64_t ldp, float* acc, std::int64_t lda) {
    const std::int64_t rows = round_up(Dv, kDotRow), lanes = nvec * W;
    const long sp = long(ldp * 2), sa = long(lda * 4);  // bytes
    for (std::int64_t c = 0; c < rows; c += 2 * kDotRow) {
      const bool two_c = c + kDotRow < rows;
      for (std::int64_t i = 0; i < lanes; i += 2 * W) {
        const bool two_i = i + W < lanes;
        _tile_loadd(0, acc + c * lda + i, sa);
        if (two_i) _tile_loadd(1, acc + c * lda + i + W, sa);
        if (two_c) _tile_loadd(2, acc + (c + kDotRow) * lda + i, sa);
        if (two_c && two_i) _tile_loadd(3, acc + (c + kDotRow) * lda + i + W, sa);
        const std::uint16_t* pj = p;  // the run's first pair row
        for (int r = 0; r < nr; ++r) {
          const std::uint16_t* vt = runs[r].vt;
          const std::int64_t ldv = runs[r].ldv;
          const long sv = long(ldv * 2);
          for (std::int64_t j = 0; j < runs[r].nk32; j += kDotK, pj += kDotK / 2 * ldp) {
            _tile_loadd(4, vt + c * ldv + j, sv);
            _tile_loadd(6, pj + 2 * i, sp);
            _tile_dpbf16ps(0, 4, 6);
            if (two_i) {
              _tile_loadd(7, pj + 2 * (i + W), sp);
              _tile_dpbf16ps(1, 4, 7);
            }
            if (two_c) {
              _tile_loadd(5, vt + (c + kDotRow) * ldv + j, sv);
              _tile_dpbf16ps(2, 5, 6);
              if (two_i) _tile_dpbf16ps(3, 5, 7);
            }
          }
        }
        _tile_stored(0, acc + c * lda + i, sa);
        if (two_i) _tile_stored(1, acc + c * lda + i + W, sa);
        if (two_c) _tile_stored(2, acc + (c + kDotRow) * lda + i, sa);
        if (two_c && two_i) _tile_stored(3, acc + (c + kDotRow) * lda + i + W, sa);
      }
    }
  }
};

#include "kernel_bf16_body.inc"  // and its table()

}  // namespace

}  // namespace flashref::cpu::detail::amx

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace flashref::cpu::detail {
const kernel_table& amx_kernels() {
  return amx::table();
}
}  // namespace flashref::cpu::detail
