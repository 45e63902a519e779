// The backward pass (SPEC §9) outside the tensor cores: the Delta pre-pass every backward runs
// first (for dQ in fixed point, with the key/value bounds before it and each row's scale beside
// Delta), and the float32 SIMT backward (any strides, head dims up to kSimtMaxHeadDim, any
// element types).
//
// The SIMT backward is two kernels, each owning what it writes, so that no sum depends on the
// order in which blocks run (bitwise deterministic):
//  - dK, dV: one block per 32 keys of one key/value head; it walks the query heads of the
//    group and, for each, only the query tiles that see its keys (query_tile_walker), in order;
//  - dQ: one block per 32 query rows; it walks the key tiles the rows see (tile_walker).
// 8 threads share a key (resp. a row) as in the forward SIMT kernel. A masked pair is skipped,
// never multiplied by 0: a NaN of a masked key or row reaches nothing (SPEC §2).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "guards.hpp"
#include "launch.hpp"

namespace flashref::cuda::detail {
namespace {

constexpr int kTile = 32;  // keys per dK/dV block, rows per dQ block, and the tile walked
constexpr int kThreads = 256;
constexpr int kLanes = kThreads / kTile;                 // 8 threads per key (row)
constexpr int kPerLane = kTile / kLanes;                 // 4 rows (keys) each
constexpr int kMaxCols = int(kSimtMaxHeadDim) / kLanes;  // 32 output columns each
constexpr int kRowsPerDeltaBlock = 8;                    // one warp per row

// Dot product of two shared-memory rows.
__device__ __forceinline__ float dot_rows(const float* a, const float* b, std::int64_t n) {
  float s = 0.f;
  for (std::int64_t d = 0; d < n; ++d)
    s = fmaf(a[d], b[d], s);
  return s;
}

// OR of one 8-thread group's words: the visibility of the 32 pairs the group computed.
__device__ __forceinline__ std::uint32_t group_or(std::uint32_t bits) {
  for (int off = 1; off < kLanes; off *= 2)
    bits |= __shfl_xor_sync(kFullWarp, bits, off);
  return bits;
}

// dQ in fixed point (launch.hpp, dq_fixed_scale): row n's scale from the bound
// max|K| (||dO_n|| max_j ||V_j|| + |Delta_n|) on every part and every sum of its dQ
// (hopper/backward.cuh, "dQ in fixed point"), given ||dO_n||^2, Delta_n and the bounds of its
// batch and key/value head (kv_bounds_kernel, run before); the row's flag is 1 where the bound is
// not finite (dO, or O through Delta), else 0.
__device__ __forceinline__ void set_dq_row_scale(const backward_params& bp, std::int64_t n,
                                                 std::int64_t b, std::int64_t h, float d_o_sq,
                                                 float delta) {
  const kernel_params& p = bp.fwd;
  const std::uint32_t* kv = bp.kv_bounds + (b * p.heads_k + h / p.group) * 2;
  const float bound =
      __uint_as_float(kv[0]) * (sqrtf(d_o_sq) * sqrtf(__uint_as_float(kv[1])) + fabsf(delta));
  const float scale = dq_fixed_scale(bound);
  bp.dq_row_scale[n] = scale;
  bp.dq_row_flags[n] = scale == 0.f ? 1u : 0u;
}

// Delta_i = Σ_d dO_id O_id, one warp per row, summed in a fixed order; with fixed-point dQ
// (dq_row_scale set) also ||dO_i||^2 and the row's scale.
__global__ void delta_kernel(const backward_params bp) {
  const kernel_params& p = bp.fwd;
  const std::int64_t row = std::int64_t(blockIdx.x) * kRowsPerDeltaBlock + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= p.batch * p.heads_q * p.len_q) return;
  const std::int64_t i = row % p.len_q, h = row / p.len_q % p.heads_q,
                     b = row / (p.len_q * p.heads_q);
  const std::int64_t o_row = b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2];
  const std::int64_t d_o_row = b * bp.d_o_stride[0] + h * bp.d_o_stride[1] + i * bp.d_o_stride[2];
  float s = 0.f, g2 = 0.f;
  for (std::int64_t d = lane; d < p.head_dim_v; d += 32) {
    const float g = load_elem(bp.d_o, d_o_row + d * bp.d_o_stride[3], bp.d_o_elem);
    s = fmaf(g, load_elem(p.o, o_row + d * p.o_stride[3], p.out), s);
    g2 = fmaf(g, g, g2);
  }
  for (int off = 16; off > 0; off /= 2) {
    s += __shfl_xor_sync(kFullWarp, s, off);
    g2 += __shfl_xor_sync(kFullWarp, g2, off);
  }
  if (lane != 0) return;
  bp.delta[row] = s;
  if (bp.dq_row_scale != nullptr) set_dq_row_scale(bp, row, b, h, g2, s);
}

// Delta by 16-byte loads, for O and dO whose rows are 16-byte aligned with unit column stride
// and Dv a multiple of 8 (rows_of_16_bytes): kDeltaLanes lanes share a row, each summing
// 8 consecutive columns at a time (columns 8 (lane + kDeltaLanes j) + e, j = 0, 1, ...), then a
// butterfly over the lanes. The order is fixed by the layout alone: bitwise deterministic. The
// one-warp-per-row kernel above, reading 2 or 4 bytes per lane through a run-time element type,
// ran at about an eighth of the memory bandwidth (0.30 ms for 262144 rows of 128 columns on an
// H200 under ncu, 18 % of a dense D = 128 backward at L = 1024).
constexpr int kDeltaLanes = 8;
constexpr int kDeltaThreads = 256;  // 32 rows per block

