#pragma once
// The epilogue: O = acc * out_scale and LSE for this thread's two rows, from the accumulator
// fragment to global memory (float32 or the input dtype, any strides; 16-byte stores where O's
// rows allow: store.cuh), or, where the block has room to stage O and O's layout suits TMA,
// through shared memory and a TMA store (store_rows_staged). A row with no visible key has acc = 0
// and gets finalize()'s (0, -inf). `warp_flag` (shared memory, one word per consumer warp) becomes
// 1 when a value of the warp's accumulator or an out_scale is NaN or inf: hopper.cu's check of the
// result in place of a scan of V (a NaN or inf of V that leaked into a row that masks its key shows
// there).

#include <cstdint>

#include "../launch.hpp"
#include "mask.cuh"
#include "scheduler.cuh"
#include "sm90.cuh"
#include "softmax.cuh"
#include "store.cuh"
#include "tiles.cuh"

namespace flashref::cuda::detail::sm90 {

// The rows' final scales and LSE; raises warp_flag where a value of acc or a scale is NaN or inf
// (x * 0 is 0 for finite x and NaN otherwise: one FMA per value).
template <int kN>
__device__ __forceinline__ void finish_rows(finalized<float> (&fin)[2], const float (&acc)[kN],
                                            fragment_softmax& sm, std::uint32_t& warp_flag) {
  sm.finalize(fin);
  float probe = fmaf(fin[0].out_scale, 0.f, fin[1].out_scale * 0.f);
#pragma unroll
  for (int i = 0; i < kN; ++i)
    probe = fmaf(acc[i], 0.f, probe);
  if (__any_sync(kFullWarp, probe != probe) && threadIdx.x % 32 == 0) warp_flag = 1;
}

// This thread's two LSE values, for the rows inside the item.
__device__ __forceinline__ void store_lse(const kernel_params& p, const tile_work& w,
                                          const fragment_coords& at,
                                          const finalized<float> (&fin)[2]) {
  if (p.lse == nullptr || threadIdx.x % 4 != 0) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::int64_t i = w.q0 + at.row0 + 8 * r;
    if (i < w.q1)
      p.lse[w.b * p.lse_stride[0] + w.h * p.lse_stride[1] + i * p.lse_stride[2]] = fin[r].lse;
  }
}

template <class T, int kN>
__device__ void store_rows(const kernel_params& p, const tile_work& w, const fragment_coords& at,
                           const float (&acc)[kN], fragment_softmax& sm, std::uint32_t& warp_flag) {
  finalized<float> fin[2];
  finish_rows(fin, acc, sm, warp_flag);
  const row_store how = row_store_of(p.o, p.o_stride, p.out);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::int64_t i = w.q0 + at.row0 + 8 * r;
    const bool row_in = i < w.q1;
    const std::int64_t o_row = w.b * p.o_stride[0] + w.h * p.o_stride[1] + i * p.o_stride[2];
    store_fragment_row<T>(p.o, o_row, p.o_stride[3], p.out, how, row_in, acc, r, fin[r].out_scale);
  }
  store_lse(p, w, at, fin);
}

// store_rows through shared memory: the consumer warpgroup's 64 rows of O, rounded to T, go to
// its staging boxes `s_o` (kN / 32 boxes of (64, 64), 128-byte swizzle) by stmatrix, and one
// thread hands them to TMA (`o_map`: O's (D, Lq, Hq, B) map with boxes of 64 rows), which
// clips the rows past the item and returns at once; the warpgroup goes on to its next item.
// Before the buffer is written again, that thread waits until the store has read it (the next
// call, or finish_staged_stores at the end). Named barrier 1 + consumer orders the warpgroup's
// writes and the hand-over. Same rounding (cvt.rn) and the same bits as store_rows.
template <class T, int kN>
__device__ void store_rows_staged(const kernel_params& p, const CUtensorMap* o_map,
                                  unsigned char* s_o, int consumer, const tile_work& w,
                                  const fragment_coords& at, const float (&acc)[kN],
                                  fragment_softmax& sm, std::uint32_t& warp_flag) {
  static_assert(kN % 32 == 0, "whole 64-column boxes");
  finalized<float> fin[2];
  finish_rows(fin, acc, sm, warp_flag);
  const bool issuer = threadIdx.x % 128 == 0;
  if (issuer) bulk_wait_read();  // the last item's store has read the boxes
  named_barrier_sync(1 + consumer, 128);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int m = lane / 8;  // the matrix whose row this lane addresses
  const int row = static_cast<int>(threadIdx.x / 32 % 4) * 16 + 8 * (m & 1) + lane % 8;
  const std::uint32_t base = smem_addr(s_o) + static_cast<std::uint32_t>(row * 128);
  const float s0 = fin[0].out_scale, s1 = fin[1].out_scale;
#pragma unroll
  for (int nb = 0; nb < kN / 4; nb += 2) {  // 8-column blocks nb and nb + 1
    const std::uint32_t x[4] = {pack2<T>(acc[4 * nb] * s0, acc[4 * nb + 1] * s0),
                                pack2<T>(acc[4 * nb + 2] * s1, acc[4 * nb + 3] * s1),
                                pack2<T>(acc[4 * nb + 4] * s0, acc[4 * nb + 5] * s0),
                                pack2<T>(acc[4 * nb + 6] * s1, acc[4 * nb + 7] * s1)};
    const int chunk = nb + (m >> 1);  // 16-byte chunk of the row
    stmatrix_x4(base + static_cast<std::uint32_t>((chunk / 8) * (kRowsPerConsumer * 128) +
                                                  ((chunk % 8) ^ (row % 8)) * 16),
                x);
  }
  fence_proxy_async();  // the stores above are read by TMA next
  named_barrier_sync(1 + consumer, 128);
  if (issuer) {
#pragma unroll
    for (int box = 0; box < kN / 32; ++box) {
      tma_store_4d(o_map, s_o + box * kRowsPerConsumer * 128, box * kBoxCols,
                   w.q0 + consumer * kRowsPerConsumer, w.h, w.b);
    }
    bulk_commit();
  }
  store_lse(p, w, at, fin);
}

// After a consumer's last store_rows_staged: the stores have completed.
__device__ __forceinline__ void finish_staged_stores() {
  if (threadIdx.x % 128 == 0) bulk_wait();
}

}  // namespace flashref::cuda::detail::sm90
