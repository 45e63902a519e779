#pragma once
// Which query tile a block computes next. The kernel is persistent: one block per SM walks
// work items (query tile, head, batch) in the order below, each block taking the next free item
// from a counter in global memory when the producer starts its current one (so that blocks
// that drew short tiles take more). Items are numbered with the query tile fastest and the
// heaviest tiles first: under a causal mask (or any mask whose row intervals grow with the
// row) the last query tiles see the most keys, so they start while the short ones fill the
// tail; the tiles of one head run close together and share its K and V in L2.

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

// Work item `work` (0 <= work < work_items<kTileQ>(p)) as the rows it covers.
template <int kTileQ>
__device__ __forceinline__ tile_work work_tile(const kernel_params& p, int work) {
  const int len_q = static_cast<int>(p.len_q), heads_q = static_cast<int>(p.heads_q);
  const int tiles_q = (len_q + kTileQ - 1) / kTileQ;
  const int bh = work / tiles_q;
  tile_work w;
  w.q0 = (tiles_q - 1 - (work - bh * tiles_q)) * kTileQ;
  w.q1 = w.q0 + kTileQ < len_q ? w.q0 + kTileQ : len_q;
  w.h = bh % heads_q;
  w.b = bh / heads_q;
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
