#pragma once
// Which query tile a block computes next. The kernel is persistent: one block per SM walks
// work items (query tile, head, batch) in the order of launch.hpp's work_place_of, each block
// taking the next free item from a counter in global memory when the producer starts its current
// one (so that blocks that drew short tiles take more): the (batch, head) pairs in groups whose
// K and V share L2, and within a group the heaviest query tiles first across its heads (under a
// causal mask or a window no query tile sees more keys than the last), so that the launch ends on
// the lightest tiles of its last group. Other masks take groups of one pair (hopper.cu).

#include <cstdint>

#include "../launch.hpp"
#include "tiles.cuh"

namespace flashref::cuda::detail::sm90 {

struct tile_work {
  int b, h, hk;  // batch, query head, key/value head
  int q0, q1;    // query rows [q0, q1) (TMA coordinates are 32-bit: L < 2^31)
};

// Work items of a problem: query tiles of kTileQ rows x heads x batches.
template <int kTileQ>
__host__ __device__ inline std::int64_t work_items(const kernel_params& p) {
  return (p.len_q + kTileQ - 1) / kTileQ * p.heads_q * p.batch;
}

// Work item `work` (0 <= work < work_items<kTileQ>(p)) as the rows it covers; `group` is the
// kernel parameters' work_group (hopper.cu: work_group_heads(p) under a causal mask or a
// window, else 1).
template <int kTileQ>
__device__ __forceinline__ tile_work work_tile(const kernel_params& p, int group, int work) {
  const int len_q = static_cast<int>(p.len_q), heads_q = static_cast<int>(p.heads_q);
  const int tiles_q = (len_q + kTileQ - 1) / kTileQ;
  const int pairs = static_cast<int>(p.batch) * heads_q;
  const work_place<int> at = work_place_of<int>(work, tiles_q, pairs, group);
  tile_work w;
  w.q0 = at.tile * kTileQ;
  w.q1 = w.q0 + kTileQ < len_q ? w.q0 + kTileQ : len_q;
  w.h = at.pair % heads_q;
  w.b = at.pair / heads_q;
  w.hk = w.h / static_cast<int>(p.group);
  return w;
}

// The work item after `work` for this block: the next free one from `counter` (zero before the
// launch; every block starts with item blockIdx.x), or without a counter the next of a fixed
// stride. Called by every lane of the producer warp; lane 0 takes the item.
__device__ __forceinline__ int next_work(int work, std::uint32_t* counter) {
  if (counter == nullptr) return work + static_cast<int>(gridDim.x);
  std::uint32_t n = 0;
  if ((threadIdx.x & 31) == 0) n = atomicAdd(counter, 1u);
  n = __shfl_sync(kFullWarp, n, 0);
  return static_cast<int>(gridDim.x + n);
}

}  // namespace flashref::cuda::detail::sm90
