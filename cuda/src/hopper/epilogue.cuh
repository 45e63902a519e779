#pragma once
// The epilogue: O = acc * out_scale and LSE for this thread's two rows, from the accumulator
// fragment to global memory (float32 or the input dtype, any strides; 16-byte stores where O's
// rows allow: store.cuh). A row with no visible key has acc = 0 and gets finalize()'s (0, -inf).
// `warp_flag` (shared memory, one word per consumer warp) becomes 1 when a value of the warp's
// accumulator or an out_scale is NaN or inf: hopper.cu's check of the result in place of a
// scan of V (a NaN or inf of V that leaked into a row that masks its key shows there).

#include <cstdint>

#include "../launch.hpp"
#include "mask.cuh"
#include "scheduler.cuh"
#include "softmax.cuh"
#include "store.cuh"

namespace flashref::cuda::detail::sm90 {

template <class T, int kN>
__device__ void store_rows(const kernel_params& p, const tile_work& w, const fragment_coords& at,
                           const float (&acc)[kN], fragment_softmax& sm, std::uint32_t& warp_flag) {
  finalized<float> fin[2];
  sm.finalize(fin);
  // x * 0 is 0 for finite x and NaN otherwise: one FMA per value.
  float probe = fmaf(fin[0].out_scale, 0.f, fin[1].out_scale * 0.f);
#pragma unroll
  for (int i = 0; i < kN; ++i)
    probe = fmaf(acc[i], 0.f, probe);
  if (__any_sync(kFullWarp, probe != probe) && threadIdx.x % 32 == 0) warp_flag = 1;
  const row_store how = row_store_of(p.o, p.o_stride, p.out);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::int64_t i = w.q0 + at.row0 + 8 * r;
    const bool row_in = i < w.q1;
    const std::int64_t o_row = w.b * p.o_stride[0] + w.h * p.o_stride[1] + i * p.o_stride[2];
    store_fragment_row<T>(p.o, o_row, p.o_stride[3], p.out, how, row_in, acc, r, fin[r].out_scale);
    if (row_in && p.lse != nullptr && threadIdx.x % 4 == 0) {
      p.lse[w.b * p.lse_stride[0] + w.h * p.lse_stride[1] + i * p.lse_stride[2]] = fin[r].lse;
    }
  }
}

}  // namespace flashref::cuda::detail::sm90
