#pragma once
// The Hopper backward's tiles, barriers and its elementwise steps (SPEC §9), shared by its two
// kernels (hopper_backward.cu):
//
//   dK, dV kernel (key-major): a block owns kBwdKeys keys of one (batch, key/value head), K and
//     V resident in shared memory; its consumer warpgroup c owns keys [64 c, 64 c + 64). Query
//     tiles of kBwdRows rows stream through a ring of stages (Q, dO by TMA; the rows' LSE and
//     Delta by the producer warp):
//         Sᵀ = K Qᵀ, dPᵀ = V dOᵀ                 wgmma m64n64, both operands in shared memory
//         Pᵀ = exp(Sᵀ scale − LSE), dSᵀ = Pᵀ ∘ (dPᵀ − Delta)     probability, score_gradient
//         dV += Pᵀ dO, dK += dSᵀ Q               wgmma m64n{D}, Pᵀ and dSᵀ from registers
//   dQ kernel (query-major, the forward's shape): a block owns kBwdQRows rows, Q and dO
//     resident; key tiles of kBwdQKeysFor<D> keys stream through the ring (K, V by TMA):
//         S = Q Kᵀ, dP = dO Vᵀ                   wgmma m64n64
//         P = exp(S scale − LSE), dS = P ∘ (dP − Delta)          probability, score_gradient
//         dQ += dS K                             wgmma m64n{D}, dS from registers
//
// Every tile is stored as D / 64 boxes of (rows, 64) in the 128-byte swizzle layout (sm90.cuh).

#include <cstdint>
#include <type_traits>

#include "../common.cuh"
#include "../launch.hpp"
#include "sm90.cuh"
#include "tiles.cuh"

namespace flashref::cuda::detail::sm90 {

inline constexpr int kBwdKeys = 128;   // dK, dV kernel: keys per block (two consumers of 64)
inline constexpr int kBwdRows = 64;    // dK, dV kernel: query rows per stage
inline constexpr int kBwdQRows = 128;  // dQ kernel: query rows per block (two consumers of 64)
// dQ kernel: keys per stage. 64 at D = 128 (dQ, S, dP and dS's fragments: 64 + 32 + 32 + 16
// registers), 128 at D = 64, where dQ is half as large: twice the work per stage and per wait,
// the products taking the stage's keys in two halves of 64 (all 128 at once do not fit).
template <int kD>
inline constexpr int kBwdQKeysFor = kD == 64 ? 128 : 64;
inline constexpr int kBwdStages = 3;
// D = 64: the dK, dV kernel's consumers issue the next query tile's Sᵀ and dPᵀ before this
// tile's dV and dK (and dQ) products have completed (hopper_backward.cu, consume_pipelined). At
// D = 128, where dK and dV take twice the registers, that spills (88 bytes with dQ beside them
// and Sᵀ alone ahead, 274 without dQ), so there the next Sᵀ waits for dK's product.
template <int kD>
inline constexpr bool kBwdPipelined = kD == 64;
// Registers per thread after setmaxnreg (the budget must balance, tiles.cuh). The dK, dV kernel's
// consumers take 232 and its producer 40, all the budget allows: at D = 128 they hold dK and dV
// (2 x 64 floats), Sᵀ and dPᵀ (2 x 32) or their A fragments and, with dQ formed beside dK and dV
// (its product and hand-over under theirs), dQ (32 more: at 224 ptxas spills and serialises the
// products); at D = 64 the next tile's Sᵀ and dPᵀ beside dK, dV and dQ (at 224 ptxas spills 8
// bytes). The producer fits 40 once its walker forms the mask blocks without 64-bit division
// (query_tile_walker's kNarrow). The dQ kernel's producer walks key tiles and zero-fills the
// kv_len tail: 64 (it spills at 56), its consumers 216.
template <int kProducer, int kConsumer, int kLaunch = kLaunchRegs, int kC = kConsumers>
struct register_split {
  static constexpr int kProducerRegs = kProducer;
  static constexpr int kConsumerRegs = kConsumer;
  static_assert((kLaunch - kProducer) * 128 >= (kConsumer - kLaunch) * 128 * kC,
                "the consumers take no more registers than the producer gives");
};
using dkdv_registers = register_split<40, 232>;
using dq_registers = register_split<64, 216>;
// The dK, dV kernel of one consumer warpgroup (64 keys a block) runs two blocks per SM (D = 64
// where the walks are short: hopper_backward.cu, "pair blocks"): each starts at 65536 / 512 =
// 128 registers a thread, and its consumer keeps the 232 of the two-consumer block only if its
// producer warp walks in 24.
using dkdv_pair_registers = register_split<24, 232, 128, 1>;

// A (rows, kD) tile as kD / 64 boxes of (rows, 64) 16-bit elements in the 128-byte swizzle.
template <int kRows, int kD>
struct box_tile {
  static constexpr int kBoxBytes = kRows * 128;
  static constexpr int kBytes = (kD / kBoxCols) * kBoxBytes;

