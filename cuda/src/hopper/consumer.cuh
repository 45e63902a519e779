#pragma once
// The consumer role: a warpgroup of 128 threads owns 64 query rows of the block. For each key
// tile the producer hands it:
//
//   S = Q K^T          wgmma, both operands in shared memory          (64, kTileK) fp32
//   mask               tile_mask: scale, and -inf for masked keys in a partial tile
//   softmax update     fragment_softmax::step: max, exp_old, P = exp(S - m), sum
//   rescale            O *= exp_old
//   O += P V           wgmma, P from registers (bf16 / fp16), V in shared memory
//
// then releases the stage. When the producer says there are no more tiles the epilogue writes
// O / sum and LSE; a query tile with no visible key writes (0, -inf) without waiting for Q.

#include <cstdint>

#include "../common.cuh"  // pack2
#include "../launch.hpp"
#include "epilogue.cuh"
#include "mask.cuh"
#include "scheduler.cuh"
#include "sm90.cuh"
#include "softmax.cuh"
#include "tiles.cuh"
#include "wgmma.cuh"

namespace flashref::cuda::detail::sm90 {

// P (64, kTileK) as wgmma A fragments, one per 16 keys: the accumulator layout of S over keys
// [16 kk, 16 kk + 16) is the A-operand layout of an m64k16 product.
template <class T, int kN>
__device__ __forceinline__ void to_a_fragments(const float (&s)[kN],
                                               std::uint32_t (&a)[kN / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < kN / 8; ++kk) {
    a[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
    a[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
    a[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
    a[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

template <class T, int kD>
__device__ __forceinline__ void pv_product(float (&acc)[kD / 2], const std::uint32_t (&a)[4],
                                           std::uint64_t desc_v) {
  if constexpr (kD == 64) {
    wgmma_rs_n64<T>(acc, a, desc_v);
  } else {
    wgmma_rs_n128<T>(acc, a, desc_v);
  }
}

template <class T, int kD>
__device__ void consume(const kernel_params& p, const tile_work& w, int consumer,
                        const shared_tiles<kD>& smem, barriers<tiles<kD>::kStages>& bar) {
  using t = tiles<kD>;
  constexpr int kS = kTileK / 2;  // accumulator floats of S per thread
  constexpr int kO = kD / 2;      // accumulator floats of O per thread
  const fragment_coords at(consumer);
  const tile_mask mask{p.mask, w, p.scale};
  fragment_softmax softmax;
  float rO[kO] = {};  // (64, kD) per warpgroup

  bool q_ready = false;
  for (int it = 0;; ++it) {
    const int s = it % t::kStages;
    const unsigned parity = (it / t::kStages) & 1;
    mbar_wait(&bar.k_full[s], parity);
    const stage_info info = bar.info[s];  // written before the barrier's arrival
    if (info.tile == kNoMoreTiles) break;
    if (!q_ready) {
      mbar_wait(&bar.q_full, 0);
      q_ready = true;
    }

    // S = Q K^T
    float rS[kS];  // (64, kTileK) per warpgroup
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks)
      wgmma_ss_n128<T>(rS, smem.q_desc(consumer, ks), smem.k_desc(s, ks), ks > 0 ? 1 : 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(rS);

    mask.apply(rS, at, info.tile, info.full != 0);
    float exp_old[2];
    softmax.step(rS, exp_old);
    rescale_rows(rO, exp_old);
    std::uint32_t rP[kS / 8][4];  // (64, kTileK) as 16-bit A fragments
    to_a_fragments<T>(rS, rP);

    // O += P V
    mbar_wait(&bar.v_full[s], parity);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk)
      pv_product<T, kD>(rO, rP[kk], smem.v_desc(s, kk));
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(rO);

    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(&bar.empty[s]);  // this warp is done with stage s
  }
  store_rows<T>(p, w, at, rO, softmax);
}

}  // namespace flashref::cuda::detail::sm90
