#pragma once
// Which query tile a block computes. One block per (query tile, head, batch); blocks are
// launched in blockIdx.x order, and the heaviest tiles come first: under a causal mask (or any
// mask whose row intervals grow with the row) the last query tiles see the most keys, so they
// start while the short ones fill the tail of the launch.

#include <cstdint>

#include "../launch.hpp"
#include "tiles.cuh"

namespace flashref::cuda::detail::sm90 {

struct tile_work {
  std::int64_t b, h, hk;  // batch, query head, key/value head
  std::int64_t q0, q1;    // query rows [q0, q1)
};

__device__ __forceinline__ tile_work schedule(const kernel_params& p) {
  tile_work w;
  w.q0 = (std::int64_t(gridDim.x) - 1 - blockIdx.x) * kTileQ;
  w.q1 = w.q0 + kTileQ < p.len_q ? w.q0 + kTileQ : p.len_q;
  w.h = blockIdx.y;
  w.b = blockIdx.z;
  w.hk = w.h / p.group;
  return w;
}

}  // namespace flashref::cuda::detail::sm90
