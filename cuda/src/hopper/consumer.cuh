#pragma once
// The consumer role: a warpgroup of 128 threads owns 64 query rows of the block. For each key
// tile the producer hands it:
//
//   S = Q K^T          wgmma, both operands in shared memory          (64, kTileK) fp32
//   mask               tile_mask: -inf for masked keys in a partial tile (and the scale,
//                      unless the softmax folds it into its exponent: score_scale)
//   softmax update     fragment_softmax::step: max, exp_old, P = exp(S - m), sum
//   rescale            O *= exp_old
//   O += P V           wgmma, P from registers (bf16 / fp16), V in shared memory
//
// then releases the stage (its K after S and its V after P V where they are released apart:
// tiles.cuh's kSplitRelease). After the item's last tile the epilogue writes O / sum
// and LSE, while the producer already loads the next item's tiles; a query tile with no visible
// key writes (0, -inf) without waiting for Q. Two loops take these steps: in sequence
// (consume_serial: D = 64, and D = 256 under a block mask), and with one tile's P V running
// under the next tile's mask and softmax (consume_overlapped: D = 128, and D = 256 without one).

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

// S (64, kTileK) = Q K^T over the head dim: one wgmma per 16 columns of it, Q from buffer
// q_slot. The kD / 16 Q descriptors, the same in every call of an item, would be hoisted out of
// the tile loop into two registers each; in the blocks short of registers (block_shape::kTight:
// tiles of more than 128 keys, D = 256's 80-key tiles, three consumers) or with two Q buffers
// (whose descriptors change from item to item) the consumer's registers are short, and they are
// formed in each call from one copy of the first that the compiler cannot hoist (opaque), one add
// each.
template <class T, int kD, int kC, int kK, int kS>
__device__ __forceinline__ void qk_product(float (&s)[kS], const shared_tiles<kD, kC, kK>& smem,
                                           int q_slot, int consumer, int stage) {
  constexpr bool kFormed = block_shape<kC, kK>::kTight || tiles<kD, kC, kK>::kQStages > 1;
  std::uint64_t q0 = 0;
  if constexpr (kFormed) q0 = opaque(smem.q_desc0(q_slot, consumer));
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    const std::uint64_t desc_q =
        kFormed ? sw128_advance(q0, smem.q_step(ks)) : smem.q_desc(q_slot, consumer, ks);
    if constexpr (kS == 32) {
      wgmma_ss_n64<T>(s, desc_q, smem.k_desc(stage, ks), ks > 0 ? 1 : 0);
    } else if constexpr (kS == 40) {
      wgmma_ss_n80<T>(s, desc_q, smem.k_desc(stage, ks), ks > 0 ? 1 : 0);
    } else if constexpr (kS == 88) {
      wgmma_ss_n176<T>(s, desc_q, smem.k_desc(stage, ks), ks > 0 ? 1 : 0);
    } else {
      static_assert(kS == 64, "key tiles of 64, 80, 128 or 176");
      wgmma_ss_n128<T>(s, desc_q, smem.k_desc(stage, ks), ks > 0 ? 1 : 0);
    }
  }
}

// O (64, kD) += P V over 16 keys; at D = 256 as two products of 128 columns (the second half's
// descriptor two 64-column boxes of kK rows further on).
template <class T, int kD, int kK>
__device__ __forceinline__ void pv_product(float (&acc)[kD / 2], const std::uint32_t (&a)[4],
                                           std::uint64_t desc_v) {
  if constexpr (kD == 64) {
    wgmma_rs_n64<T>(acc, a, desc_v);
  } else if constexpr (kD == 128) {
    wgmma_rs_n128<T>(acc, a, desc_v);
  } else {
    static_assert(kD == 256, "head dims 64, 128, 256");
    constexpr std::uint32_t kHalf = 2 * key_tiles<kD, kK>::kKVBoxBytes;  // bytes
    wgmma_rs_n128<T>(*reinterpret_cast<float(*)[64]>(&acc[0]), a, desc_v);
    wgmma_rs_n128<T>(*reinterpret_cast<float(*)[64]>(&acc[64]), a, sw128_advance(desc_v, kHalf));
  }
}

// The stages and the Q tile a consumer warp is done with, and its place in the ring: the
// stage counter runs on across work items, as the producer's does.
template <int kStages, int kC, bool kSplit, int kQ>
struct consumer_ring {
  barriers<kStages, kC, kSplit, kQ>& bar;
  int it = 0;       // stages consumed so far
  int q_loads = 0;  // Q tiles waited for so far