// Columns [0, 8) kept as loaded (one 16-byte word; two for float32) until they are used: a
// thread holding several loads in flight spends 4 registers on each, not 8.
template <class T>
struct raw8 {
  uint4 w;
};
template <>
struct raw8<float> {
  float4 a, b;
};
template <class T>
__device__ __forceinline__ raw8<T> load_raw8(const T* src) {
  return {__ldg(reinterpret_cast<const uint4*>(src))};
}
template <>
__device__ __forceinline__ raw8<float> load_raw8(const float* src) {
  return {__ldg(reinterpret_cast<const float4*>(src)),
          __ldg(reinterpret_cast<const float4*>(src) + 1)};
}
template <class T>
__device__ __forceinline__ raw8<T> zero_raw8() {
  return {make_uint4(0u, 0u, 0u, 0u)};  // +0 in either 16-bit type
}
template <>
__device__ __forceinline__ raw8<float> zero_raw8() {
  return {make_float4(0.f, 0.f, 0.f, 0.f), make_float4(0.f, 0.f, 0.f, 0.f)};
}
template <class T>
__device__ __forceinline__ void unpack8(const raw8<T>& r, float (&x)[8]) {
  const T* e = reinterpret_cast<const T*>(&r.w);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    x[i] = to_float(e[i]);
}
__device__ __forceinline__ void unpack8(const raw8<float>& r, float (&x)[8]) {
  x[0] = r.a.x, x[1] = r.a.y, x[2] = r.a.z, x[3] = r.a.w;
  x[4] = r.b.x, x[5] = r.b.y, x[6] = r.b.z, x[7] = r.b.w;
}

// Columns [0, 8) from src (16-byte aligned) as floats: one 16-byte load, two for float32.
template <class T>
__device__ __forceinline__ void load8(const T* src, float (&x)[8]) {
  unpack8(load_raw8(src), x);
}

// One chunk of 8 columns into a row's sums: Delta's dO · O and ||dO||^2 (elements ascending:
// every Delta kernel adds its terms through this, in the same order).
__device__ __forceinline__ void add_delta8(const float (&o)[8], const float (&d_o)[8], float& s,
                                           float& g2) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    s = fmaf(d_o[e], o[e], s);
    g2 = fmaf(d_o[e], d_o[e], g2);
  }
}
// Fixed point's bounds from one chunk of a key's K and one of its V: max |K| into k_max and
// the lane's share of ||V_j||^2 into v2, NaN and inf left out (they flag the rows they reach).
__device__ __forceinline__ void add_k_bound8(const float (&k)[8], float& k_max) {
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (isfinite(k[e])) k_max = fmaxf(k_max, fabsf(k[e]));
}
__device__ __forceinline__ void add_v_bound8(const float (&v)[8], float& v2) {
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (isfinite(v[e])) v2 = fmaf(v[e], v[e], v2);
}

// The sum over each group of kLanes consecutive lanes of the warp (a butterfly; every lane of the
// warp calls it), in an order fixed by the lanes alone.
template <int kLanes>
__device__ __forceinline__ float lane_group_sum(float v) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2)
    v += __shfl_xor_sync(kFullWarp, v, off);
  return v;
}

// Row `row` of (B, Hq, Lq) as (i, h, b) where the rows number below 2^32 (the pipelined kernels'
// launch condition): 32-bit divisions only, no 64-bit division's call inside their loops.
__device__ __forceinline__ void row_coordinates32(const kernel_params& p, std::uint32_t row,
                                                  std::int64_t& i, std::int64_t& h,
                                                  std::int64_t& b) {
  const auto lq = static_cast<std::uint32_t>(p.len_q), hq = static_cast<std::uint32_t>(p.heads_q);
  i = row % lq, h = row / lq % hq, b = row / lq / hq;
}

// Delta (and with fixed-point dQ, ||dO||^2 and the row's scale) by kDeltaLanes lanes per row.
template <class TO, class TdO>
__global__ void __launch_bounds__(kDeltaThreads) delta_rows_kernel(const backward_params bp) {
  const kernel_params& p = bp.fwd;
  const std::int64_t rows = p.batch * p.heads_q * p.len_q;
  const std::int64_t row = (std::int64_t(blockIdx.x) * kDeltaThreads + threadIdx.x) / kDeltaLanes;
  const int lane = static_cast<int>(threadIdx.x % kDeltaLanes);
  float s = 0.f, g2 = 0.f;
  std::int64_t i = 0, h = 0, b = 0;
  if (row < rows) {                          // every lane takes part in the butterflies below
    if (rows <= std::int64_t(UINT32_MAX)) {  // 32-bit division where the rows allow
      const auto r = static_cast<std::uint32_t>(row);
      const auto lq = static_cast<std::uint32_t>(p.len_q),
                 hq = static_cast<std::uint32_t>(p.heads_q);
      i = r % lq, h = r / lq % hq, b = r / lq / hq;
    } else {
      i = row % p.len_q, h = row / p.len_q % p.heads_q, b = row / (p.len_q * p.heads_q);
    }
    const TO* o =
        static_cast<const TO*>(p.o) + b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2];
    const TdO* d_o = static_cast<const TdO*>(bp.d_o) + b * bp.d_o_stride[0] + h * bp.d_o_stride[1] +
                     i * bp.d_o_stride[2];
    for (std::int64_t c = 8 * lane; c < p.head_dim_v; c += 8 * kDeltaLanes) {
      float xo[8], xd[8];
      load8(o + c, xo);
      load8(d_o + c, xd);
      add_delta8(xo, xd, s, g2);
    }
  }
  s = lane_group_sum<kDeltaLanes>(s);
  // The same for every thread; never with dO in float32 (the Hopper backward takes dO in its
  // 16-bit input type), whose instance is then spared the square roots' calls.
  const bool fixed = !std::is_same_v<TdO, float> && bp.dq_row_scale != nullptr;
  if (fixed) g2 = lane_group_sum<kDeltaLanes>(g2);
  if (row >= rows || lane != 0) return;
  bp.delta[row] = s;
  if (fixed) set_dq_row_scale(bp, row, b, h, g2, s);
}

