#pragma once
// Device helpers shared by the kernels: element conversion, output stores, and the walk over
// the key tiles of one query tile that hold a visible key.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "flashref/reference/mask.hpp"
#include "flashref/reference/online_softmax.hpp"
#include "launch.hpp"

namespace flashref::cuda::detail {

inline constexpr unsigned kFullWarp = 0xffffffffu;
inline constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}

// Two floats -> one register of two 16-bit elements (lo in the low half).
template <class T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
}

// Stores one output element as float32 or as the input element type T.
template <class T>
__device__ __forceinline__ void store_out(void* o, std::int64_t off, float x, elem out) {
  if (out == elem::f32) {
    static_cast<float*>(o)[off] = x;
  } else if constexpr (sizeof(T) == 2) {
    if constexpr (std::is_same_v<T, __half>) {
      static_cast<__half*>(o)[off] = __float2half_rn(x);
    } else {
      static_cast<__nv_bfloat16*>(o)[off] = __float2bfloat16_rn(x);
    }
  }
}

// 32 tiles classified at once, one per lane, for the walkers below: lane l classifies tile
// base + l (tiles at or past `end` are empty) and two ballots give the non-empty and the full
// ones; every lane of the warp gets the same answer.
struct tile_ballot {
  unsigned nonempty = 0;
  unsigned full = 0;

  template <class Classify>
  __device__ void classify(std::int64_t base, std::int64_t end, const Classify& classify_tile) {
    const std::int64_t t = base + (threadIdx.x & 31);
    const tile_class c = t < end ? classify_tile(t) : tile_class::empty;
    nonempty = __ballot_sync(kFullWarp, c != tile_class::empty);
    full = __ballot_sync(kFullWarp, c == tile_class::full);
  }

  // The next non-empty tile of the ballot, in ascending order (nonempty must be non-zero).
  __device__ void pop(std::int64_t base, std::int64_t& tile, bool& is_full) {
    const int bit = __ffs(nonempty) - 1;
    nonempty &= nonempty - 1;
    tile = base + bit;
    is_full = (full >> bit) & 1u;
  }
};

// The key tiles [k0, k0 + kTileK) of query rows [q0, q1) that hold a visible key, in ascending
// order, each with its class (full: no element mask needed). Every lane of every warp of the
// block calls next() the same number of times and gets the same answer: lane l classifies tile
// base + l and one ballot covers 32 tiles, so scanning past empty tiles costs 1/32 of a
// classification each. Only tiles between the first row's first key and the last row's last
// key are looked at (both ends of a row's key interval are non-decreasing in the row).
template <int kTileK>
struct tile_walker {
  const mask_spec& mask;
  std::int64_t b, h, q0, q1;
  std::int64_t key_end;  // min(Lk, kv_len[b]): keys at or past it are never loaded
  std::int64_t tile_end;
  std::int64_t base;
  tile_ballot ballot;

  __device__ tile_walker(const mask_spec& m, std::int64_t b_, std::int64_t h_, std::int64_t q0_,
                         std::int64_t q1_)
      : mask(m), b(b_), h(h_), q0(q0_), q1(q1_) {
    key_end = m.key_end(b);
    const key_range first = m.row_range(b, q0);
    const key_range last = m.row_range(b, q1 - 1);
    const std::int64_t tile_begin = first.lo / kTileK;
    tile_end = last.hi > first.lo ? (last.hi + kTileK - 1) / kTileK : tile_begin;
    base = tile_begin - 32;
  }

  // Whether next() has a tile: the ballots are taken ahead as far as the next one needs.
  __device__ bool more() {
    while (ballot.nonempty == 0) {
      base += 32;
      if (base >= tile_end) return false;
      ballot.classify(base, tile_end, [&](std::int64_t t) {
        const std::int64_t k0 = t * kTileK;
        const std::int64_t k1 = k0 + kTileK < mask.len_k ? k0 + kTileK : mask.len_k;
        const tile_class c = mask.classify(b, h, q0, q1, k0, k1);
        // A tile running past the last key has keys that do not exist: element-mask it.
        return c == tile_class::full && k0 + kTileK > mask.len_k ? tile_class::partial : c;
      });
    }
    return true;
  }

