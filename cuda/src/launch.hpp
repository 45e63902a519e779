#pragma once
// The boundary between the host wrapper (attention.cpp) and the kernels (*.cu): plain data
// only, no xtensor, includable from both compilers.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "flashref/reference/mask.hpp"

namespace flashref::cuda::detail {

enum class elem : int { f32 = 0, bf16 = 1, f16 = 2 };

// How the Hopper kernels write a tensor's rows from an accumulator fragment (hopper/store.cuh):
// 16-byte pieces of 16-bit elements, 8-byte float pairs, or element by element.
enum class row_store : int { elementwise = 0, packed16 = 1, pairs32 = 2 };

// The widest way a tensor (element type `out`, strides in elements, innermost last) takes whole
// columns: unit column stride and every row's start aligned to the piece (the base pointer and
// the three outer strides). The backward's gradients are judged on the host (backward_params,
// whose kernels hold two accumulators and no register to spare), O in the forward's epilogue.
FLASHREF_INLINE row_store row_store_of(const void* data, const std::int64_t (&stride)[4],
                                       elem out) {
  const bool half = out != elem::f32;
  const std::int64_t bytes = half ? 16 : 8, per = half ? 8 : 2;
  const bool fits = stride[3] == 1 && reinterpret_cast<std::uintptr_t>(data) % bytes == 0 &&
                    stride[0] % per == 0 && stride[1] % per == 0 && stride[2] % per == 0;
  return !fits ? row_store::elementwise : half ? row_store::packed16 : row_store::pairs32;
}

struct kernel_params {
  const void* q;  // (B, Hq, Lq, D)
  const void* k;  // (B, Hk, Lk, D)
  const void* v;  // (B, Hk, Lk, Dv)
  void* o;        // (B, Hq, Lq, Dv)
  float* lse;     // (B, Hq, Lq) or null
  std::int64_t q_stride[4], k_stride[4], v_stride[4], o_stride[4], lse_stride[3];
  std::int64_t batch, heads_q, heads_k, len_q, len_k, head_dim, head_dim_v;
  std::int64_t group;  // query heads per key/value head
  float scale;
  elem out;        // f32, or the input element type
  mask_spec mask;  // block_mask and kv_len point to device memory
  // The SIMT kernel's gate: null, it runs; else it runs only when one of the run_if_count
  // flags (launch_nonfinite_scan's, one per scan block) is non-zero, and returns at once
  // otherwise. The other kernels ignore it.
  const std::uint32_t* run_if = nullptr;
  std::int64_t run_if_count = 0;
};

// A wgmma matrix descriptor of a tile in the 128-byte swizzle layout (hopper/sm90.cuh describes
// the layout and the lbo and sbo of each operand): the start address over 16 in bits 0-13, lbo
// over 16 in bits 16-29, sbo over 16 in bits 32-45, the swizzle mode in bits 62-63.
FLASHREF_INLINE std::uint64_t sw128_desc(std::uint32_t addr, std::uint32_t lbo, std::uint32_t sbo) {
  constexpr std::uint64_t kSwizzle128 = 1;
  return std::uint64_t((addr & 0x3FFFF) >> 4) | (std::uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (std::uint64_t((sbo >> 4) & 0x3FFF) << 32) | (kSwizzle128 << 62);
}
// desc with its start moved `bytes` further (a multiple of 16): sw128_desc(addr + bytes, lbo,
// sbo) for desc = sw128_desc(addr, lbo, sbo), the same bits, as one 32-bit add to the low word.
// The start field (bits 0-13) holds the address over 16, below 2^14 for any address of the
// block's shared memory (under 256 KiB), so the add never carries out of it. Formed this way,
// the descriptors of one tile's k-steps cost an add each from one base instead of the mask,
// shift and or of sw128_desc per product (ptxas cannot fold (addr + bytes) & mask >> 4 into a
// sum: the tile loop issued about 12 integer instructions per wgmma for them).
FLASHREF_INLINE std::uint64_t sw128_advance(std::uint64_t desc, std::uint32_t bytes) {
  const std::uint32_t lo = static_cast<std::uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}
// The bytes from k-step 0 to k-step ks (16 columns of the head dim) of a K-major tile stored as
// boxes of 64 columns, kBoxBytes each: ks / 4 boxes on, then (ks % 4) 32-byte steps along the
// rows inside the box (what sw128_advance takes, for Q and K in the forward and the backward).
template <int kBoxBytes>
FLASHREF_INLINE constexpr std::uint32_t sw128_k_step(int ks) {
  return static_cast<std::uint32_t>((ks / 4) * kBoxBytes + (ks % 4) * 32);
}

// The offsets 8 nb + c (nb < kBlocks, c < 2; bit 2 nb + c) that lie in [lo, hi): the keys (or
// query rows) one thread holds of an accumulator row in the m16n8 layout, relative to its
// first, against the row's interval of visible keys (or the key's of rows). The offsets grow
// with the bit, so those below a bound x form a run of low bits, 2 (x / 8) + min(x % 8, 2) of
// them for 0 < x < 8 kBlocks: a few integer operations per row where a test per offset took
// two 64-bit comparisons (cuda/NOTES.md, h22).
template <int kBlocks>
FLASHREF_INLINE std::uint32_t offsets_below(std::int64_t x) {
  static_assert(kBlocks >= 1 && kBlocks <= 16, "at most 32 offsets");
  // x clamped to [0, 8 kBlocks - 6]: 2 kBlocks offsets lie below that bound already.
  constexpr std::int64_t kTop = 8 * kBlocks - 6;
  const int xi = static_cast<int>(x < 0 ? 0 : x > kTop ? kTop : x);
  const int rem = xi & 7;
  const int n = 2 * (xi >> 3) + (rem < 2 ? rem : 2);  // 0 .. 2 kBlocks
  return n == 0 ? 0u : ~0u >> (32 - n);
}
template <int kBlocks>
FLASHREF_INLINE std::uint32_t offsets_in(std::int64_t lo, std::int64_t hi) {
  return offsets_below<kBlocks>(hi) & ~offsets_below<kBlocks>(lo);
}

// The order of the Hopper forward's work items (hopper/scheduler.cuh): query tiles of every
// (batch, query head), taken by persistent blocks as they free up. The (batch, head) pairs go in
// groups whose K and V fit together in a slice of L2 (kWorkGroupBytes of 16-bit keys and values;
// one pair where a head's alone is more), and within a group the heaviest query tiles come first
// across all of its heads: under a causal mask the last query tile of each head, then the one
// before, and so on. With one head per group, the last items of the launch would be one head's
// tiles from the heaviest down, so that a block drawing that head's heaviest tile near the end
// finishes long after the others (about 6 % of a causal launch at L = 1024 and 4096 in a model
// of the counter's greedy order); across a group the tail is made of the lightest tiles.
inline constexpr std::int64_t kWorkGroupBytes = std::int64_t(8) << 20;

// (batch, query head) pairs per group for p: at least 1, at most all of them.
FLASHREF_INLINE std::int64_t work_group_heads(const kernel_params& p) {
  const std::int64_t per_head = 4 * p.len_k * p.head_dim;  // K and V of one head, 2 bytes each
  const std::int64_t pairs = p.batch * p.heads_q;
  const std::int64_t g = per_head > 0 ? kWorkGroupBytes / per_head : pairs;
  return g < 1 ? 1 : g > pairs ? pairs : g;
}

// Work item `work` (0 <= work < tiles_q * pairs) of a problem with tiles_q query tiles per
// head, `pairs` (batch, query head) pairs and `group` pairs per group (work_group_heads(p), or
// 1 for one head after another, as hopper.cu passes where the items are not graded): its pair
// b * heads_q + h and its query tile, tiles_q - 1 being the last (under a causal mask, the
// heaviest). I is int on the device (the host checks that the items number below 2^31).
template <class I>
struct work_place {
  I pair;
  I tile;
};
template <class I>
FLASHREF_INLINE work_place<I> work_place_of(I work, I tiles_q, I pairs, I group) {
  const I first = work / (group * tiles_q) * group;  // the group's first pair
  const I size = pairs - first < group ? pairs - first : group;
  const I r = work - first * tiles_q;  // rank in the group: the tile's rank, then the pair
  const I rank = r / size;
  return {first + (r - rank * size), tiles_q - 1 - rank};
}

// Tensor-core kernels: input bf16 or f16, head_dim == head_dim_v in {64, 128}, unit stride in
// the last dimension and 16-byte aligned rows (checked by the caller).
cudaError_t launch_tensor_core(const kernel_params& p, elem input, cudaStream_t stream);

// The Hopper kernel (sm_90a: wgmma, TMA, warp specialisation): the same problems as
// launch_tensor_core, on a device of compute capability 9.0 only. Persistent, on at most
// sm_count blocks; `work_counter` (4 bytes of device memory, zeroed on the stream here) lets
// blocks take work items as they free up, null gives each block a fixed stride of them.
// `nonfinite_flags`: null, or hopper_flag_count(p, sm_count) words of device memory, every one
// written: 1 where a consumer warp stored a NaN or inf in O (or met one in its row sums), else 0
// — the gate of a SIMT rerun that keeps SPEC §2's rule for a non-finite V without a scan of V.
cudaError_t launch_hopper(const kernel_params& p, elem input, std::uint32_t* work_counter,
                          std::uint32_t* nonfinite_flags, int sm_count, cudaStream_t stream);
std::int64_t hopper_flag_count(const kernel_params& p, int sm_count);
// Query rows per work item of the Hopper kernel for p (128, or 192 for D = 64's three consumers).
std::int64_t hopper_tile_rows(const kernel_params& p);

// The float32-accumulating SIMT kernel: any strides, head dims up to kSimtMaxHeadDim. Gated
// (p.run_if set), it runs on a grid of one wave whose blocks walk the query tiles, so that the
// launch costs one wave of early returns when the gate is closed.
inline constexpr std::int64_t kSimtMaxHeadDim = 256;
cudaError_t launch_simt(const kernel_params& p, elem input, cudaStream_t stream);

// The scan of V for NaN and inf: V (p.v, p.v_stride) in bf16 or f16 with the tensor-core
// layout (unit stride along Dv, Dv a multiple of 8, 16-byte aligned rows). Block k of the grid
// writes flags[k] = 1 when it found a non-finite element, else 0; every flag is written.
dim3 nonfinite_scan_grid(const kernel_params& p, int sm_count);
cudaError_t launch_nonfinite_scan(const kernel_params& p, elem input, dim3 grid,
                                  std::uint32_t* flags, cudaStream_t stream);

// dst[i] = (bf16 or f16) src[i] on the device.
cudaError_t launch_convert(const float* src, void* dst, std::int64_t n, elem to,
                           cudaStream_t stream);

// --- the backward pass (SPEC §9)

// fwd carries q, k, v and the forward's o (element type fwd.out) and lse (read, never
// written), the shapes, the scale and the mask; the rest are the backward's own tensors.
struct backward_params {
  kernel_params fwd;
  const void* d_o;  // (B, Hq, Lq, Dv) upstream gradient, element type d_o_elem
  elem d_o_elem;
  void* dq;       // (B, Hq, Lq, D)  element type grad_out
  void* dk;       // (B, Hk, Lk, D)
  void* dv;       // (B, Hk, Lk, Dv)
  elem grad_out;  // f32, or the input element type
  std::int64_t d_o_stride[4], dq_stride[4], dk_stride[4], dv_stride[4];
  float* delta;  // (B, Hq, Lq) contiguous workspace: Delta = rowsum(dO ∘ O)
  row_store dq_store = row_store::elementwise;  // row_store_of each gradient
  row_store dk_store = row_store::elementwise;
  row_store dv_store = row_store::elementwise;
  // Non-null: the Hopper backward (D = 64, 128) forms dQ inside its dK, dV kernel and adds each
  // key tile's part to these sums, in whatever order the key tiles finish, then scales them into
  // dq; hopper_dq_sums_bytes of workspace after Delta, zeroed by the launch. Float32 sums
  // (dq_row_scale null) are not bitwise repeatable; fixed-point ones are (below).
  void* dq_sums = nullptr;
  // Non-null with dq_sums: the sums are fixed point, int32 (hopper/backward.cuh, "dQ in fixed
  // point"): row i's parts times dq_row_scale[i], a power of two chosen from a bound on |dQ_i|
  // so that no sum leaves 2^30, rounded to integers whose additions give the same bits in any
  // order. Each of the three arrays below lies in the workspace, filled by
  // launch_backward_delta (the flags then raised by the Hopper kernel).
  float* dq_row_scale = nullptr;          // (B, Hq, Lq)
  std::uint32_t* dq_row_flags = nullptr;  // (B, Hq, Lq): 1 where a part was NaN, inf or too large
  std::uint32_t* kv_bounds = nullptr;     // (B, Hk, 2): max |K|, max ||V_j||^2 as float bits
};

// The Hopper backward's dQ sums for (B, Hq, Lq) queries of head dim d, in bytes: one chunk of
// 64 rows x d float32 or int32 per query tile (0 where its dQ has a pass of its own).
inline constexpr std::int64_t kHopperDqRows = 64;
inline std::size_t hopper_dq_sums_bytes(std::int64_t batch, std::int64_t heads_q,
                                        std::int64_t len_q, std::int64_t head_dim) {
  if (head_dim != 64 && head_dim != 128) return 0;
  const std::int64_t tiles = (len_q + kHopperDqRows - 1) / kHopperDqRows;
  return std::size_t(batch * heads_q * tiles * kHopperDqRows * head_dim) * sizeof(float);
}

// The (query, key) pairs of one head that causal and the window leave visible (mask_spec's
// row_range summed over the len_q rows; kv_len and a block mask aside), in closed form: row i
// sees [max(0, i + b), min(len_k, i + a)), where a is the nearest right bound's offset (causal
// at the diagonal, window_right past it) and b the window's left one, both along the bottom-right
// diagonal i + len_k - len_q; between the rows where a bound meets 0 or len_k the count is
// linear in i, and each piece's sum is that of an arithmetic series. The host's rule for the
// Hopper backward's fixed-point dQ weighs it per row (backward.cpp).
inline std::int64_t visible_pairs(std::int64_t len_q, std::int64_t len_k, causal_mode causal,
                                  std::int64_t window_left, std::int64_t window_right) {
  const std::int64_t diag = len_k - len_q, far = len_q + len_k;  // a wider window bounds nothing
  bool right = false, left = window_left >= 0;
  std::int64_t a = 0;
  const auto bound_right = [&](std::int64_t offset) {
    a = right && a < offset ? a : offset;
    right = true;
  };
  if (causal == causal_mode::bottom_right) bound_right(diag + 1);
  if (causal == causal_mode::top_left) bound_right(1);
  if (window_right >= 0) bound_right(diag + (window_right < far ? window_right : far) + 1);
  const std::int64_t b = left ? diag - (window_left < far ? window_left : far) : 0;
  // The rows where the count's form changes, within [0, len_q].
  std::int64_t cut[4] = {0, len_q, len_q, len_q};
  const auto clamp = [&](std::int64_t i) { return i < 0 ? 0 : i > len_q ? len_q : i; };
  if (right) cut[2] = clamp(len_k - a);
  if (left) cut[3] = clamp(-b);
  std::sort(cut, cut + 4);
  std::int64_t pairs = 0;
  for (int x = 0; x + 1 < 4; ++x) {
    std::int64_t s = cut[x], e = cut[x + 1];
    if (e <= s) continue;
    // On [s, e) the count is max(0, p + q i): the right end i + a or len_k, less the left end
    // i + b or 0.
    const bool right_moves = right && s < len_k - a, left_moves = left && s >= -b;
    const std::int64_t p = (right_moves ? a : len_k) - (left_moves ? b : 0);
    const int q = int(right_moves) - int(left_moves);
    if (q > 0 && s < 1 - p) s = 1 - p;  // p + i > 0 from i = 1 - p
    if (q < 0 && e > p) e = p;          // p - i > 0 below i = p
    if (e <= s || (q == 0 && p <= 0)) continue;
    const std::int64_t n = e - s;
    pairs += n * p + q * ((s + e - 1) * n / 2);  // (s + e - 1) n is even
  }
  return pairs;
}

// dQ in fixed point (backward_params::dq_row_scale): the scale of row i's parts, 2^(29 - e) for
// a bound on their magnitude below 2^e, so that every part and every sum of the row stays below
// 2^29 (half of the 2^30 at which a part is flagged: the margin covers the rounding of P and dS
// to the input dtype and of the bound itself); 1 for a zero bound (every part is then exactly
// 0); 0 for a bound that is not finite (the row is flagged). The shift stops at 2^127.
FLASHREF_INLINE float dq_fixed_scale(float bound) {
  if (!(bound <= 3.4028234663852886e38f)) return 0.f;  // inf or NaN
  if (bound == 0.f) return 1.f;
  int e = 0;
  (void)frexpf(bound, &e);  // bound = f 2^e, f in [0.5, 1)
  return ldexpf(1.f, 29 - e < 127 ? 29 - e : 127);
}

// Delta = rowsum(dO ∘ O) into p.delta: every backward runs it first. With fixed-point dQ
// (p.dq_row_scale set: the Hopper backward, bf16 or fp16 `input` in 16-byte rows) it first finds
// the key/value bounds, then writes each row's scale and flag beside Delta.
cudaError_t launch_backward_delta(const backward_params& p, elem input, cudaStream_t stream);

// The tensor-core backward (the same problems as launch_tensor_core, and dO in the input element
// type with the same layout rule): dK, dV per key tile, then dQ by its own pass.
cudaError_t launch_tensor_core_backward(const backward_params& p, elem input, cudaStream_t stream);

// The Hopper backward (sm_90a: wgmma, TMA, warp specialisation): the same problems as
// launch_tensor_core_backward, on a device of compute capability 9.0 only.
cudaError_t launch_hopper_backward(const backward_params& p, elem input, cudaStream_t stream);

// The float32 SIMT backward: any strides, head dims up to kSimtMaxHeadDim, any dtypes.
cudaError_t launch_simt_backward(const backward_params& p, elem input, cudaStream_t stream);

}  // namespace flashref::cuda::detail