// Delta (and the rows' scales) for head dims kDv = 64 and 128 (the Hopper backward's): the same
// sums as delta_rows_kernel, in the same order (column chunks, then elements, ascending: the same
// bits), by a grid of a few blocks per SM, each walking tiles of kGroups · 128 / kDv rows at a
// stride and loading its next tile (four 16-byte loads per thread) before it sums this one.
// One row per short-lived block left the kernel at about half of the memory bandwidth (ncu,
// 134 MB of O and dO at L = 16384), whatever the loads in flight per thread.
constexpr int kPipelinedBlocksPerSm = 3;  // resident at up to 85 registers a thread
// Rows of a tile of delta_rows_pipelined_kernel, keys of one of kv_bounds_pipelined_kernel:
// 128 / d per lane group, each with d / 64 16-byte words of two tensors (O and dO, or K and V),
// so that every thread loads four words per tile.
constexpr std::int64_t pipelined_tile(std::int64_t d) {
  return kDeltaThreads / kDeltaLanes * (128 / d);
}
// The pipelined kernels' grid: a few blocks per SM, or one per tile where there are fewer.
unsigned pipelined_blocks(std::int64_t tiles) {
  const std::int64_t cap = std::int64_t(sm_count()) * kPipelinedBlocksPerSm;
  return static_cast<unsigned>(tiles < cap ? tiles : cap);
}
template <class TO, class TdO, int kDv>
__global__ void __launch_bounds__(kDeltaThreads)
    delta_rows_pipelined_kernel(const backward_params bp) {
  static_assert(kDv == 64 || kDv == 128);
  const kernel_params& p = bp.fwd;
  constexpr int kGroups = kDeltaThreads / kDeltaLanes;
  constexpr int kRows = pipelined_tile(kDv) / kGroups;  // rows per lane group and tile
  constexpr int kChunks = kDv / (8 * kDeltaLanes);      // 16-byte loads per row and tensor
  const std::int64_t rows = p.batch * p.heads_q * p.len_q;
  const std::int64_t tiles = (rows + kGroups * kRows - 1) / (kGroups * kRows);
  const int lane = static_cast<int>(threadIdx.x % kDeltaLanes);
  const std::int64_t group = threadIdx.x / kDeltaLanes;
  struct tile_words {
    raw8<TO> o[kRows][kChunks];
    raw8<TdO> d_o[kRows][kChunks];
  };
  // Rows t kGroups kRows + group + kGroups r of tile t: neighbouring groups, neighbouring rows.
  // Rows past the last (and a tile past the last) read as 0.
  const auto load = [&](std::int64_t t, tile_words& x) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const std::int64_t row = t * kGroups * kRows + group + kGroups * r;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        x.o[r][c] = zero_raw8<TO>();
        x.d_o[r][c] = zero_raw8<TdO>();
      }
      if (row >= rows) continue;
      std::int64_t i = 0, h = 0, b = 0;
      row_coordinates32(p, static_cast<std::uint32_t>(row), i, h, b);
      const TO* o =
          static_cast<const TO*>(p.o) + b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2];
      const TdO* d_o = static_cast<const TdO*>(bp.d_o) + b * bp.d_o_stride[0] +
                       h * bp.d_o_stride[1] + i * bp.d_o_stride[2];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        x.o[r][c] = load_raw8(o + 8 * (lane + kDeltaLanes * c));
        x.d_o[r][c] = load_raw8(d_o + 8 * (lane + kDeltaLanes * c));
      }
    }
  };
  // See delta_rows_kernel: never with dO in float32.
  const bool fixed = !std::is_same_v<TdO, float> && bp.dq_row_scale != nullptr;
  // Tile t's sums, then their rows' words: lane r of each group writes row r (after the
  // butterflies every lane holds every sum), so that the rows' scales of a tile are taken side
  // by side instead of one after another by lane 0.
  const auto finish = [&](const tile_words& x, std::int64_t t) {
    float s[kRows], g2[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      s[r] = g2[r] = 0.f;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        float xo[8], xd[8];
        unpack8(x.o[r][c], xo);
        unpack8(x.d_o[r][c], xd);
        add_delta8(xo, xd, s[r], g2[r]);
      }
      s[r] = lane_group_sum<kDeltaLanes>(s[r]);
      if (fixed) g2[r] = lane_group_sum<kDeltaLanes>(g2[r]);
    }
    float my_s = s[0], my_g2 = g2[0];