  // The next tile, where more() said there is one.
  __device__ void pop(std::int64_t& tile, bool& is_full) { ballot.pop(base, tile, is_full); }

  __device__ bool next(std::int64_t& tile, bool& is_full) {
    if (!more()) return false;
    pop(tile, is_full);
    return true;
  }
};

// tile_walker for a mask without a block mask (causal, window and kv_len alone), in a few
// registers: the tiles and classes of mask_spec::key_tiles (every tile holding a visible key,
// with classify()'s class: tests/reference holds it to that; tile_walker also visits the
// tiles without one that classify() conservatively keeps, which change no bit of a result),
// kept in 32 bits (the Hopper kernel's tensor maps already require L < 2^31).
template <int kTileK>
struct range_walker {
  int key_end;  // min(Lk, kv_len[b]), as tile_walker's
  int full_begin, full_end;
  int tile, tile_end;

  __device__ range_walker(const mask_spec& m, std::int64_t b, std::int64_t /*h*/, std::int64_t q0,
                          std::int64_t q1) {
    key_end = static_cast<int>(m.key_end(b));
    const mask_spec::tile_span span = m.key_tiles(b, q0, q1, kTileK);
    tile = static_cast<int>(span.tile_begin);
    tile_end = static_cast<int>(span.tile_end);
    full_begin = static_cast<int>(span.full_begin);
    full_end = static_cast<int>(span.full_end);
  }

  __device__ bool more() const { return tile < tile_end; }

  // The next tile, where more() said there is one.
  __device__ void pop(std::int64_t& t, bool& is_full) {
    const int k0 = tile * kTileK;
    t = tile++;
    is_full = k0 >= full_begin && k0 + kTileK <= full_end;  // mask_spec::tile_full
  }
};

// The query tiles [q0, q0 + kTileQ) of query heads [h_begin, h_end) (one GQA group) that hold
// a query seeing one of the keys [k0, k1), head by head, each head's tiles in ascending order:
// tile_walker read column-wise, for the backward's dK, dV pass (FlexAttention's q_indices /
// full_q_indices, built 32 tiles per ballot instead of stored). The rows that can see a key of
// [k0, k1) form one interval (both ends of a row's key interval are non-decreasing in the row;
// the same for every head), found by two binary searches; only its tiles are classified. A tile
// running past the last query is partial: its missing rows must not enter a full tile's
// unmasked arithmetic.
//
// kNarrow (the Hopper backward: its rows and keys are TMA coordinates, below 2^31, as any
// length a GPU holds is there): the tiles' block-mask rows formed by 32-bit division, the block
// sizes clamped to [1, L] (the same quotients for indices below L), and the key blocks once: a
// 64-bit division is a subroutine call whose registers the producer warp does not have.
template <int kTileQ, bool kNarrow = false>
struct query_tile_walker {
  const mask_spec& mask;
  std::int64_t b, h, h_end, k0, k1;
  std::int64_t tile_begin, tile_end;
  std::int64_t base;
  tile_ballot ballot;
  key_range kb_span{0, 0};
  std::uint32_t block_q = 1;

  __device__ query_tile_walker(const mask_spec& m, std::int64_t b_, std::int64_t h_begin,
                               std::int64_t h_end_, std::int64_t k0_, std::int64_t k1_)
      : mask(m), b(b_), h(h_begin), h_end(h_end_), k0(k0_), k1(k1_) {
    // first: the first row whose interval ends past k0; last: the first row whose interval
    // starts at or after k1. Rows [first, last) are the only ones that can see the tile.
    std::int64_t lo = 0, hi = m.len_q;
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (m.row_range(b, mid).hi > k0) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    const std::int64_t first = lo;
    hi = m.len_q;
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (m.row_range(b, mid).lo >= k1) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    const std::int64_t last = lo;
    tile_begin = first / kTileQ;
    // No rows, or no query heads (Hq = 0 leaves a key/value head without a group): no tiles.
    tile_end = last > first && h < h_end ? (last + kTileQ - 1) / kTileQ : tile_begin;
    base = tile_begin - 32;
    if (kNarrow && m.block_mask != nullptr) {
      const auto clamp = [](std::int64_t size, std::int64_t len) {
        return static_cast<std::uint32_t>(size < len ? size : len > 1 ? len : 1);
      };
      const std::uint32_t block_k = clamp(m.block_k, m.len_k);
      kb_span = {static_cast<std::uint32_t>(k0) / block_k,
                 static_cast<std::uint32_t>(k1 - 1) / block_k};
      block_q = clamp(m.block_q, m.len_q);
    }
  }