  // K-major operand (the head dim is the k dimension): rows [row0, row0 + 64 or n) of the tile,
  // k-step ks (16 columns of the head dim).
  __device__ static std::uint64_t k_major(const unsigned char* base, int row0, int ks) {
    return sw128_advance(sw128_desc(smem_addr(base) + row0 * 128, 16, kAtomBytes),
                         sw128_k_step<kBoxBytes>(ks));
  }
  // MN-major operand (the rows are the k dimension, the head dim the n dimension): rows
  // [16 kk, 16 kk + 16), every column.
  __device__ static std::uint64_t mn_major(const unsigned char* base, int kk) {
    return sw128_advance(sw128_desc(smem_addr(base), kBoxBytes, kAtomBytes), kk * 16 * 128);
  }
};

// What the producer tells the consumers about the tile in a stage: the query tile and its head
// (dK, dV kernel) or the key tile (dQ kernel), and whether every pair in it is visible.
struct alignas(16) bwd_stage_info {
  int tile;  // tile index, or kNoMoreTiles
  int head;  // query head (dK, dV kernel)
  int full;  // 1: no element mask
  int unused;
};

// The barriers of either kernel: `resident` for the tiles loaded once (K and V, or Q and dO),
// full / empty per stage. The dK, dV kernel's stages also carry their rows' LSE (as the
// exponent base, below) and Delta, written by the producer's lanes and read by every consumer
// thread with ordinary loads: there every writing lane arrives on `full` and every reading
// thread on `empty`, so that each thread's own arrival orders its accesses before the other
// side's (one arrival per warp after __syncwarp orders them too, but racecheck follows only a
// thread's own release). The dQ kernel's stages are read through wgmma alone: one arrival by
// the producer, one per consumer warp.
template <int kFullArrivals, int kEmptyArrivals>
struct bwd_barriers {
  std::uint64_t resident;
  std::uint64_t full[kBwdStages];
  std::uint64_t empty[kBwdStages];
  bwd_stage_info info[kBwdStages];

  __device__ void init() {
    mbar_init(&resident, 1);
    for (int s = 0; s < kBwdStages; ++s) {
      mbar_init(&full[s], kFullArrivals);
      mbar_init(&empty[s], kEmptyArrivals);
    }
    mbar_init_fence();
  }

