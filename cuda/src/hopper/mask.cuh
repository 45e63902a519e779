#pragma once
// The mask policy of one key tile, decided once per tile by the producer's classification:
// a full tile only scales its scores (by score_scale::pre: nothing with a positive scale, which
// the softmax folds into its exponent); a partial tile also sets the scores of masked keys to
// -inf, so that they never enter the exponent arithmetic (exp(-inf - m) = 0 exactly).

#include <cstdint>

#include "../common.cuh"
#include "../launch.hpp"
#include "scheduler.cuh"
#include "softmax.cuh"
#include "tiles.cuh"

namespace flashref::cuda::detail::sm90 {

// Where this thread's accumulator elements sit in a consumer warpgroup's 64-row tile:
// element 4 n8 + e is row row(e) and column 8 n8 + col(e).
struct fragment_coords {
  int row0;  // first of this thread's two rows, within the block's kTileQ rows
  int col0;  // first of this thread's two columns in each n8 block

  __device__ explicit fragment_coords(int consumer) {
    const int t = static_cast<int>(threadIdx.x % 128);
    row0 = consumer * kRowsPerConsumer + (t / 32) * 16 + (t % 32) / 4;
    col0 = 2 * (t % 4);
  }
};

struct tile_mask {
  const mask_spec& mask;
  const tile_work& w;
  score_scale scale;

  // s: (64 rows, 2 kN keys) of scores of key tile `tile` (tiles of 2 kN keys), this thread's
  // 2 x kN / 2 of them.
  template <int kN>
  __device__ void apply(float (&s)[kN], const fragment_coords& at, std::int64_t tile,
                        bool full) const {
    if (full) {
      if (scale.folded) return;
#pragma unroll
      for (int i = 0; i < kN; ++i)
        s[i] *= scale.pre;
      return;
    }
    mask_blocks<0>(s, at, tile);
  }

  // A partial tile of at most 128 keys in two steps, for a caller short of registers: this
  // thread's bits of the tile (as mask_blocks forms them) before its scores are in registers,
  // then the scores masked by them.
  template <int kN>
  __device__ void bits(std::uint32_t (&visible)[2], const fragment_coords& at,
                       std::int64_t tile) const {
    static_assert(kN <= 64, "one word of bits per row");
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      visible[r] = detail::key_bits<kN / 4, false>(mask, w.b, w.h, w.q0 + at.row0 + 8 * r,
                                                   tile * (2 * kN) + at.col0);
    }
  }
  template <int kN>
  __device__ void apply_bits(float (&s)[kN], const std::uint32_t (&visible)[2]) const {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const bool on = fragment_bit(visible, i / 4, i % 4);
      s[i] = on ? s[i] * scale.pre : -INFINITY;
    }
  }

 private:
  // n8 blocks [kFirst, kFirst + 16) of a partial tile (to its end, if nearer): one bit per key
  // this thread holds of each row (bit 2 nb + c: key 8 (kFirst + nb) + col0 + c), built in a
  // rolled loop so that the hot unrolled loop below only tests bits; a tile of more than 128
  // keys takes a second word.
  template <int kFirst, int kN>
  __device__ __forceinline__ void mask_blocks(float (&s)[kN], const fragment_coords& at,
                                              std::int64_t tile) const {
    constexpr int kBlocks = kN / 4 - kFirst < 16 ? kN / 4 - kFirst : 16;
    std::uint32_t visible[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      visible[r] = detail::key_bits<kBlocks, (kN > 64)>(mask, w.b, w.h, w.q0 + at.row0 + 8 * r,
                                                        tile * (2 * kN) + 8 * kFirst + at.col0);
    }
#pragma unroll
    for (int i = 0; i < 4 * kBlocks; ++i) {
      const int nb = i / 4, e = i % 4;
      const bool on = fragment_bit(visible, nb, e);
      float& x = s[4 * kFirst + i];
      x = on ? x * scale.pre : -INFINITY;
    }
    if constexpr (kFirst + 16 < kN / 4) mask_blocks<kFirst + 16>(s, at, tile);
  }
};

}  // namespace flashref::cuda::detail::sm90
