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
  unsigned nonempty = 0;
  unsigned full = 0;

  __device__ tile_walker(const mask_spec& m, std::int64_t b_, std::int64_t h_, std::int64_t q0_,
                         std::int64_t q1_)
      : mask(m), b(b_), h(h_), q0(q0_), q1(q1_) {
    key_end = m.len_k;
    if (m.kv_len != nullptr && m.kv_len[b] < key_end) key_end = m.kv_len[b];
    const key_range first = m.row_range(b, q0);
    const key_range last = m.row_range(b, q1 - 1);
    const std::int64_t tile_begin = first.lo / kTileK;
    tile_end = last.hi > first.lo ? (last.hi + kTileK - 1) / kTileK : tile_begin;
    base = tile_begin - 32;
  }

  __device__ bool next(std::int64_t& tile, bool& is_full) {
    while (nonempty == 0) {
      base += 32;
      if (base >= tile_end) return false;
      const std::int64_t t = base + (threadIdx.x & 31);
      tile_class c = tile_class::empty;
      if (t < tile_end) {
        const std::int64_t k0 = t * kTileK;
        const std::int64_t k1 = k0 + kTileK < mask.len_k ? k0 + kTileK : mask.len_k;
        c = mask.classify(b, h, q0, q1, k0, k1);
        // A tile running past the last key has keys that do not exist: element-mask it.
        if (c == tile_class::full && k0 + kTileK > mask.len_k) c = tile_class::partial;
      }
      nonempty = __ballot_sync(kFullWarp, c != tile_class::empty);
      full = __ballot_sync(kFullWarp, c == tile_class::full);
    }
    const int bit = __ffs(nonempty) - 1;
    nonempty &= nonempty - 1;
    tile = base + bit;
    is_full = (full >> bit) & 1u;
    return true;
  }
};

// Key visibility inside a partial tile; rows past the end of the problem see nothing.
__device__ __forceinline__ bool key_visible(const mask_spec& m, std::int64_t b, std::int64_t h,
                                            std::int64_t i, std::int64_t j) {
  return i < m.len_q && j < m.len_k && m.visible(b, h, i, j);
}

}  // namespace flashref::cuda::detail