  // The calling consumer thread is done with stage s.
  __device__ void release(int s) {
    // Every thread of the consumer warpgroups (one or two of them: the dK, dV kernel's pair
    // blocks or its two-consumer blocks), or one thread per warp.
    if constexpr (kEmptyArrivals == 128 || kEmptyArrivals == 128 * kConsumers) {
      mbar_arrive(&empty[s]);
    } else {
      static_assert(kEmptyArrivals == 4 * kConsumers, "one arrival per thread or per warp");
      __syncwarp();
      if (threadIdx.x % 32 == 0) mbar_arrive(&empty[s]);
    }
  }
};
template <int kC>
struct dkdv_barriers_t : bwd_barriers<32, 128 * kC> {
  float lse_base[kBwdStages][kBwdRows];  // exp_base(LSE) log2 e of the stage's rows
  float delta[kBwdStages][kBwdRows];
  float dq_scale[kBwdStages][kBwdRows];  // dQ in fixed point: dq_fixed_scale of the stage's rows
};
using dkdv_barriers = dkdv_barriers_t<kConsumers>;
using dq_barriers = bwd_barriers<1, 4 * kConsumers>;

// --- dQ inside the dK, dV kernel (not deterministic) ----------------------------------------
// Without the two products the dQ kernel recomputes, each query tile's dQ = dS K over the block's
// 128 keys is formed where dS is: the consumers store dSᵀ (bf16 / fp16) to shared memory and
// form dS K by wgmma (both operands MN-major), and the tile's 64 x D floats go to float32 sums
// in global memory (backward_params::dq_sums) by bulk reductions of the copy engine, each issued
// by one consumer thread. At D = 128 consumer c takes columns [64 c, 64 c + 64) over all 128
// keys (so the two exchange their dSᵀ) and one reduction adds the tile's chunk; at D = 64 each
// consumer takes all 64 columns over its own 64 keys (no exchange) and adds its own chunk. The
// key tiles of a query tile add in the order they finish, so the sums are not bitwise
// repeatable; a last kernel scales them into dQ. (Key tiles taking turns in a fixed order were
// measured and lost to the dQ pass: cuda/NOTES.md.)

// dQ in fixed point (the default where dQ is formed beside dK and dV): the sums are int32 and
// integer addition is associative, so they are the same bits whatever order the key tiles add
// in. Row i's parts are multiplied by s_i = dq_fixed_scale(bound_i), a power of two, and
// rounded to integers; the last kernel divides by it. The bound holds for every part and every
// sum of the row:
//     |Σ_j dS_ij K_jd| <= max|K| · Σ_j P_ij (|dP_ij| + |Delta_i|)
//                      <= max|K| · (||dO_i|| · max_j ||V_j|| + |Delta_i|)  =: bound_i
// since |dP_ij| = |dO_i · V_j| <= ||dO_i|| ||V_j|| and Σ_j P_ij <= 1 with the forward's LSE
// (max|K| and max||V_j|| over the batch's keys below key_end, per key/value head, found by a
// kernel before Delta; bound_i by the Delta kernel beside Delta_i: simt_backward.cu). So |parts| <
// 2^29 and no sum wraps; each part is rounded to within 2^-29 bound_i, far below the rounding of P
// and dS to the input dtype (cuda/NOTES.md, "b6"). A part that is NaN, inf or 2^30 or more in
// magnitude (non-finite inputs, or an LSE far below the row's log-sum-exp: not the forward's) flags
// its row, and the last kernel writes NaN there, as float32 sums would hold NaN or a value e^(the
// gap) too large.

// Named barriers of the consumer warpgroups (0 is __syncthreads).
inline constexpr int kDsBarrier = 1;     // D = 128: both consumers' dSᵀ stored
inline constexpr int kDqBarrier = 2;     // D = 128: both consumers' halves of the dQ chunk stored
inline constexpr int kKTailBarrier = 3;  // 3 + c: consumer c's zeroed K rows stored
inline constexpr int kOwnDsBarrier = 5;  // D = 64, 5 + c: consumer c's dSᵀ stored
inline constexpr int kOwnDqBarrier = 7;  // D = 64, 7 + c: consumer c's dQ chunk stored

// Whether each consumer forms dQ over its own keys and adds its own chunk (D = 64), or the two
// split the columns of one chunk (D = 128).
template <int kD>
inline constexpr bool kDqOwnKeys = kD == 64;

// One query tile's accumulator chunk: kBwdRows x kD floats in the order the consumers hold
// them, float4 f = (64-column half c, register group g, thread t) at ((c 8 + g) 128 + t), its
// four floats registers 4 g .. 4 g + 3 of that thread's m64n64 accumulator (at D = 64, c = 0:
// each consumer's own chunk has this one layout). The consumers store 16 contiguous bytes per
// thread; dq_chunk_coords maps a float back.
template <int kD>
inline constexpr int kDqChunkFloats = kBwdRows* kD;
__host__ __device__ inline int dq_chunk_float4(int c, int g, int t) {
  return (c * 8 + g) * 128 + t;
}
// Row and column (within the query tile) of float e (0..3) of float4 f of a chunk.
struct dq_coords {
  int row, col;
};
__host__ __device__ inline dq_coords dq_chunk_coords(int f, int e) {
  const int t = f % 128, g = (f / 128) % 8, c = f / (8 * 128);
  return {16 * (t / 32) + (t % 32) / 4 + 8 * (e / 2), 64 * c + 8 * g + 2 * (t % 4) + e % 2};
}

// What the elementwise steps need of query row i: its LSE as the base of its probabilities'
// exponent, pre-multiplied by log2 e, and its Delta. The base is the reference's guard,
// exp_base, so that an empty row's LSE = −inf gives base 0 (never −inf − (−inf)); every pair of
// such a row, and of a row past the end (here (0, 0)), is masked, so its P is 0 by selection.
struct row_terms {
  float base, delta;
};
__device__ __forceinline__ row_terms row_terms_of(const backward_params& bp, std::int64_t b,
                                                  std::int64_t h, std::int64_t i) {
  const kernel_params& p = bp.fwd;
  const bool valid = i < p.len_q;
  const float lse =
      valid ? p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] : 0.f;
  return {valid ? online_softmax<float>::exp_base(lse) * kLog2e : 0.f,
          valid ? bp.delta[(b * p.heads_q + h) * p.len_q + i] : 0.f};
}