  __device__ bool next(std::int64_t& head, std::int64_t& tile, bool& is_full) {
    while (ballot.nonempty == 0) {
      base += 32;
      if (base >= tile_end) {  // this head is done: the next one of the group
        if (++h >= h_end) return false;
        base = tile_begin - 32;
        continue;
      }
      ballot.classify(base, tile_end, [&](std::int64_t t) {
        const std::int64_t q0 = t * kTileQ;
        const std::int64_t q1 = q0 + kTileQ < mask.len_q ? q0 + kTileQ : mask.len_q;
        tile_class c;
        if constexpr (kNarrow) {
          const key_range qb{static_cast<std::uint32_t>(q0) / block_q,
                             static_cast<std::uint32_t>(q1 - 1) / block_q};
          c = mask.classify_in_blocks(b, h, q0, q1, k0, k1, qb, kb_span);
        } else {
          c = mask.classify(b, h, q0, q1, k0, k1);
        }
        return c == tile_class::full && q0 + kTileQ > mask.len_q ? tile_class::partial : c;
      });
    }
    head = h;
    ballot.pop(base, tile, is_full);
    return true;
  }
};

// The address of element `off` of a tensor whose element type is known at run time.
__host__ __device__ inline const void* element_at(const void* t, std::int64_t off, elem e) {
  return static_cast<const char*>(t) + off * (e == elem::f32 ? 4 : 2);
}

// Reads one element of a tensor whose element type is known at run time.
__device__ __forceinline__ float load_elem(const void* t, std::int64_t off, elem e) {
  switch (e) {
    case elem::bf16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(t)[off]);
    case elem::f16:
      return __half2float(static_cast<const __half*>(t)[off]);
    case elem::f32:
      break;
  }
  return static_cast<const float*>(t)[off];
}

// Stores one element of a tensor whose element type is known at run time.
__device__ __forceinline__ void store_elem(void* t, std::int64_t off, float x, elem e) {
  switch (e) {
    case elem::bf16:
      static_cast<__nv_bfloat16*>(t)[off] = __float2bfloat16_rn(x);
      return;
    case elem::f16:
      static_cast<__half*>(t)[off] = __float2half_rn(x);
      return;
    case elem::f32:
      break;
  }
  static_cast<float*>(t)[off] = x;
}

// The element type of T.
template <class T>
__host__ __device__ constexpr elem elem_of() {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return elem::bf16;
  if constexpr (std::is_same_v<T, __half>) return elem::f16;
  return elem::f32;
}

// Rows [row0, row0 + rows) of a (rows, cols) strided tile of element type e into shared memory
// as float; rows at or past row_end are zero-filled.
template <int kThreads>
__device__ void load_rows(float* s_dst, int pitch, const void* g_base, elem e,
                          std::int64_t row_stride, std::int64_t col_stride, std::int64_t row0,
                          int rows, std::int64_t cols, std::int64_t row_end) {
  const std::int64_t n = rows * cols;
  for (std::int64_t idx = threadIdx.x; idx < n; idx += kThreads) {
    const std::int64_t r = idx / cols, c = idx % cols;
    const bool valid = row0 + r < row_end;
    s_dst[r * pitch + c] =
        valid ? load_elem(g_base, (row0 + r) * row_stride + c * col_stride, e) : 0.f;
  }
}

// Key visibility inside a partial tile; rows past the end of the problem see nothing.
__device__ __forceinline__ bool key_visible(const mask_spec& m, std::int64_t b, std::int64_t h,
                                            std::int64_t i, std::int64_t j) {
  return i < m.len_q && j < m.len_k && m.visible(b, h, i, j);
}

