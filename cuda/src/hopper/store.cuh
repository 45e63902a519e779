#pragma once
// Rows of a wgmma accumulator fragment to global memory, shared by the forward's epilogue and
// the backward's gradients. The fragment gives each thread two adjacent columns of every
// 8-column block of its rows, so a plain store writes 2 or 4 bytes and a warp's store touches 8
// rows in pieces of 16 bytes. When the output's columns are contiguous and its rows 16-byte
// aligned, the four threads of a quad (one row) first exchange their 16-bit pairs
// (transpose_quad) so that each holds 8 whole columns and stores them in one 16-byte store;
// float32 output goes out as 8-byte pairs. Measured in the forward at L = 1024 (dense,
// D = 128, bf16): the element-wise stores took 29 % of the consumers' stall samples, their
// data registers waiting on the store queue (cuda/NOTES.md, h6).

#include <cstdint>

#include "../common.cuh"
#include "../launch.hpp"

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

// Row r (0 or 1) of this thread's share of a (64, 2 kN) accumulator times `scale`, to the row
// starting at element `row_off` of `g` (column stride col_stride), in the way `how`
// (launch.hpp's row_store_of, decided on the host). Every lane of the warp calls it (the packed
// form shuffles); only lanes with `row_in` store.
template <class T, int kN>
__device__ __forceinline__ void store_fragment_row(void* g, std::int64_t row_off,
                                                   std::int64_t col_stride, elem out, row_store how,
                                                   bool row_in, const float (&acc)[kN], int r,
                                                   float scale) {
  const int quad_lane = static_cast<int>(threadIdx.x % 4);
  if (how == row_store::packed16) {
    static_assert(kN % 16 == 0, "head dims that are multiples of 32");
#pragma unroll
    for (int g4 = 0; g4 < kN / 16; ++g4) {  // 8-column blocks 4 g4 .. 4 g4 + 3
      std::uint32_t x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int nb = 4 * g4 + j;
        x[j] = pack2<T>(acc[4 * nb + 2 * r] * scale, acc[4 * nb + 2 * r + 1] * scale);
      }
      transpose_quad(x, quad_lane);
      if (row_in) {
        T* dst = static_cast<T*>(g) + row_off + 8 * (4 * g4 + quad_lane);
        *reinterpret_cast<uint4*>(dst) = make_uint4(x[0], x[1], x[2], x[3]);
      }
    }
  } else if (row_in && how == row_store::pairs32) {
#pragma unroll
    for (int nb = 0; nb < kN / 4; ++nb) {
      float* dst = static_cast<float*>(g) + row_off + 8 * nb + 2 * quad_lane;
      *reinterpret_cast<float2*>(dst) =
          make_float2(acc[4 * nb + 2 * r] * scale, acc[4 * nb + 2 * r + 1] * scale);
    }
  } else if (row_in) {
#pragma unroll
    for (int nb = 0; nb < kN / 4; ++nb) {
      const std::int64_t d = 8 * nb + 2 * quad_lane;
      store_out<T>(g, row_off + d * col_stride, acc[4 * nb + 2 * r] * scale, out);
      store_out<T>(g, row_off + (d + 1) * col_stride, acc[4 * nb + 2 * r + 1] * scale, out);
    }
  }
}

}  // namespace flashref::cuda::detail::sm90