// SPEC §9's elementwise steps for one (row, key) pair, in two halves so that the first can run
// while dP is still being computed: P = exp(s scale − LSE) from the raw score s, as one FMA
// s (scale log2 e) − LSE log2 e and one exp2 (scale_log2 = scale · log2 e, formed once), then
// dS = P (dP − Delta). A masked pair gets P = dS = 0 by selection, never by a product (its
// score and dP may come from uninitialised keys).
__device__ __forceinline__ float probability(float s, bool on, float base_log2, float scale_log2) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(fmaf(s, scale_log2, -base_log2)));
  return on ? y : 0.f;
}
__device__ __forceinline__ float score_gradient(float pij, float dp, bool on, float delta) {
  return on ? pij * (dp - delta) : 0.f;
}

// Rows [r0, r0 + kRows) of a (rows, kD) global tile into a box_tile with rows at or past
// row_end zero-filled, by the 32 lanes of a warp with ordinary loads and stores in the layout
// TMA would have written: for the key tile that straddles kv_len, whose keys past it may be
// uninitialised and would meet dS = 0 in a product (0 × NaN).
template <class T, int kRows, int kD>
__device__ void load_rows_zero_tail(unsigned char* dst, const T* g, std::int64_t row_stride,
                                    std::int64_t r0, std::int64_t row_end) {
  constexpr int kChunks = kD / 8;  // 16-byte chunks per row
  for (int idx = static_cast<int>(threadIdx.x % 32); idx < kRows * kChunks; idx += 32) {
    const int row = idx / kChunks;
    const int chunk = idx % kChunks;
    uint4 data = make_uint4(0, 0, 0, 0);
    if (r0 + row < row_end) {
      data = *reinterpret_cast<const uint4*>(g + (r0 + row) * row_stride + chunk * 8);
    }
    const int swizzled = (chunk % 8) ^ (row % 8);
    *reinterpret_cast<uint4*>(dst + (chunk / 8) * box_tile<kRows, kD>::kBoxBytes + row * 128 +
                              swizzled * 16) = data;
  }
}

}  // namespace flashref::cuda::detail::sm90