  __device__ int stage(int i) const { return i % kStages; }
  __device__ unsigned parity(int i) const { return (i / kStages) & 1; }
  // This warp is done with K of stage s (its S product has completed), with V (its P V has),
  // or with both. Without kSplit a stage is released whole, when V is.
  __device__ void release_k(int s) {
    if constexpr (kSplit) arrive(bar.k_empty[s]);
  }
  __device__ void release_v(int s) {
    if constexpr (kSplit) {
      arrive(bar.v_empty[s]);
    } else {
      arrive(bar.k_empty[s]);
    }
  }
  __device__ void release(int s) {
    release_k(s);
    release_v(s);
  }
  __device__ void arrive(std::uint64_t& empty) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(&empty);
  }
  // Waits for the current item's Q; then q_slot() is its buffer.
  __device__ void wait_q() {
    const int n = q_loads++;
    mbar_wait(&bar.q_full[n % kQ], (n / kQ) & 1);
  }
  __device__ int q_slot() const { return (q_loads - 1) % kQ; }
  // This warp's word of the block's non-finite flags (store_rows).
  __device__ std::uint32_t& nonfinite_flag() const { return bar.nonfinite[threadIdx.x / 32 - 4]; }
  __device__ void release_q() {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(&bar.q_empty[q_slot()]);  // this warp reads Q no more
  }
  // Waits for stage `it` and reads its descriptor.
  __device__ stage_info next() {
    mbar_wait(&bar.k_full[stage(it)], parity(it));
    return read_stage_slot(bar.info[stage(it)]);  // written before the arrival
  }
};

// The ring of the block for (kD, kC, kK).
template <int kD, int kC, int kK>
using block_ring = consumer_ring<tiles<kD, kC, kK>::kStages, kC, tiles<kD, kC, kK>::kSplitRelease,
                                 tiles<kD, kC, kK>::kQStages>;

// The item's epilogue: through the block's O staging and a TMA store where the block has room
// for it and the host made O's map (hp.o_tma, hp.o_map), else straight from the registers.
// Params: p (the problem), o_tma and o_map (hopper.cu's hopper_params).
template <class T, int kD, int kC, int kK, class Params>
__device__ __forceinline__ void store_item(const Params& hp, const shared_tiles<kD, kC, kK>& smem,
                                           int consumer, const tile_work& w,
                                           const fragment_coords& at, const float (&acc)[kD / 2],
                                           fragment_softmax& sm, std::uint32_t& warp_flag) {
  if constexpr (tiles<kD, kC, kK>::kStageO) {
    if (hp.o_tma) {
      store_rows_staged<T>(hp.p, &hp.o_map, smem.o_rows(consumer), consumer, w, at, acc, sm,
                           warp_flag);
      return;
    }
  }
  store_rows<T>(hp.p, w, at, acc, sm, warp_flag);
}

// Whether the item ends with the tile `info` that the ring just moved past: its flag where the
// block marks last tiles, else whether the next stage closes the item. Otherwise `info` becomes
// the next tile.
template <int kD, int kC, int kK>
__device__ __forceinline__ bool item_ends(block_ring<kD, kC, kK>& ring, stage_info& info) {
  if constexpr (tiles<kD, kC, kK>::kMarksLast) {
    if ((info.flags & kTileLast) != 0) return true;
    info = ring.next();
    return false;
  } else {
    info = ring.next();
    return info.tile == kNoMoreTiles;
  }
}

