#pragma once
// The producer role: one warp walks the key tiles that hold a visible key (tile_walker, the
// block mask and causal / window / kv_len turned into a list of partial and full tiles on the
// fly) and loads Q once and each tile's K and V with TMA into the next free stage. A query tile
// with no visible key loads nothing: the first stage carries kNoMoreTiles at once.

#include <cstdint>

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

// V rows [k0, k0 + kTileK) with rows at or past key_end zero-filled, by the 32 lanes of the
// warp with ordinary loads and stores, in the layout TMA would have written. Used for the tile
// that straddles kv_len: the keys past it may be uninitialised (a KV cache's padding), and P V
// must never multiply a zero probability by a NaN there.
template <class T, int kD>
__device__ void load_v_rows_zero_tail(unsigned char* s_v, const kernel_params& p,
                                      const tile_work& w, std::int64_t k0, std::int64_t key_end) {
  constexpr int kChunks = kD / 8;  // 16-byte chunks per row
  const T* gV = static_cast<const T*>(p.v) + w.b * p.v_stride[0] + w.hk * p.v_stride[1];
  for (int idx = static_cast<int>(threadIdx.x % 32); idx < kTileK * kChunks; idx += 32) {
    const int row = idx / kChunks;
    const int chunk = idx % kChunks;
    uint4 data = make_uint4(0, 0, 0, 0);
    if (k0 + row < key_end) {
      data = *reinterpret_cast<const uint4*>(gV + (k0 + row) * p.v_stride[2] + chunk * 8);
    }
    const int box = chunk / 8;
    const int swizzled = (chunk % 8) ^ (row % 8);
    *reinterpret_cast<uint4*>(s_v + box * tiles<kD>::kKVBoxBytes + row * 128 + swizzled * 16) =
        data;
  }
}

template <class T, int kD>
__device__ void produce(const kernel_params& p, const tensor_maps& maps, const tile_work& w,
                        const shared_tiles<kD>& smem, barriers<tiles<kD>::kStages>& bar) {
  using t = tiles<kD>;
  const bool leader = threadIdx.x % 32 == 0;
  tile_walker<kTileK> walker(p.mask, w.b, w.h, w.q0, w.q1);
  std::int64_t tile = 0;
  bool full = false;
  bool have = walker.next(tile, full);
  if (have && leader) {
    mbar_arrive_expect_tx(&bar.q_full, t::kQBytes);
    for (int c = 0; c < t::kBoxes; ++c) {
      tma_load_4d(smem.q + c * t::kQBoxBytes, &maps.q, c * kBoxCols, int(w.q0), int(w.h), int(w.b),
                  &bar.q_full);
    }
  }
  int it = 0;
  for (;; ++it) {
    const int s = it % t::kStages;
    mbar_wait(&bar.empty[s], ((it / t::kStages) & 1) ^ 1);  // the consumers released stage s
    if (!have) {
      if (leader) {
        bar.info[s] = {kNoMoreTiles, 0};
        mbar_arrive(&bar.k_full[s]);
      }
      return;
    }
    const std::int64_t k0 = tile * kTileK;
    const bool v_tail = k0 + kTileK > walker.key_end && walker.key_end < p.len_k;
    if (leader) {
      bar.info[s] = {int(tile), full ? 1 : 0};
      mbar_arrive_expect_tx(&bar.k_full[s], t::kKVBytes);
      for (int c = 0; c < t::kBoxes; ++c) {
        tma_load_4d(smem.k_stage(s) + c * t::kKVBoxBytes, &maps.k, c * kBoxCols, int(k0), int(w.hk),
                    int(w.b), &bar.k_full[s]);
      }
      if (!v_tail) {
        mbar_arrive_expect_tx(&bar.v_full[s], t::kKVBytes);
        for (int c = 0; c < t::kBoxes; ++c) {
          tma_load_4d(smem.v_stage(s) + c * t::kKVBoxBytes, &maps.v, c * kBoxCols, int(k0),
                      int(w.hk), int(w.b), &bar.v_full[s]);
        }
      }
    }
    if (v_tail) {
      load_v_rows_zero_tail<T, kD>(smem.v_stage(s), p, w, k0, walker.key_end);
      fence_proxy_async();  // the stores above are read by wgmma next
      __syncwarp();
      if (leader) mbar_arrive(&bar.v_full[s]);
    }
    have = walker.next(tile, full);
  }
}

}  // namespace flashref::cuda::detail::sm90