#pragma unroll
    for (int r = 1; r < kRows; ++r) {
      if (lane == r) my_s = s[r], my_g2 = g2[r];
    }
    const int r = kRows == 1 ? 0 : lane;  // the row this lane writes, if lane < kRows
    const std::int64_t row = t * kGroups * kRows + group + kGroups * r;
    if (lane < kRows && row < rows) {
      bp.delta[row] = my_s;
      if (fixed) {
        std::int64_t i = 0, h = 0, b = 0;
        row_coordinates32(p, static_cast<std::uint32_t>(row), i, h, b);
        set_dq_row_scale(bp, row, b, h, my_g2, my_s);
      }
    }
  };
  // Two buffers in turn (no copy between them); t is the same in every thread of the block.
  tile_words x0, x1;
  std::int64_t t = blockIdx.x;
  load(t, x0);
  while (t < tiles) {
    load(t + gridDim.x, x1);
    finish(x0, t);
    t += gridDim.x;
    if (t >= tiles) break;
    load(t + gridDim.x, x0);
    finish(x1, t);
    t += gridDim.x;
  }
}

// dQ in fixed point: max |K| and max_j ||V_j||^2 over the keys of batch z below key_end, per
// key/value head y, into bp.kv_bounds (zeroed first) by atomicMax on the float bits (non-negative
// floats order as their bits: the maxima do not depend on the order). kDeltaLanes lanes per key
// as in delta_rows_kernel (K and V in 16-byte rows: the Hopper backward's TMA layout), each warp
// stepping over its keys of the block's kBoundKeys. NaN and inf are left out: they flag the rows
// they reach (hopper_backward.cu, add_dq).
constexpr int kBoundKeys = 256;
template <class T>
__global__ void __launch_bounds__(kDeltaThreads) kv_bounds_kernel(const backward_params bp) {
  const kernel_params& p = bp.fwd;
  const std::int64_t b = blockIdx.z, hk = blockIdx.y;
  const std::int64_t k0 = std::int64_t(blockIdx.x) * kBoundKeys, end = p.mask.key_end(b);
  const std::int64_t k1 = end < k0 + kBoundKeys ? end : k0 + kBoundKeys;
  constexpr int kKeysPerWarp = 32 / kDeltaLanes, kWarps = kDeltaThreads / 32;
  const int lane = static_cast<int>(threadIdx.x % kDeltaLanes);
  const T* gk = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
  const T* gv = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];
  float k_max = 0.f, v_max = 0.f;
  // Whole warps step together (the lane groups' sums shuffle across the warp); a lane past k1
  // adds 0.
  for (std::int64_t j0 = k0 + (threadIdx.x / 32) * kKeysPerWarp; j0 < k1;
       j0 += kWarps * kKeysPerWarp) {
    const std::int64_t j = j0 + (threadIdx.x % 32) / kDeltaLanes;
    float v2 = 0.f;
    if (j < k1) {
      for (std::int64_t c = 8 * lane; c < p.head_dim; c += 8 * kDeltaLanes) {
        float x[8];
        load8(gk + j * p.k_stride[2] + c, x);
        add_k_bound8(x, k_max);
      }
      for (std::int64_t c = 8 * lane; c < p.head_dim_v; c += 8 * kDeltaLanes) {
        float x[8];
        load8(gv + j * p.v_stride[2] + c, x);
        add_v_bound8(x, v2);
      }
    }
    v_max = fmaxf(v_max, lane_group_sum<kDeltaLanes>(v2));  // inf where finite values overflow:
                                                            // the rows get flagged
  }
  for (int off = 16; off > 0; off /= 2) {
    k_max = fmaxf(k_max, __shfl_xor_sync(kFullWarp, k_max, off));
    v_max = fmaxf(v_max, __shfl_xor_sync(kFullWarp, v_max, off));
  }
  if (threadIdx.x % 32 == 0) {
    std::uint32_t* at = bp.kv_bounds + (b * p.heads_k + hk) * 2;
    atomicMax(at, __float_as_uint(k_max));
    atomicMax(at + 1, __float_as_uint(v_max));
  }
}

