#pragma once
// The producer role: one warp walks the key tiles that hold a visible key (tile_walker, the
// block mask and causal / window / kv_len turned into a list of partial and full tiles on the
// fly) and loads each work item's Q once and each tile's K and V with TMA into the next free
// stage, the item's last tile marked as such. A query tile with no visible key loads nothing:
// its one stage closes it at once.

#include <cstdint>
#include <type_traits>

#include "../common.cuh"
#include "../launch.hpp"
#include "scheduler.cuh"
#include "sm90.cuh"
#include "tiles.cuh"

namespace flashref::cuda::detail::sm90 {

// The maps TMA reads Q, K and V through: (D, L, H, B), innermost first.
struct tensor_maps {
  CUtensorMap q, k, v;
};

// V rows [k0, k0 + key_tiles<kD, kK>::kTileK) with rows at or past key_end zero-filled, by the 32
// lanes of the warp with ordinary loads and stores, in the layout TMA would have written. Used for
// the tile that straddles kv_len: the keys past it may be uninitialised (a KV cache's padding), and
// P V must never multiply a zero probability by a NaN there.
template <class T, int kD, int kK>
__device__ void load_v_rows_zero_tail(unsigned char* s_v, const kernel_params& p,
                                      const tile_work& w, std::int64_t k0, std::int64_t key_end) {
  constexpr int kChunks = kD / 8;  // 16-byte chunks per row
  const T* gV = static_cast<const T*>(p.v) + w.b * p.v_stride[0] + w.hk * p.v_stride[1];
  // The lane read afresh (volatile): otherwise the compiler hoists this rare loop's per-lane
  // offsets out of the producer's loops and keeps them live there, past the producer's budget.
  const unsigned lane = read_lane();
  for (int idx = static_cast<int>(lane); idx < key_tiles<kD, kK>::kTileK * kChunks; idx += 32) {
    const int row = idx / kChunks;
    const int chunk = idx % kChunks;
    uint4 data = make_uint4(0, 0, 0, 0);
    if (k0 + row < key_end) {
      data = *reinterpret_cast<const uint4*>(gV + (k0 + row) * p.v_stride[2] + chunk * 8);
    }
    const int box = chunk / 8;
    const int swizzled = (chunk % 8) ^ (row % 8);
    *reinterpret_cast<uint4*>(s_v + box * key_tiles<kD, kK>::kKVBoxBytes + row * 128 +
                              swizzled * 16) = data;
  }
}

// The producer's counts: stages filled and Q tiles loaded so far, across work items.
struct producer_counts {
  int it = 0;
  int q_loads = 0;
};

// The next stage, once the consumers have released its K (or, without kSplit, the whole
// stage); wait_v waits for its V where the consumers release V apart, after the P V that
// follows S = Q K^T.
template <int kStages, int kC, bool kSplit, int kQ>
__device__ __forceinline__ int next_stage(barriers<kStages, kC, kSplit, kQ>& bar, int it) {
  const int s = it % kStages;
  mbar_wait(&bar.k_empty[s], ((it / kStages) & 1) ^ 1);
  return s;
}
template <int kStages, int kC, bool kSplit, int kQ>
__device__ __forceinline__ void wait_v(barriers<kStages, kC, kSplit, kQ>& bar, int it) {
  if constexpr (kSplit) mbar_wait(&bar.v_empty[it % kStages], ((it / kStages) & 1) ^ 1);
}

// A stage without a tile: it closes work item `work`, or the block's items (kNoMoreWork).
// Both of the stage's full barriers complete a phase, as for a tile, so that their phases stay
// in step with the ring's count when the slot is used again (no consumer waits on v_full here).
template <int kStages, int kC, bool kSplit, int kQ>
__device__ __forceinline__ void close_stage(barriers<kStages, kC, kSplit, kQ>& bar, int it,
                                            int work) {
  const int s = next_stage(bar, it);
  wait_v(bar, it);
  if (threadIdx.x % 32 == 0) {
    bar.info[s] = {kNoMoreTiles, 0, work, 0};
    mbar_arrive(&bar.v_full[s]);
    mbar_arrive(&bar.k_full[s]);
  }
}

// One work item: Q once (into a buffer the consumers are done with), then each visible key
// tile's K and V into the next free stage, the last one marked kTileLast (the walker asked
// whether another follows) where the block marks them (t::kMarksLast), else followed by a stage
// that closes the item; an item without a visible key, that stage alone.
template <class T, int kD, int kC, int kK, class Params>
__device__ __forceinline__ producer_counts produce_item(const Params& hp, unsigned char* raw,
                                                        block_barriers<kD, kC, kK>& bar, int work,
                                                        producer_counts n) {
  using t = tiles<kD, kC, kK>;
  const kernel_params& p = hp.p;
  const tensor_maps& maps = hp.maps;
  const shared_tiles<kD, kC, kK> smem(raw);  // rebuilt here: fewer registers live across the call
  const bool leader = threadIdx.x % 32 == 0;
  const tile_work w = work_tile<t::kTileQ>(p, hp.work_group, work);
  // A block without a block mask (block_shape::kBlockMask) walks a range in fewer registers.
  using walker_type = std::conditional_t<block_shape<kC, kK>::kBlockMask, tile_walker<t::kTileK>,
                                         range_walker<t::kTileK>>;
  walker_type walker(p.mask, w.b, w.h, w.q0, w.q1);
  bool have = walker.more();
  if (have) {
    // The consumers are done with the Q that this buffer held (t::kQStages items ago): the
    // phase of that release, by count, or by the state the producer's own arrival returns.
    int slot = 0;
    if constexpr (block_barriers<kD, kC, kK>::kQByState) {
      if (leader) mbar_wait_state(&bar.q_empty[0], mbar_arrive_state(&bar.q_empty[0]));
      __syncwarp();
    } else {
      slot = n.q_loads % t::kQStages;
      mbar_wait(&bar.q_empty[slot], ((n.q_loads / t::kQStages) & 1) ^ 1);
      ++n.q_loads;
    }
    if (leader) {
      mbar_arrive_expect_tx(&bar.q_full[slot], t::kQBytes);
      tma_load_tile<kD, t::kQBoxBytes>(smem.q_stage(slot), &maps.q, w.q0, w.h, w.b,
                                       &bar.q_full[slot]);
    }
  }
  const bool closes = !t::kMarksLast || !have;
  while (have) {
    std::int64_t tile = 0;
    bool full = false;
    walker.pop(tile, full);
    const bool last = !walker.more();
    const int s = next_stage(bar, n.it);
    const std::int64_t k0 = tile * t::kTileK;
    const bool v_tail = k0 + t::kTileK > walker.key_end && walker.key_end < p.len_k;
    // V by TMA (by the leader), unless the tile straddles kv_len (below).
    const auto load_v = [&] {
      if (v_tail) return;
      mbar_arrive_expect_tx(&bar.v_full[s], t::kKVBytes);
      tma_load_tile<kD, t::kKVBoxBytes>(smem.v_stage(s), &maps.v, int(k0), w.hk, w.b,
                                        &bar.v_full[s]);
    };
    if (leader) {
      bar.info[s] = {int(tile), (full ? kTileFull : 0) | (t::kMarksLast && last ? kTileLast : 0),
                     work, 0};
      mbar_arrive_expect_tx(&bar.k_full[s], t::kKVBytes);
      tma_load_tile<kD, t::kKVBoxBytes>(smem.k_stage(s), &maps.k, int(k0), w.hk, w.b,
                                        &bar.k_full[s]);
      if constexpr (!t::kSplitRelease) load_v();  // the stage was released whole
    }
    if constexpr (t::kSplitRelease) {  // V's half of the stage may still be read
      wait_v(bar, n.it);
      if (leader) load_v();
    }
    if (v_tail) {
      load_v_rows_zero_tail<T, kD, kK>(smem.v_stage(s), p, w, k0, walker.key_end);
      fence_proxy_async();  // the stores above are read by wgmma next
      __syncwarp();
      if (leader) mbar_arrive(&bar.v_full[s]);
    }
    ++n.it;
    have = !last;
  }
  if (closes) close_stage(bar, n.it++, work);
  return n;
}

// produce_item as a call: the loop over items then keeps only its counts live across the
// body, whose registers (tile_walker's) fit the two-consumer producer's budget. The range
// walker's body is inlined instead: at the three-consumer producer's 56 registers the call's
// own cost spilled.
template <class T, int kD, int kC, int kK, class Params>
__device__ __noinline__ producer_counts produce_item_call(const Params& hp, unsigned char* raw,
                                                          block_barriers<kD, kC, kK>& bar, int work,
                                                          producer_counts n) {
  return produce_item<T, kD, kC, kK>(hp, raw, bar, work, n);
}

// The producer warp's loop over the block's work items; the stage ring and its phases run on
// across items, and after the last one a stage closes the block's items. Params: p (the
// problem), maps (tensor_maps), work_counter (scheduler.cuh's next_work) and work_group (its
// work_tile).
template <class T, int kD, int kC, int kK, class Params>
__device__ void produce(const Params& hp, unsigned char* raw, block_barriers<kD, kC, kK>& bar) {
  const int items = static_cast<int>(work_items<tiles<kD, kC, kK>::kTileQ>(hp.p));  // < 2^31
  producer_counts n;
  for (int work = static_cast<int>(blockIdx.x); work < items;
       work = next_work(work, hp.work_counter))
    if constexpr (block_shape<kC, kK>::kBlockMask) {
      n = produce_item_call<T, kD, kC, kK>(hp, raw, bar, work, n);
    } else {
      n = produce_item<T, kD, kC, kK>(hp, raw, bar, work, n);
    }
  close_stage(bar, n.it, kNoMoreWork);
}

}  // namespace flashref::cuda::detail::sm90
