#pragma once
// The epilogue: O = acc * out_scale and LSE for this thread's two rows, from the accumulator
// fragment to global memory (float32 or the input dtype, any strides). A row with no visible
// key has acc = 0 and gets finalize()'s (0, -inf).
//
// The fragment gives each thread two adjacent columns of every 8-column block, so a plain store
// writes 2 or 4 bytes and a warp's store touches 8 rows in 16-byte pieces. When O's columns
// are contiguous and its rows 16-byte aligned, the four threads of a quad (one row) first
// exchange their 16-bit pairs (transpose_quad) so that each holds 8 whole columns and stores
// them in one 16-byte store; float32 output goes out as 8-byte pairs. Measured at L = 1024
// (dense, D = 128, bf16): the element-wise stores took about 29 % of the consumers' stall
// samples, the stores' data registers waiting on the store queue (cuda/NOTES.md, h6).

#include <cstdint>

#include "../common.cuh"
#include "../launch.hpp"
#include "mask.cuh"
#include "scheduler.cuh"
#include "softmax.cuh"

namespace flashref::cuda::detail::sm90 {

// Four 32-bit words per lane of a quad, x[j] = word `lane` of block j, become x[k] = word k of
// block `lane`: a 4 x 4 transpose across the quad in two butterfly steps of two shuffles each.
__device__ __forceinline__ void transpose_quad(std::uint32_t (&x)[4], int lane) {
#pragma unroll
  for (int m = 1; m <= 2; m *= 2) {
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j & m) continue;
      const std::uint32_t got = __shfl_xor_sync(kFullWarp, upper ? x[j] : x[j | m], m);
      if (upper) {
        x[j] = got;
      } else {
        x[j | m] = got;
      }
    }
  }
}

// Can O be written in `bytes`-wide pieces of whole columns: unit column stride, and every row's
// start aligned to `bytes` (the base pointer and the batch, head and row strides)?
__device__ __forceinline__ bool rows_aligned(const kernel_params& p, int elem_bytes, int bytes) {
  const std::int64_t per = bytes / elem_bytes;
  return p.o_stride[3] == 1 && reinterpret_cast<std::uintptr_t>(p.o) % bytes == 0 &&
         p.o_stride[0] % per == 0 && p.o_stride[1] % per == 0 && p.o_stride[2] % per == 0;
}

template <class T, int kN>
__device__ void store_rows(const kernel_params& p, const tile_work& w, const fragment_coords& at,
                           const float (&acc)[kN], fragment_softmax& sm) {
  finalized<float> fin[2];
  sm.finalize(fin);
  const int quad_lane = static_cast<int>(threadIdx.x % 4);
  const bool half_out = p.out != elem::f32;
  // Uniform across the block: every lane takes the same branch (the shuffles need the warp).
  const bool packed = half_out ? rows_aligned(p, 2, 16) : rows_aligned(p, 4, 8);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::int64_t i = w.q0 + at.row0 + 8 * r;
    const bool row_in = i < w.q1;
    const std::int64_t o_row = w.b * p.o_stride[0] + w.h * p.o_stride[1] + i * p.o_stride[2];
    const float scale = fin[r].out_scale;
    if (packed && half_out) {
      static_assert(kN % 16 == 0, "head dims that are multiples of 32");
#pragma unroll
      for (int g = 0; g < kN / 16; ++g) {  // blocks 4g .. 4g + 3
        std::uint32_t x[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int nb = 4 * g + j;
          x[j] = pack2<T>(acc[4 * nb + 2 * r] * scale, acc[4 * nb + 2 * r + 1] * scale);
        }
        transpose_quad(x, quad_lane);
        if (row_in) {
          T* dst = static_cast<T*>(p.o) + o_row + 8 * (4 * g + quad_lane);
          *reinterpret_cast<uint4*>(dst) = make_uint4(x[0], x[1], x[2], x[3]);
        }
      }
    } else if (row_in && packed) {
#pragma unroll
      for (int nb = 0; nb < kN / 4; ++nb) {
        float* dst = static_cast<float*>(p.o) + o_row + 8 * nb + at.col0;
        *reinterpret_cast<float2*>(dst) =
            make_float2(acc[4 * nb + 2 * r] * scale, acc[4 * nb + 2 * r + 1] * scale);
      }
    } else if (row_in) {
#pragma unroll
      for (int nb = 0; nb < kN / 4; ++nb) {
        const std::int64_t d = 8 * nb + at.col0;
        store_out<T>(p.o, o_row + d * p.o_stride[3], acc[4 * nb + 2 * r] * scale, p.out);
        store_out<T>(p.o, o_row + (d + 1) * p.o_stride[3], acc[4 * nb + 2 * r + 1] * scale, p.out);
      }
    }
    if (row_in && p.lse != nullptr && quad_lane == 0) {
      p.lse[w.b * p.lse_stride[0] + w.h * p.lse_stride[1] + i * p.lse_stride[2]] = fin[r].lse;
    }
  }
}

}  // namespace flashref::cuda::detail::sm90
