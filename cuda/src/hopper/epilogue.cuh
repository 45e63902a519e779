#pragma once
// The epilogue: O = acc * out_scale and LSE for this thread's two rows, straight from the
// accumulator fragment to global memory (float32 or the input dtype, any strides). A row with
// no visible key has acc = 0 and gets finalize()'s (0, -inf).

#include <cstdint>

#include "../common.cuh"
#include "../launch.hpp"
#include "mask.cuh"
#include "scheduler.cuh"
#include "softmax.cuh"

namespace flashref::cuda::detail::sm90 {

template <class T, int kN>
__device__ void store_rows(const kernel_params& p, const tile_work& w, const fragment_coords& at,
                           const float (&acc)[kN], fragment_softmax& sm) {
  finalized<float> fin[2];
  sm.finalize(fin);
  const bool quad_leader = threadIdx.x % 4 == 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::int64_t i = w.q0 + at.row0 + 8 * r;
    if (i >= w.q1) continue;
    const std::int64_t o_row = w.b * p.o_stride[0] + w.h * p.o_stride[1] + i * p.o_stride[2];
#pragma unroll
    for (int nb = 0; nb < kN / 4; ++nb) {
      const std::int64_t d = 8 * nb + at.col0;
      store_out<T>(p.o, o_row + d * p.o_stride[3], acc[4 * nb + 2 * r] * fin[r].out_scale, p.out);
      store_out<T>(p.o, o_row + (d + 1) * p.o_stride[3], acc[4 * nb + 2 * r + 1] * fin[r].out_scale,
                   p.out);
    }
    if (p.lse != nullptr && quad_leader) {
      p.lse[w.b * p.lse_stride[0] + w.h * p.lse_stride[1] + i * p.lse_stride[2]] = fin[r].lse;
    }
  }
}

}  // namespace flashref::cuda::detail::sm90
