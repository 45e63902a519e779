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
// Two loops take these steps: in sequence (consume_serial, D = 64), and with one tile's P V
// running under the next tile's mask and softmax (consume_overlapped, D = 128).

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

// Keeps the A fragments of an in-flight wgmma alive in their registers: the compiler sees
// them read here, so it cannot reuse those registers before the wgmma that reads them ends.
template <int kN>
__device__ __forceinline__ void fence_fragments(std::uint32_t (&a)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      asm volatile("" : "+r"(a[i][e])::"memory");
}

// One consumer's loop, with the two products of neighbouring tiles overlapped: in turn j the
// warpgroup issues S_j = Q K_j^T and then O += P_{j-1} V_{j-1}, waits for S_j alone
// (wait<1>), and runs tile j's mask and softmax while P_{j-1} V_{j-1} still runs on the tensor
// cores; only the rescale of O waits for it (wait<0>). Stage j - 1 is released after that.
template <class T, int kD>
__device__ void consume_overlapped(const kernel_params& p, const tile_work& w, int consumer,
                                   const shared_tiles<kD>& smem,
                                   barriers<tiles<kD>::kStages>& bar) {
  using t = tiles<kD>;
  constexpr int kS = kTileK / 2;  // accumulator floats of S per thread
  constexpr int kO = kD / 2;      // accumulator floats of O per thread
  const fragment_coords at(consumer);
  const tile_mask mask{p.mask, w, p.scale};
  fragment_softmax softmax;
  float rO[kO] = {};            // (64, kD) per warpgroup
  std::uint32_t rP[kS / 8][4];  // P of the previous tile as 16-bit A fragments

  // O += P_prev V_prev: issued, committed, not waited for.
  const auto issue_pv = [&](int s) {
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk)
      pv_product<T, kD>(rO, rP[kk], smem.v_desc(s, kk));
  };
  const auto release = [&](int s) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(&bar.empty[s]);  // this warp is done with stage s
  };

  // Tile j's scores to unnormalised probabilities: the partial-tile mask, then the softmax step.
  const auto probabilities = [&](float(&rS)[kS], const stage_info& info, float(&exp_old)[2]) {
    mask.apply(rS, at, info.tile, info.full != 0);
    softmax.step(rS, exp_old);
  };

  // The first tile: S_0 alone.
  int it = 0;
  {
    mbar_wait(&bar.k_full[0], 0);
    const stage_info info = read_stage_info(bar.info[0]);  // written before the arrival
    if (info.tile == kNoMoreTiles) {  // no visible key: (0, -inf) without waiting for Q
      store_rows<T>(p, w, at, rO, softmax);
      return;
    }
    mbar_wait(&bar.q_full, 0);
    float rS[kS];  // (64, kTileK) per warpgroup
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks)
      wgmma_ss_n128<T>(rS, smem.q_desc(consumer, ks), smem.k_desc(0, ks), ks > 0 ? 1 : 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(rS);
    float exp_old[2];
    probabilities(rS, info, exp_old);
    to_a_fragments<T>(rS, rP);
  }
  for (it = 1;; ++it) {
    const int s = it % t::kStages, prev = (it - 1) % t::kStages;
    const unsigned parity = (it / t::kStages) & 1, prev_parity = ((it - 1) / t::kStages) & 1;
    mbar_wait(&bar.v_full[prev], prev_parity);
    mbar_wait(&bar.k_full[s], parity);
    const stage_info info = read_stage_info(bar.info[s]);
    if (info.tile == kNoMoreTiles) break;

    // S_j = Q K_j^T, then O += P_{j-1} V_{j-1} behind it; wait for S_j alone.
    float rS[kS];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks)
      wgmma_ss_n128<T>(rS, smem.q_desc(consumer, ks), smem.k_desc(s, ks), ks > 0 ? 1 : 0);
    wgmma_commit();
    issue_pv(prev);
    wgmma_commit();
    wgmma_wait<1>();
    fence_operands(rS);

    float exp_old[2];
    probabilities(rS, info, exp_old);  // under P_{j-1} V_{j-1}

    wgmma_wait<0>();
    fence_operands(rO);
    fence_fragments(rP);
    release(prev);
    rescale_rows(rO, exp_old);
    to_a_fragments<T>(rS, rP);
  }
  // The last tile's P V (its V was waited for above).
  const int last = (it - 1) % t::kStages;
  wgmma_fence();
  issue_pv(last);
  wgmma_commit();
  wgmma_wait<0>();
  fence_operands(rO);
  release(last);
  store_rows<T>(p, w, at, rO, softmax);
}

// One consumer's loop, the products in sequence: S_j, its softmax, then P_j V_j, each waited
// for before the next step (the two consumer warpgroups overlap each other by scheduling).
template <class T, int kD>
__device__ void consume_serial(const kernel_params& p, const tile_work& w, int consumer,
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
    const stage_info info = read_stage_info(bar.info[s]);  // written before the arrival
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

// The consumer's loop for head dim kD: overlapped at D = 128, where it is measured faster (P V
// of 128 columns is long enough to hide a softmax), in sequence at D = 64, where the
// overlapped loop measured 10 % slower (cuda/NOTES.md, version h4).
template <class T, int kD>
__device__ void consume(const kernel_params& p, const tile_work& w, int consumer,
                        const shared_tiles<kD>& smem, barriers<tiles<kD>::kStages>& bar) {
  if constexpr (tiles<kD>::kOverlap) {
    consume_overlapped<T, kD>(p, w, consumer, smem, bar);
  } else {
    consume_serial<T, kD>(p, w, consumer, smem, bar);
  }
}

}  // namespace flashref::cuda::detail::sm90