// The same bounds for D = Dv = kD in {64, 128}, by a grid of a few blocks per SM: the keys of
// every (batch, key/value head) pair in tiles of pipelined_tile(kD) keys, each block
// walking a contiguous run of tiles and loading its next tile (four 16-byte loads per thread)
// before it takes this one's maxima, which it hands to the pair's words whenever its run moves
// to the next pair. A key's ||V_j||^2 adds its terms in the order above: the same bounds.
template <class T, int kD>
__global__ void __launch_bounds__(kDeltaThreads)
    kv_bounds_pipelined_kernel(const backward_params bp) {
  static_assert(kD == 64 || kD == 128);
  const kernel_params& p = bp.fwd;
  constexpr int kGroups = kDeltaThreads / kDeltaLanes;  // keys side by side
  constexpr int kChunks = kD / (8 * kDeltaLanes);       // 16-byte loads per key and tensor
  constexpr std::int64_t kTileKeys = pipelined_tile(kD);
  constexpr int kKeys = kTileKeys / kGroups;  // keys per lane group and tile
  const std::int64_t per_pair = (p.len_k + kTileKeys - 1) / kTileKeys;
  const std::int64_t tiles = p.batch * p.heads_k * per_pair;
  const std::int64_t t0 = tiles * blockIdx.x / gridDim.x, t1 = tiles * (blockIdx.x + 1) / gridDim.x;
  const int lane = static_cast<int>(threadIdx.x % kDeltaLanes);
  const std::int64_t group = threadIdx.x / kDeltaLanes;
  struct tile_words {
    raw8<T> k[kKeys][kChunks], v[kKeys][kChunks];
  };
  // Keys kt kTileKeys + group + kGroups u of the pair's tile kt; those at or past key_end, and
  // every key of a tile that is not `live`, read as 0 (nothing to either bound).
  const auto load = [&](std::int64_t t, bool live, tile_words& x) {
    const auto tu = static_cast<std::uint32_t>(t), per = static_cast<std::uint32_t>(per_pair);
    const auto hks = static_cast<std::uint32_t>(p.heads_k);
    const std::int64_t kt = tu % per, b = tu / per / hks, hk = tu / per % hks;
    const std::int64_t end = live ? p.mask.key_end(b) : 0;
    const T* gk = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
    const T* gv = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];
#pragma unroll
    for (int u = 0; u < kKeys; ++u) {
      const std::int64_t j = kt * kTileKeys + group + kGroups * u;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        x.k[u][c] = x.v[u][c] = zero_raw8<T>();
        if (j < end) {
          x.k[u][c] = load_raw8(gk + j * p.k_stride[2] + 8 * (lane + kDeltaLanes * c));
          x.v[u][c] = load_raw8(gv + j * p.v_stride[2] + 8 * (lane + kDeltaLanes * c));
        }
      }
    }
  };
  // This block's maxima for one pair into its two words.
  const auto hand_over = [&](std::int64_t pair, float k_max, float v_max) {
    for (int off = 16; off > 0; off /= 2) {
      k_max = fmaxf(k_max, __shfl_xor_sync(kFullWarp, k_max, off));
      v_max = fmaxf(v_max, __shfl_xor_sync(kFullWarp, v_max, off));
    }
    if (threadIdx.x % 32 == 0) {
      atomicMax(bp.kv_bounds + pair * 2, __float_as_uint(k_max));
      atomicMax(bp.kv_bounds + pair * 2 + 1, __float_as_uint(v_max));
    }
  };
  if (t0 >= t1) return;  // the same for the whole block
  float k_max = 0.f, v_max = 0.f;
  std::int64_t pair = static_cast<std::uint32_t>(t0) / static_cast<std::uint32_t>(per_pair);
  // Tile t's keys into the maxima, the last pair's handed over first if t starts another.
  const auto take = [&](const tile_words& x, std::int64_t t) {
    const std::int64_t here = static_cast<std::uint32_t>(t) / static_cast<std::uint32_t>(per_pair);
    if (here != pair) {
      hand_over(pair, k_max, v_max);
      k_max = v_max = 0.f;
      pair = here;
    }
#pragma unroll
    for (int u = 0; u < kKeys; ++u) {
      float v2 = 0.f;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        float xk[8], xv[8];
        unpack8(x.k[u][c], xk);
        unpack8(x.v[u][c], xv);
        add_k_bound8(xk, k_max);
        add_v_bound8(xv, v2);
      }
      v_max = fmaxf(v_max, lane_group_sum<kDeltaLanes>(v2));
    }
  };
  // Two buffers in turn, as in delta_rows_pipelined_kernel.
  tile_words x0, x1;
  load(t0, true, x0);
  for (std::int64_t t = t0;;) {
    load(t + 1, t + 1 < t1, x1);
    take(x0, t);
    if (++t >= t1) break;
    load(t + 1, t + 1 < t1, x0);
    take(x1, t);
    if (++t >= t1) break;
  }
  hand_over(pair, k_max, v_max);
}

template <class T>
cudaError_t launch_kv_bounds(const backward_params& bp, cudaStream_t stream) {
  const kernel_params& p = bp.fwd;
  cudaError_t e = cudaMemsetAsync(bp.kv_bounds, 0, std::size_t(p.batch * p.heads_k) * 8, stream);
  if (e != cudaSuccess || p.len_k == 0) return e;
  const std::int64_t d = p.head_dim == p.head_dim_v ? p.head_dim : 0;
  const std::int64_t keys = d == 64 || d == 128 ? pipelined_tile(d) : 0;
  const std::int64_t tiles = keys > 0 ? p.batch * p.heads_k * ((p.len_k + keys - 1) / keys) : 0;
  if (keys > 0 && tiles < std::int64_t(UINT32_MAX)) {  // 32-bit tile indices in the kernel
    const unsigned blocks = pipelined_blocks(tiles);
    if (d == 64) {
      kv_bounds_pipelined_kernel<T, 64><<<blocks, kDeltaThreads, 0, stream>>>(bp);
    } else {
      kv_bounds_pipelined_kernel<T, 128><<<blocks, kDeltaThreads, 0, stream>>>(bp);
    }
    return cudaGetLastError();
  }
  const dim3 grid(static_cast<unsigned>((p.len_k + kBoundKeys - 1) / kBoundKeys),
                  static_cast<unsigned>(p.heads_k), static_cast<unsigned>(p.batch));
  kv_bounds_kernel<T><<<grid, kDeltaThreads, 0, stream>>>(bp);
  return cudaGetLastError();
}

// Unit column stride and every row's start on 16 bytes (the base pointer and the three outer
// strides), so that load8 may read it.
bool rows_of_16_bytes(const void* data, const std::int64_t (&stride)[4], elem e) {
  const std::int64_t size = e == elem::f32 ? 4 : 2;
  return stride[3] == 1 && reinterpret_cast<std::uintptr_t>(data) % 16 == 0 &&
         stride[0] * size % 16 == 0 && stride[1] * size % 16 == 0 && stride[2] * size % 16 == 0;
}