// One work item with the two products of neighbouring tiles overlapped: in turn j the
// warpgroup issues S_j = Q K_j^T and then O += P_{j-1} V_{j-1}, waits for S_j alone
// (wait<1>), and runs tile j's mask and softmax while P_{j-1} V_{j-1} still runs on the tensor
// cores; only the rescale of O waits for it (wait<0>). Stage j - 1 is released after that
// (with kSplitRelease K_j as soon as S_j has completed, V_{j-1} then).
// On entry stage ring.it holds the item's first tile (`info`) and Q has arrived.
template <class T, int kD, int kC, int kK, class Params>
__device__ void consume_overlapped(const Params& hp, const tile_work& w, int consumer,
                                   const shared_tiles<kD, kC, kK>& smem,
                                   block_ring<kD, kC, kK>& ring, stage_info info) {
  const kernel_params& p = hp.p;
  constexpr int kS = tiles<kD, kC, kK>::kTileK / 2;  // accumulator floats of S per thread
  constexpr int kO = kD / 2;                         // accumulator floats of O per thread
  const fragment_coords at(consumer);
  const tile_mask mask{p.mask, w, score_scale(p.scale)};
  fragment_softmax softmax;
  float rO[kO] = {};            // (64, kD) per warpgroup
  std::uint32_t rP[kS / 8][4];  // P of the previous tile as 16-bit A fragments

  // O += P_prev V_prev: issued, committed, not waited for.
  const auto issue_pv = [&](int s) {
#pragma unroll
    for (int kk = 0; kk < tiles<kD, kC, kK>::kTileK / 16; ++kk)
      pv_product<T, kD, kK>(rO, rP[kk], smem.v_desc(s, kk));
  };
  // In the three-consumer block, whose consumers are shortest of registers, a partial tile's
  // mask bits are formed before its S is issued (mask.bits), so that S's 64 registers are not
  // live beside the loop that forms them.
  constexpr bool kEarlyBits = kC == 3;
  std::uint32_t visible[2] = {0, 0};
  const auto form_bits = [&](const stage_info& tile) {
    if constexpr (kEarlyBits) {
      if ((tile.flags & kTileFull) == 0) mask.template bits<kS>(visible, at, tile.tile);
    }
  };
  // Tile j's scores to unnormalised probabilities: the partial-tile mask, then the softmax step.
  const auto probabilities = [&](float(&rS)[kS], const stage_info& tile, float(&exp_old)[2]) {
    if constexpr (kEarlyBits) {
      if ((tile.flags & kTileFull) != 0) {
        mask.apply(rS, at, tile.tile, true);
      } else {
        mask.apply_bits(rS, visible);
      }
    } else {
      mask.apply(rS, at, tile.tile, (tile.flags & kTileFull) != 0);
    }
    softmax.step(rS, exp_old, mask.scale);
  };

  {  // The first tile: S_0 alone.
    const int s = ring.stage(ring.it);
    form_bits(info);
    float rS[kS];  // (64, kTileK) per warpgroup
    wgmma_fence();
    qk_product<T, kD, kC, kK>(rS, smem, ring.q_slot(), consumer, s);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(rS);
    ring.release_k(s);
    float exp_old[2];
    probabilities(rS, info, exp_old);
    to_a_fragments<T>(rS, rP);
  }
  for (;;) {
    const int prev = ring.stage(ring.it);
    mbar_wait(&ring.bar.v_full[prev], ring.parity(ring.it));
    ++ring.it;
    if (item_ends<kD, kC, kK>(ring, info)) break;
    const int s = ring.stage(ring.it);
    form_bits(info);

    // S_j = Q K_j^T, then O += P_{j-1} V_{j-1} behind it; wait for S_j alone.
    float rS[kS];
    wgmma_fence();
    qk_product<T, kD, kC, kK>(rS, smem, ring.q_slot(), consumer, s);
    wgmma_commit();
    issue_pv(prev);
    wgmma_commit();
    wgmma_wait<1>();
    fence_operands(rS);
    ring.release_k(s);

    float exp_old[2];
    probabilities(rS, info, exp_old);  // under P_{j-1} V_{j-1}

    // Wait for P_{j-1} V_{j-1}, in both arms of the branch on whether a row's max moved. With
    // the wait in one basic block with the softmax, ptxas issued it (with the WARPGROUP.ARRIVE
    // and V's release) ahead of the whole softmax, which then ran after the product instead
    // of under it: no exponential between the two waits in the SASS (cuda/NOTES.md, h23).
    // ptxas does not move it above the branch, which needs the softmax's row maxima.
    if (rows_moved(exp_old)) {
      wgmma_wait<0>();
      fence_operands(rO);
      scale_rows(rO, exp_old);
    } else {
      wgmma_wait<0>();
    }
    fence_operands(rO);
    fence_fragments(rP);
    ring.release_v(prev);
    to_a_fragments<T>(rS, rP);
  }
  // Tile ring.it - 1 was the item's last: Q is read no more. Its P V (its V was waited for
  // above), then the epilogue (and the closing stage's release, where there is one).
  ring.release_q();
  const int last = ring.stage(ring.it - 1);
  wgmma_fence();
  issue_pv(last);
  wgmma_commit();
  wgmma_wait<0>();
  fence_operands(rO);
  ring.release_v(last);
  if constexpr (!tiles<kD, kC, kK>::kMarksLast) ring.release(ring.stage(ring.it++));
  if constexpr (block_shape<kC, kK>::kTight) {
    // The item's rows formed afresh from its number (the closing stage carries it), so that
    // the loop's registers do not also hold the rows' end across it.
    const tile_work rows =
        work_tile<tiles<kD, kC, kK>::kTileQ>(p, hp.work_group, opaque(info.work));
    store_item<T>(hp, smem, consumer, rows, at, rO, softmax, ring.nonfinite_flag());
  } else {
    store_item<T>(hp, smem, consumer, w, at, rO, softmax, ring.nonfinite_flag());
  }
}