// Visibility of keys j0 + 8 nb + c (nb < kBlocks, c < 2) to query row i, one bit each
// (bit 2 nb + c): the keys one thread holds of a row in the m16n8 accumulator layout. The
// row's key interval (mask_spec::row_range: causal, window, kv_len) once, then the keys in it
// as one run of bits (offsets_in) or, with a block mask, per key the interval test and its
// block: mask_spec::visible's rule. kPerKey tests each key against the interval instead of
// taking the run (the same bits): the Hopper forward's 176-key tiles, whose 240-register
// consumers spill 8 bytes with the run's arithmetic, and whose rows are long enough (8192 keys
// and more) that their partial tiles are one in fifty.
template <int kBlocks, bool kPerKey = false>
__device__ __forceinline__ std::uint32_t key_bits(const mask_spec& m, std::int64_t b,
                                                  std::int64_t h, std::int64_t i, std::int64_t j0) {
  if (i >= m.len_q) return 0;  // rows past the end of the problem see nothing
  const key_range r = m.row_range(b, i);
  std::uint32_t bits = 0;
  if (m.block_mask == nullptr) {
    if constexpr (kPerKey) {
#pragma unroll
      for (int n = 0; n < 2 * kBlocks; ++n) {
        const std::int64_t j = j0 + (n / 2) * 8 + n % 2;
        if (j >= r.lo && j < r.hi) bits |= 1u << n;
      }
      return bits;
    } else {
      return offsets_in<kBlocks>(r.lo - j0, r.hi - j0);
    }
  }
  const std::int64_t qb = i / m.block_q;
#pragma unroll 1
  for (int n = 0; n < 2 * kBlocks; ++n) {
    const std::int64_t j = j0 + (n / 2) * 8 + n % 2;
    if (j >= r.lo && j < r.hi && m.block_visible(b, h, qb, j / m.block_k)) bits |= 1u << n;
  }
  return bits;
}

// Visibility of key j to query rows i0 + 8 nb + c (nb < kBlocks, c < 2), one bit each
// (bit 2 nb + c): the rows one thread holds of a key in the transposed (key-major) m16n8
// accumulator layout of the backward's dK, dV passes. One visibility test per row: the form
// the mma.sync dK, dV kernel takes (its registers do not take the interval's arithmetic below:
// 8 bytes of spills at D = 128).
template <int kBlocks>
__device__ __forceinline__ std::uint32_t query_bits(const mask_spec& m, std::int64_t b,
                                                    std::int64_t h, std::int64_t j,
                                                    std::int64_t i0) {
  std::uint32_t bits = 0;
#pragma unroll 1
  for (int n = 0; n < 2 * kBlocks; ++n) {
    if (key_visible(m, b, h, i0 + (n / 2) * 8 + n % 2, j)) bits |= 1u << n;
  }
  return bits;
}

// The same given the key's row interval `r` (mask_spec::query_range: causal, window, kv_len):
// without a block mask, the rows in it as one run of bits (offsets_in; per row a row_range
// before: about six times a full tile's instructions per partial tile in the Hopper dK, dV
// kernel, cuda/NOTES.md b3.6); with one, per row as above.
template <int kBlocks>
__device__ __forceinline__ std::uint32_t query_bits(const mask_spec& m, std::int64_t b,
                                                    std::int64_t h, std::int64_t j, std::int64_t i0,
                                                    const key_range& r) {
  if (m.block_mask != nullptr) return query_bits<kBlocks>(m, b, h, j, i0);
  return offsets_in<kBlocks>(r.lo - i0, r.hi - i0);
}

// Accumulator element e (0..3) of n8 block nb in the visibility words of key_bits / query_bits:
// word e / 2 (the thread's first or second row, or key), bit 2 nb + e % 2.
__device__ __forceinline__ bool fragment_bit(const std::uint32_t (&visible)[2], int nb, int e) {
  return (visible[e / 2] >> (2 * nb + e % 2)) & 1u;
}

}  // namespace flashref::cuda::detail