template <class TO, class TdO>
void launch_delta_rows(const backward_params& bp, std::int64_t rows, cudaStream_t stream) {
  const std::int64_t dv = bp.fwd.head_dim_v;
  if ((dv == 64 || dv == 128) && rows < std::int64_t(UINT32_MAX) / 2) {
    const std::int64_t tile_rows = pipelined_tile(dv);
    const unsigned blocks = pipelined_blocks((rows + tile_rows - 1) / tile_rows);
    if (dv == 64) {
      delta_rows_pipelined_kernel<TO, TdO, 64><<<blocks, kDeltaThreads, 0, stream>>>(bp);
    } else {
      delta_rows_pipelined_kernel<TO, TdO, 128><<<blocks, kDeltaThreads, 0, stream>>>(bp);
    }
    return;
  }
  const std::int64_t per_block = kDeltaThreads / kDeltaLanes;
  delta_rows_kernel<TO, TdO>
      <<<static_cast<unsigned>((rows + per_block - 1) / per_block), kDeltaThreads, 0, stream>>>(bp);
}

template <class TO>
void launch_delta_rows_for(const backward_params& bp, std::int64_t rows, cudaStream_t stream) {
  switch (bp.d_o_elem) {
    case elem::bf16:
      return launch_delta_rows<TO, __nv_bfloat16>(bp, rows, stream);
    case elem::f16:
      return launch_delta_rows<TO, __half>(bp, rows, stream);
    case elem::f32:
      return launch_delta_rows<TO, float>(bp, rows, stream);
  }
}

struct simt_bwd_smem {
  int d_pitch, dv_pitch;  // row pitches in floats, padded by one against bank conflicts
  __host__ __device__ simt_bwd_smem(std::int64_t d, std::int64_t dv)
      : d_pitch(int(d) + 1), dv_pitch(int(dv) + 1) {}
  // Four tiles of kTile rows (two of D, two of Dv columns), two (kTile, kTile + 1) tiles of
  // P and dS, and LSE, Delta.
  __host__ __device__ std::size_t bytes() const {
    return sizeof(float) * std::size_t(2 * kTile * d_pitch + 2 * kTile * dv_pitch +
                                       2 * kTile * (kTile + 1) + 2 * kTile);
  }
};

// dK_j = scale Σ_h Σ_i dS_ij Q_i and dV_j = Σ_h Σ_i P_ij dO_i for 32 keys j of one key/value
// head: thread (r, g) owns key k0 + r, computes the pairs with rows g + 8u of each query tile,
// and accumulates columns g + 8c.
template <class T>
__global__ void __launch_bounds__(kThreads) simt_dkdv_kernel(const backward_params bp) {
  const kernel_params& p = bp.fwd;
  extern __shared__ float s_mem[];
  const simt_bwd_smem lay(p.head_dim, p.head_dim_v);
  float* sK = s_mem;                        // (kTile, D)   keys of this block
  float* sV = sK + kTile * lay.d_pitch;     // (kTile, Dv)
  float* sQ = sV + kTile * lay.dv_pitch;    // (kTile, D)   one query tile
  float* sdO = sQ + kTile * lay.d_pitch;    // (kTile, Dv)
  float* sP = sdO + kTile * lay.dv_pitch;   // (kTile keys, kTile rows)
  float* sdS = sP + kTile * (kTile + 1);    // (kTile keys, kTile rows)
  float* sLSE = sdS + kTile * (kTile + 1);  // (kTile)
  float* sDelta = sLSE + kTile;             // (kTile)

  const int r = static_cast<int>(threadIdx.x) / kLanes;
  const int g = static_cast<int>(threadIdx.x) % kLanes;
  const std::int64_t k0 = std::int64_t(blockIdx.x) * kTile;
  const std::int64_t hk = blockIdx.y, b = blockIdx.z;
  const std::int64_t k1 = k0 + kTile < p.len_k ? k0 + kTile : p.len_k;
  const std::int64_t j = k0 + r;
  const std::int64_t D = p.head_dim, Dv = p.head_dim_v;
  const mask_spec& mask = p.mask;
  const std::int64_t key_end = mask.key_end(b);
  const elem in = elem_of<T>();

  float dk[kMaxCols] = {};  // columns g + 8c of dK_j / scale
  float dv[kMaxCols] = {};  // columns g + 8c of dV_j
  bool loaded_kv = false;
  query_tile_walker<kTile> walker(mask, b, hk * p.group, (hk + 1) * p.group, k0, k1);
  std::int64_t h = 0, tile = 0;
  bool tile_full = false;
  while (walker.next(h, tile, tile_full)) {
    const void* gQ = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];
    const void* gdO = element_at(bp.d_o, b * bp.d_o_stride[0] + h * bp.d_o_stride[1], bp.d_o_elem);
    __syncthreads();  // the previous tile's sQ, sdO, sP, sdS are no longer read
    if (!loaded_kv) {
      const T* gK = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
      const T* gV = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];
      load_rows<kThreads>(sK, lay.d_pitch, gK, in, p.k_stride[2], p.k_stride[3], k0, kTile, D,
                          key_end);
      load_rows<kThreads>(sV, lay.dv_pitch, gV, in, p.v_stride[2], p.v_stride[3], k0, kTile, Dv,
                          key_end);
      loaded_kv = true;
    }
    const std::int64_t q0 = tile * kTile;
    load_rows<kThreads>(sQ, lay.d_pitch, gQ, in, p.q_stride[2], p.q_stride[3], q0, kTile, D,
                        p.len_q);
    load_rows<kThreads>(sdO, lay.dv_pitch, gdO, bp.d_o_elem, bp.d_o_stride[2], bp.d_o_stride[3], q0,
                        kTile, Dv, p.len_q);
    if (threadIdx.x < kTile) {
      const std::int64_t i = q0 + threadIdx.x;
      sLSE[threadIdx.x] =
          i < p.len_q ? p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]]
                      : -INFINITY;
      sDelta[threadIdx.x] = i < p.len_q ? bp.delta[(b * p.heads_q + h) * p.len_q + i] : 0.f;
    }
    __syncthreads();

    // P_ij = exp(S_ij - LSE_i) through the guard, dS_ij = P_ij (dO_i · V_j - Delta_i).
    std::uint32_t vis = 0;
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) {
      const int c = g + kLanes * u;
      const std::int64_t i = q0 + c;
      if (!tile_full && !key_visible(mask, b, h, i, j)) continue;
      const float s = dot_rows(sQ + c * lay.d_pitch, sK + r * lay.d_pitch, D) * p.scale;
      const float pij = online_softmax<float>::from_lse(sLSE[c]).prob(s);
      const float dp = dot_rows(sdO + c * lay.dv_pitch, sV + r * lay.dv_pitch, Dv);
      sP[r * (kTile + 1) + c] = pij;
      sdS[r * (kTile + 1) + c] = pij * (dp - sDelta[c]);
      vis |= 1u << c;
    }
    vis = group_or(vis);  // a key's 8 threads are consecutive lanes of one warp
    __syncwarp();
    for (int c = 0; c < kTile; ++c) {
      if (((vis >> c) & 1u) == 0) continue;  // a masked row's Q and dO are never read
      const float pij = sP[r * (kTile + 1) + c], dsij = sdS[r * (kTile + 1) + c];
#pragma unroll
      for (int cc = 0; cc < kMaxCols; ++cc) {
        const std::int64_t col = g + kLanes * cc;
        if (col < Dv) dv[cc] = fmaf(pij, sdO[c * lay.dv_pitch + col], dv[cc]);
        if (col < D) dk[cc] = fmaf(dsij, sQ[c * lay.d_pitch + col], dk[cc]);
      }
    }
  }

  if (j >= p.len_k) return;
  const std::int64_t dk_row = b * bp.dk_stride[0] + hk * bp.dk_stride[1] + j * bp.dk_stride[2];
  const std::int64_t dv_row = b * bp.dv_stride[0] + hk * bp.dv_stride[1] + j * bp.dv_stride[2];