// One work item, the products in sequence: S_j, its softmax, then P_j V_j, each waited for
// before the next step (the two consumer warpgroups overlap each other by scheduling). On entry
// stage ring.it holds the item's first tile (`info`) and Q has arrived.
template <class T, int kD, int kC, int kK, class Params>
__device__ void consume_serial(const Params& hp, const tile_work& w, int consumer,
                               const shared_tiles<kD, kC, kK>& smem, block_ring<kD, kC, kK>& ring,
                               stage_info info) {
  const kernel_params& p = hp.p;
  constexpr int kS = tiles<kD, kC, kK>::kTileK / 2;  // accumulator floats of S per thread
  constexpr int kO = kD / 2;                         // accumulator floats of O per thread
  const fragment_coords at(consumer);
  const tile_mask mask{p.mask, w, score_scale(p.scale)};
  fragment_softmax softmax;
  float rO[kO] = {};  // (64, kD) per warpgroup

  // Tile `info`: S, its softmax, then P V.
  const auto step = [&] {
    const int s = ring.stage(ring.it);

    // S = Q K^T
    float rS[kS];  // (64, kTileK) per warpgroup
    wgmma_fence();
    qk_product<T, kD, kC, kK>(rS, smem, ring.q_slot(), consumer, s);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(rS);
    ring.release_k(s);

    mask.apply(rS, at, info.tile, (info.flags & kTileFull) != 0);
    float exp_old[2];
    softmax.step(rS, exp_old, mask.scale);
    rescale_rows(rO, exp_old);
    std::uint32_t rP[kS / 8][4];  // (64, kTileK) as 16-bit A fragments
    to_a_fragments<T>(rS, rP);

    // O += P V
    mbar_wait(&ring.bar.v_full[s], ring.parity(ring.it));
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < tiles<kD, kC, kK>::kTileK / 16; ++kk)
      pv_product<T, kD, kK>(rO, rP[kk], smem.v_desc(s, kk));
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(rO);
    ring.release_v(s);
    ++ring.it;
  };
  if constexpr (tiles<kD, kC, kK>::kMarksLast) {
    for (bool last = false; !last;) {
      step();
      last = item_ends<kD, kC, kK>(ring, info);
    }
  } else {  // this loop's own shape: the other spilled at D = 256
    for (; info.tile != kNoMoreTiles; info = ring.next())
      step();
  }
  ring.release_q();
  if constexpr (!tiles<kD, kC, kK>::kMarksLast) {
    ring.release(ring.stage(ring.it++));  // the stage that closed the item
  }
  store_item<T>(hp, smem, consumer, w, at, rO, softmax, ring.nonfinite_flag());
}

// A consumer warpgroup's loop over the block's work items, each in the loop tiles::kOverlapped
// chooses: overlapped at D = 128, at D = 256 with 80-key tiles and in D = 64's three-consumer
// block, where it is measured faster (D = 256 +7 to +9 % at L = 16384, cuda/NOTES.md h29;
// D = 64 +4.5 to +9 %, h34), in sequence in D = 64's two-consumer block, where the overlapped loop
// measured 0-4 % slower (h27), and at D = 256 under a block mask (64-key tiles, 216 registers:
// not measured overlapped). An item with no visible key writes (0, -inf) without waiting for Q
// (none is loaded for it).
//
// With `nonfinite_flags` set, each consumer warp writes its word of them when the block's work
// is done: flags[block * 4 kC + warp] = 1 when a value it stored was NaN or inf, else 0. With
// hp.o_tma (where the block stages O: tiles.cuh's kStageO) the epilogues store O by TMA
// (store_item). Params: p, work_group, nonfinite_flags, o_tma and o_map (hopper.cu's
// hopper_params).
template <class T, int kD, int kC, int kK, class Params>
__device__ void consume(const Params& hp, int consumer, const shared_tiles<kD, kC, kK>& smem,
                        block_barriers<kD, kC, kK>& bar) {
  using t = tiles<kD, kC, kK>;
  const kernel_params& p = hp.p;
  std::uint32_t* const nonfinite_flags = hp.nonfinite_flags;
  block_ring<kD, kC, kK> ring{bar};
  for (;;) {
    const stage_info first = ring.next();
    if (first.work == kNoMoreWork) {
      if (nonfinite_flags != nullptr && threadIdx.x % 32 == 0) {  // the lane that set it
        nonfinite_flags[blockIdx.x * (4 * kC) + threadIdx.x / 32 - 4] = ring.nonfinite_flag();
      }
      if (t::kStageO && hp.o_tma) finish_staged_stores();
      return;
    }
    const tile_work w = work_tile<t::kTileQ>(p, hp.work_group, first.work);
    if (first.tile == kNoMoreTiles) {
      ring.release(ring.stage(ring.it++));
      fragment_softmax none;
      float zero[kD / 2] = {};
      store_item<T>(hp, smem, consumer, w, fragment_coords(consumer), zero, none,
                    ring.nonfinite_flag());
      continue;
    }
    ring.wait_q();
    if constexpr (t::kOverlapped) {
      consume_overlapped<T, kD, kC, kK>(hp, w, consumer, smem, ring, first);
    } else {
      consume_serial<T, kD, kC, kK>(hp, w, consumer, smem, ring, first);
    }
  }
}

}  // namespace flashref::cuda::detail::sm90