#pragma unroll
  for (int cc = 0; cc < kMaxCols; ++cc) {
    const std::int64_t col = g + kLanes * cc;
    if (col < D) store_elem(bp.dk, dk_row + col * bp.dk_stride[3], p.scale * dk[cc], bp.grad_out);
    if (col < Dv) store_elem(bp.dv, dv_row + col * bp.dv_stride[3], dv[cc], bp.grad_out);
  }
}

// dQ_i = scale Σ_j dS_ij K_j for 32 rows i of one query head: thread (r, g) owns row q0 + r,
// computes the pairs with keys g + 8u of each key tile, and accumulates columns g + 8c.
template <class T>
__global__ void __launch_bounds__(kThreads) simt_dq_kernel(const backward_params bp) {
  const kernel_params& p = bp.fwd;
  extern __shared__ float s_mem[];
  const simt_bwd_smem lay(p.head_dim, p.head_dim_v);
  float* sQ = s_mem;                       // (kTile, D)   rows of this block
  float* sdO = sQ + kTile * lay.d_pitch;   // (kTile, Dv)
  float* sK = sdO + kTile * lay.dv_pitch;  // (kTile, D)   one key tile
  float* sV = sK + kTile * lay.d_pitch;    // (kTile, Dv)
  float* sdS = sV + kTile * lay.dv_pitch;  // (kTile rows, kTile keys)

  const int r = static_cast<int>(threadIdx.x) / kLanes;
  const int g = static_cast<int>(threadIdx.x) % kLanes;
  const std::int64_t q0 = (std::int64_t(gridDim.x) - 1 - blockIdx.x) * kTile;
  const std::int64_t h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const std::int64_t q1 = q0 + kTile < p.len_q ? q0 + kTile : p.len_q;
  const std::int64_t i = q0 + r;
  const std::int64_t D = p.head_dim, Dv = p.head_dim_v;
  const mask_spec& mask = p.mask;
  const elem in = elem_of<T>();
  const float lse_i = i < p.len_q
                          ? p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]]
                          : -INFINITY;
  const float delta_i = i < p.len_q ? bp.delta[(b * p.heads_q + h) * p.len_q + i] : 0.f;
  const online_softmax<float> row = online_softmax<float>::from_lse(lse_i);

  const T* gK = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
  const T* gV = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];

  float dq[kMaxCols] = {};  // columns g + 8c of dQ_i / scale
  tile_walker<kTile> walker(mask, b, h, q0, q1);
  std::int64_t tile = 0;
  bool tile_full = false;
  bool loaded_q = false;
  while (walker.next(tile, tile_full)) {
    __syncthreads();  // the previous tile's sK, sV, sdS are no longer read
    if (!loaded_q) {
      const T* gQ = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];
      const void* gdO =
          element_at(bp.d_o, b * bp.d_o_stride[0] + h * bp.d_o_stride[1], bp.d_o_elem);
      load_rows<kThreads>(sQ, lay.d_pitch, gQ, in, p.q_stride[2], p.q_stride[3], q0, kTile, D,
                          p.len_q);
      load_rows<kThreads>(sdO, lay.dv_pitch, gdO, bp.d_o_elem, bp.d_o_stride[2], bp.d_o_stride[3],
                          q0, kTile, Dv, p.len_q);
      loaded_q = true;
    }
    const std::int64_t k0 = tile * kTile;
    load_rows<kThreads>(sK, lay.d_pitch, gK, in, p.k_stride[2], p.k_stride[3], k0, kTile, D,
                        walker.key_end);
    load_rows<kThreads>(sV, lay.dv_pitch, gV, in, p.v_stride[2], p.v_stride[3], k0, kTile, Dv,
                        walker.key_end);
    __syncthreads();

    // dS_ij = P_ij (dO_i · V_j - Delta_i), P_ij = exp(S_ij - LSE_i) through the guard.
    std::uint32_t vis = 0;
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) {
      const int c = g + kLanes * u;
      if (!tile_full && !key_visible(mask, b, h, i, k0 + c)) continue;
      const float s = dot_rows(sQ + r * lay.d_pitch, sK + c * lay.d_pitch, D) * p.scale;
      const float pij = row.prob(s);
      const float dp = dot_rows(sdO + r * lay.dv_pitch, sV + c * lay.dv_pitch, Dv);
      sdS[r * (kTile + 1) + c] = pij * (dp - delta_i);
      vis |= 1u << c;
    }
    vis = group_or(vis);  // a row's 8 threads are consecutive lanes of one warp
    __syncwarp();
    for (int c = 0; c < kTile; ++c) {
      if (((vis >> c) & 1u) == 0) continue;  // a masked key's K is never read
      const float dsij = sdS[r * (kTile + 1) + c];
#pragma unroll
      for (int cc = 0; cc < kMaxCols; ++cc) {
        const std::int64_t col = g + kLanes * cc;
        if (col < D) dq[cc] = fmaf(dsij, sK[c * lay.d_pitch + col], dq[cc]);
      }
    }
  }

  if (i >= p.len_q) return;
  const std::int64_t dq_row = b * bp.dq_stride[0] + h * bp.dq_stride[1] + i * bp.dq_stride[2];
#pragma unroll
  for (int cc = 0; cc < kMaxCols; ++cc) {
    const std::int64_t col = g + kLanes * cc;
    if (col < D) store_elem(bp.dq, dq_row + col * bp.dq_stride[3], p.scale * dq[cc], bp.grad_out);
  }
}

template <class T>
cudaError_t launch_simt_bwd(const backward_params& bp, cudaStream_t stream) {
  const kernel_params& p = bp.fwd;
  const std::size_t smem_bytes = simt_bwd_smem(p.head_dim, p.head_dim_v).bytes();
  for (const void* kernel : {reinterpret_cast<const void*>(simt_dkdv_kernel<T>),
                             reinterpret_cast<const void*>(simt_dq_kernel<T>)}) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem_bytes));
    if (e != cudaSuccess) return e;
  }
  if (p.len_k > 0 && p.heads_k > 0 && p.batch > 0) {
    const dim3 grid(static_cast<unsigned>((p.len_k + kTile - 1) / kTile),
                    static_cast<unsigned>(p.heads_k), static_cast<unsigned>(p.batch));
    simt_dkdv_kernel<T><<<grid, kThreads, smem_bytes, stream>>>(bp);
  }
  if (p.len_q > 0 && p.heads_q > 0 && p.batch > 0) {
    const dim3 grid(static_cast<unsigned>((p.len_q + kTile - 1) / kTile),
                    static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
    simt_dq_kernel<T><<<grid, kThreads, smem_bytes, stream>>>(bp);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_backward_delta(const backward_params& bp, elem input, cudaStream_t stream) {
  const std::int64_t rows = bp.fwd.batch * bp.fwd.heads_q * bp.fwd.len_q;
  if (rows == 0) return cudaSuccess;
  const kernel_params& p = bp.fwd;
  if (bp.dq_row_scale != nullptr) {  // fixed-point dQ: the key/value bounds first
    const cudaError_t e = input == elem::f16 ? launch_kv_bounds<__half>(bp, stream)
                                             : launch_kv_bounds<__nv_bfloat16>(bp, stream);
    if (e != cudaSuccess) return e;
  }
  // The 16-byte kernel where the layout allows and its grid stays within 2^31 - 1 blocks.
  const std::int64_t per_block = kDeltaThreads / kDeltaLanes;
  if (p.head_dim_v % 8 == 0 && rows_of_16_bytes(p.o, p.o_stride, p.out) &&
      rows_of_16_bytes(bp.d_o, bp.d_o_stride, bp.d_o_elem) &&
      (rows + per_block - 1) / per_block <= INT32_MAX) {
    switch (p.out) {
      case elem::bf16:
        launch_delta_rows_for<__nv_bfloat16>(bp, rows, stream);
        break;
      case elem::f16:
        launch_delta_rows_for<__half>(bp, rows, stream);
        break;
      case elem::f32:
        launch_delta_rows_for<float>(bp, rows, stream);
        break;
    }
    return cudaGetLastError();
  }
  const unsigned blocks =
      static_cast<unsigned>((rows + kRowsPerDeltaBlock - 1) / kRowsPerDeltaBlock);
  delta_kernel<<<blocks, kRowsPerDeltaBlock * 32, 0, stream>>>(bp);
  return cudaGetLastError();
}

cudaError_t launch_simt_backward(const backward_params& bp, elem input, cudaStream_t stream) {
  switch (input) {
    case elem::bf16:
      return launch_simt_bwd<__nv_bfloat16>(bp, stream);
    case elem::f16:
      return launch_simt_bwd<__half>(bp, stream);
    default:
      return launch_simt_bwd<float>(bp, stream);
  }
}

}  // namespace flashref::cuda::detail
