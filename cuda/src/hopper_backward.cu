// The Hopper backward (sm_90a; bf16 / fp16 inputs, fp32 accumulation): SPEC §9 on the forward's
// machinery (TMA, mbarrier rings, wgmma, setmaxnreg), in two kernels that each own what they
// write, so that every sum has one fixed order (bitwise deterministic, no floating-point atomics):
//
//  - dK, dV: a block of three warpgroups per 128 keys of one (batch, key/value head). The
//    producer warp loads K and V once and walks the query heads of the GQA group and, for each,
//    only the query tiles that see the block's keys (query_tile_walker), loading Q and dO by TMA
//    and the rows' LSE and Delta into a ring of stages; each consumer warpgroup holds dK and dV
//    of its 64 keys in registers (hopper/backward.cuh has the products). At D = 64 where the
//    walks are short (a block mask, or few keys) the same pass runs as "pair blocks": one
//    consumer warpgroup per 64 keys, two blocks per SM (dkdv_pass_t's kC, launch below).
//  - dQ: a block per 128 query rows of one (batch, head), the forward's structure: Q and dO
//    loaded once, the key tiles the rows see (tile_walker) streaming K and V.
//
// A key tile no row sees writes dK = dV = 0 and a query tile with no visible key dQ = 0, without
// waiting for anything to load. The mma.sync backward (tensor_core_backward.cu) takes the same
// problems on other GPUs.
//
// Where rows see enough keys (D = 64 and 128; backward.cpp's rule) the dK, dV kernel also forms
// each query tile's dQ = dS K beside dK and dV, two products fewer than the dQ kernel's, and
// adds it by bulk reductions in whatever order its blocks finish, then a small kernel scales the
// sums into dQ. By default the sums are fixed point (int32; hopper/backward.cuh, "dQ in fixed
// point"): integer additions in any order give the same bits, so dQ stays bitwise deterministic
// without a fixed order. Opt-in (device_backward_problem::deterministic = false): float32 sums,
// faster by the conversion, not bitwise repeatable.
//
// The instructions are sm_90a only: other targets compile empty kernels that the dispatcher
// never launches.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "hopper/backward.cuh"
#include "hopper/mask.cuh"
#include "hopper/sm90.cuh"
#include "hopper/store.cuh"
#include "hopper/tensor_map.hpp"
#include "hopper/tiles.cuh"
#include "hopper/wgmma.cuh"
#include "launch.hpp"

namespace flashref::cuda::detail {
namespace {

using namespace sm90;

struct bwd_maps {
  CUtensorMap q, d_o, k, v;
};

struct hopper_bwd_params {
  bwd_maps maps;
  backward_params bp;
};

// acc (64, kD) += A (64 x 16 kK, kK k-steps of fragments) B (the 16 kK rows of an MN-major tile).
template <class T, int kRows, int kD, int kK>
__device__ __forceinline__ void product_rs(float (&acc)[kD / 2], const std::uint32_t (&a)[kK][4],
                                           const unsigned char* b) {
#pragma unroll
  for (int kk = 0; kk < kK; ++kk) {
    if constexpr (kD == 64) {
      wgmma_rs_n64<T>(acc, a[kk], box_tile<kRows, kD>::mn_major(b, kk));
    } else {
      wgmma_rs_n128<T>(acc, a[kk], box_tile<kRows, kD>::mn_major(b, kk));
    }
  }
}

// acc (64, kN) = A (64 rows of a K-major tile from a_row0) B^T (kN rows of a kBRows-row
// K-major tile from b_row0; kN 64 or 128).
template <class T, int kARows, int kBRows, int kN, int kD>
__device__ __forceinline__ void product_ss(float (&acc)[kN / 2], const unsigned char* a, int a_row0,
                                           const unsigned char* b, int b_row0 = 0) {
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    const std::uint64_t da = box_tile<kARows, kD>::k_major(a, a_row0, ks);
    const std::uint64_t db = box_tile<kBRows, kD>::k_major(b, b_row0, ks);
    if constexpr (kN == 64) {
      wgmma_ss_n64<T>(acc, da, db, ks > 0 ? 1 : 0);
    } else {
      static_assert(kN == 128, "64 or 128 columns");
      wgmma_ss_n128<T>(acc, da, db, ks > 0 ? 1 : 0);
    }
  }
}

// Stores this thread's share of a (64, kD) accumulator as rows row0 + [0, 64) of a gradient:
// element 4 n8 + e is row 16 warp + lane / 4 + 8 (e / 2), column 8 n8 + 2 (lane % 4) + e % 2.
// `how` (launch.hpp's row_store_of): 16-byte stores of whole columns where the rows allow
// (store.cuh), else element by element.
template <class T, int kD>
__device__ void store_gradient(void* g, const std::int64_t* stride, elem out, row_store how,
                               std::int64_t b, std::int64_t h, std::int64_t row0,
                               std::int64_t row_end, const float (&acc)[kD / 2], float factor) {
  const int t = static_cast<int>(threadIdx.x % 128);
  const std::int64_t r_a = row0 + (t / 32) * 16 + (t % 32) / 4;
  if (how != row_store::elementwise) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const std::int64_t row = r_a + 8 * r;
      const std::int64_t base = b * stride[0] + h * stride[1] + row * stride[2];
      store_fragment_row<T>(g, base, stride[3], out, how, row < row_end, acc, r, factor);
    }
    return;
  }
  // Element by element, written out here rather than through store_fragment_row's own
  // element-wise branch: with that one the dK, dV kernel at D = 128 spills 4 bytes (ptxas).
  const int c0 = 2 * (t % 4);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::int64_t row = r_a + 8 * r;
    if (row >= row_end) continue;
    const std::int64_t base = b * stride[0] + h * stride[1] + row * stride[2];
#pragma unroll
    for (int nb = 0; nb < kD / 8; ++nb) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        store_out<T>(g, base + (8 * nb + c0 + c) * stride[3], factor * acc[4 * nb + 2 * r + c],
                     out);
      }
    }
  }
}

// Shared memory of either pass: two resident tiles of kResident rows, then kBwdStages stages
// of two tiles of kStaged rows, atom-aligned.
template <int kResident, int kStaged, int kD>
struct bwd_layout {
  using resident_tile = box_tile<kResident, kD>;
  using staged_tile = box_tile<kStaged, kD>;
  static constexpr int kSmemBytes =
      2 * resident_tile::kBytes + 2 * kBwdStages * staged_tile::kBytes + kAtomBytes;
  unsigned char* resident[2];
  unsigned char* staged[2];  // stage 0 of each staged tile

  __device__ explicit bwd_layout(unsigned char* raw) {
    const std::uint32_t base = smem_addr(raw);
    resident[0] = raw + ((kAtomBytes - base % kAtomBytes) % kAtomBytes);
    resident[1] = resident[0] + resident_tile::kBytes;
    staged[0] = resident[1] + resident_tile::kBytes;
    staged[1] = staged[0] + kBwdStages * staged_tile::kBytes;
  }
  // Staged tile `which` of stage s.
  __device__ unsigned char* stage(int which, int s) const {
    return staged[which] + s * staged_tile::kBytes;
  }
  // TMA loads of the two resident tiles, or of stage s's two tiles (map0 null: tile 0 is not
  // loaded), rows [row, row + the tile's rows) of head h, batch b, box by box.
  __device__ void load_resident(const CUtensorMap* map0, const CUtensorMap* map1, int row, int h,
                                int b, std::uint64_t* bar) const {
    load_pair<resident_tile::kBoxBytes>(resident[0], resident[1], map0, map1, row, h, b, bar);
  }
  __device__ void load_stage(int s, const CUtensorMap* map0, const CUtensorMap* map1, int row,
                             int h, int b, std::uint64_t* bar) const {
    load_pair<staged_tile::kBoxBytes>(stage(0, s), stage(1, s), map0, map1, row, h, b, bar);
  }

 private:
  template <int kBoxBytes>
  __device__ static void load_pair(unsigned char* dst0, unsigned char* dst1,
                                   const CUtensorMap* map0, const CUtensorMap* map1, int row, int h,
                                   int b, std::uint64_t* bar) {
    for (int c = 0; c < kD / kBoxCols; ++c) {
      if (map0 != nullptr) tma_load_4d(dst0 + c * kBoxBytes, map0, c * kBoxCols, row, h, b, bar);
      tma_load_4d(dst1 + c * kBoxBytes, map1, c * kBoxCols, row, h, b, bar);
    }
  }
};

// --- dK, dV ------------------------------------------------------------------------------------

// Resident K (tile 0) and V (tile 1) of the block's kKeys keys (64 per consumer); stages of Q
// (tile 0) and dO (tile 1).
template <int kD, int kKeys = kBwdKeys>
using dkdv_layout = bwd_layout<kKeys, kBwdRows, kD>;

// With dQ: a buffer of dSᵀ (the block's keys x 64 query columns, a box) and the chunk of dQ the
// copy engine adds to the sums in global memory (kDqChunkFloats floats; at D = 64 one per
// consumer), past the last stage of dO: 209 KiB in all at D = 128 with 3 stages. One dSᵀ buffer
// suffices: a consumer stores the next tile's dSᵀ only after the hand-over of this tile's chunk,
// which each consumer reaches after its own dS K product has completed (at D = 128 both meet there,
// kDqBarrier; at D = 64 each reads only its own rows).
template <int kD, int kC = kConsumers>
struct dkdvq_layout : dkdv_layout<kD, 64 * kC> {
  using base = dkdv_layout<kD, 64 * kC>;
  using ds_tile = box_tile<64 * kC, kBwdRows>;
  static constexpr int kChunks = kDqOwnKeys<kD> ? kC : 1;
  static constexpr int kSmemBytes =
      base::kSmemBytes + ds_tile::kBytes + kChunks * kDqChunkFloats<kD> * 4;
  __device__ unsigned char* ds() const { return this->stage(1, kBwdStages); }
  // Chunk c (0 at D = 128).
  __device__ float* dq(int c) const {
    return reinterpret_cast<float*>(this->stage(1, kBwdStages) + ds_tile::kBytes) +
           c * kDqChunkFloats<kD>;
  }

  __device__ explicit dkdvq_layout(unsigned char* raw) : base(raw) {}
};

// dSᵀ of this consumer's 64 keys (adS: its A fragments, the accumulator's pairs of query
// columns) into rows key_row0 + [0, 64) of a (128 keys, 64 queries) box in the 128-byte
// swizzle: the MN-major A operand of dQ = dS K. Register [kk][j] holds row 16 warp + lane / 4 +
// 8 (j % 2), columns 16 kk + 8 (j / 2) + 2 (lane % 4) + {0, 1}: one 4-byte store, the 32 lanes
// on 32 different banks.
// (A template, as the products are: the targets other than sm_90a compile none of its callers.)
template <class T>
__device__ __forceinline__ void store_ds(unsigned char* ds, int key_row0,
                                         const std::uint32_t (&adS)[4][4]) {
  // The lane and warp read here, not hoisted: otherwise the compiler keeps the 16 addresses
  // (loop-invariant) in registers across the consumer's loop and spills.
  const unsigned lane = read_lane(), warp = (read_tid() % 128) / 32;
  const int row_a = key_row0 + static_cast<int>(warp) * 16 + static_cast<int>(lane) / 4;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = row_a + 8 * (j % 2);
      const int chunk = (2 * kk + j / 2) ^ static_cast<int>(lane / 4);  // row % 8 == lane / 4
      const std::uint32_t addr = smem_addr(ds + row * 128 + chunk * 16 + (lane % 4) * 4);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(adS[kk][j]) : "memory");
    }
  }
}

// For consumer c, both operands MN-major: at D = 128, acc (64 queries, columns [64 c, 64 c +
// 64)) = dS (64 x 128 keys, from the dSᵀ box) K (the resident 128 keys, box c of the head dim);
// at D = 64, acc (64 queries, 64 columns) = dS K over the consumer's own keys [64 c, 64 c + 64).
template <class T, int kD, int kKeys>
__device__ __forceinline__ void product_dq(float (&acc)[32], const unsigned char* ds,
                                           const unsigned char* k) {
  using ds_tile = box_tile<kKeys, kBwdRows>;
  using k_tile = box_tile<kKeys, kD>;
  // The consumer (warpgroup - 1) read in place: its 8 descriptors of K's box are then formed
  // here, not kept (and spilled) across the consumer's loop.
  const int c = static_cast<int>(read_tid() / 128) - 1;
  if constexpr (kDqOwnKeys<kD>) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      wgmma_ss_n64_mn<T>(acc, ds_tile::mn_major(ds, 4 * c + kk), k_tile::mn_major(k, 4 * c + kk),
                         kk > 0 ? 1 : 0);
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      wgmma_ss_n64_mn<T>(acc, ds_tile::mn_major(ds, kk),
                         k_tile::mn_major(k + c * k_tile::kBoxBytes, kk), kk > 0 ? 1 : 0);
    }
  }
}

// How the dK, dV kernel treats dQ: not at all (dQ has its own pass), or formed beside dK and
// dV and added to float32 sums (not bitwise repeatable) or to fixed-point ones (backward.cuh).
enum class dq_sums { none, float32, fixed };

// The dK, dV pass, with dQ folded in (kDq) or not: its barriers, register split and
// layout, the producer warp and a consumer warpgroup (with kDq also adding dQ), as the kernel
// template below takes them. kC consumer warpgroups of 64 keys each: two (128 keys, one block
// per SM), or one ("pair blocks": 64 keys, two blocks per SM, so that one block's start and
// end, which nothing inside a block overlaps, run beside the other's products; D = 64 where the
// walks are short: launch below, cuda/NOTES.md, "b14").
template <dq_sums kSums, int kC = kConsumers>
struct dkdv_pass_t {
  static_assert(kC == 1 || kC == 2, "one or two consumer warpgroups");
  static constexpr bool kDq = kSums != dq_sums::none;
  static constexpr bool kFixed = kSums == dq_sums::fixed;
  static constexpr int kKeys = 64 * kC;  // keys per block
  static constexpr int kThreads = 128 * (1 + kC);
  static constexpr int kMinBlocks = kC == 1 ? 2 : 1;  // blocks per SM
  using barriers = dkdv_barriers_t<kC>;
  template <int kD>
  using registers = std::conditional_t<kC == 2, dkdv_registers, dkdv_pair_registers>;
  template <int kD>
  using layout = std::conditional_t<kDq, dkdvq_layout<kD, kC>, dkdv_layout<kD, kKeys>>;

  template <class T, int kD>
  __device__ static void produce(const hopper_bwd_params& hp, const layout<kD>& smem,
                                 barriers& bar) {
    using L = layout<kD>;
    const backward_params& bp = hp.bp;
    const kernel_params& p = bp.fwd;
    const bool leader = threadIdx.x % 32 == 0;
    const int lane = static_cast<int>(threadIdx.x % 32);
    const int k0 = static_cast<int>(blockIdx.x) * kKeys;
    const int hk = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
    const std::int64_t k1 = k0 + kKeys < p.len_k ? k0 + kKeys : p.len_k;
    query_tile_walker<kBwdRows, true> walker(p.mask, b, hk * p.group, (hk + 1) * p.group, k0, k1);
    // The walk's next (head, tile) and whether every pair of the tile is visible. The pair
    // blocks' producer warp (24 registers) keeps that flag in bit 0 of `tile` (2 tile + full):
    // as a register of its own it spilled; the two-consumer producer (40) keeps both apart (the
    // packed form made ptxas spill there instead).
    std::int64_t h = 0, tile = 0;
    bool full = false;
    const auto next = [&] {
      if constexpr (kC == 1) {
        std::int64_t t = 0;
        bool f = false;
        const bool more = walker.next(h, t, f);
        tile = 2 * t + (f ? 1 : 0);
        return more;
      } else {
        return walker.next(h, tile, full);
      }
    };
    bool have = next();
    if (have && leader) {
      mbar_arrive_expect_tx(&bar.resident, 2 * L::resident_tile::kBytes);
      smem.load_resident(&hp.maps.k, &hp.maps.v, k0, hk, b, &bar.resident);
    }
    for (int it = 0;; ++it) {
      const int s = it % kBwdStages;
      mbar_wait(&bar.empty[s], ((it / kBwdStages) & 1) ^ 1);  // the consumers released stage s
      if (!have) {  // every lane arrives (full counts 32); lane 0 wrote the descriptor first
        if (leader) bar.info[s] = {kNoMoreTiles, 0, 0, 0};
        mbar_arrive(&bar.full[s]);
        return;
      }
      const int tile_q = static_cast<int>(kC == 1 ? tile >> 1 : tile), q0 = tile_q * kBwdRows;
      for (int r = lane; r < kBwdRows; r += 32) {
        const row_terms row = row_terms_of(bp, b, h, q0 + r);
        bar.lse_base[s][r] = row.base;
        bar.delta[s][r] = row.delta;
        if constexpr (kFixed) {
          bar.dq_scale[s][r] =
              q0 + r < p.len_q ? bp.dq_row_scale[(b * p.heads_q + h) * p.len_q + q0 + r] : 0.f;
        }
      }
      // Each lane's arrival releases its own stores; lane 0's also announces the TMA bytes.
      if (leader) {
        // A block running past the last key holds keys that do not exist: element-mask every
        // tile (the test formed here from the parameters: kept across the loop, the pair
        // blocks' producer spilled it).
        const bool keys_past_end = int(blockIdx.x) * kKeys + kKeys > p.len_k;
        const bool tile_full = kC == 1 ? (tile & 1) != 0 : full;
        bar.info[s] = {tile_q, int(h), tile_full && !keys_past_end ? 1 : 0, 0};
        mbar_arrive_expect_tx(&bar.full[s], 2 * L::staged_tile::kBytes);
        smem.load_stage(s, &hp.maps.q, &hp.maps.d_o, q0, int(h), b, &bar.full[s]);
      } else {
        mbar_arrive(&bar.full[s]);
      }
      have = next();
    }
  }

  template <class T, int kD>
  __device__ static void consume(const hopper_bwd_params& hp, int consumer, const layout<kD>& smem,
                                 barriers& bar) {
    const backward_params& bp = hp.bp;
    const kernel_params& p = bp.fwd;
    const int t = static_cast<int>(threadIdx.x % 128);
    const int key_row0 = consumer * 64;  // this warpgroup's keys in the block
    const int col0 = 2 * (t % 4);        // this thread's query columns: i0 + 8 nb + c
    float rdK[kD / 2] = {};              // (64 keys, kD): dK / scale
    float rdV[kD / 2] = {};
    // This thread's keys (rows of Sᵀ): key_a and key_a + 8, in 32 bits (TMA coordinates are
    // 32-bit): the loop holds dK, dV, Sᵀ and dPᵀ, and 64-bit copies took the consumers past
    // their registers.
    const auto key_of = [](const block_ids& ids) {
      const int c = static_cast<int>(ids.tid / 128) - 1, u = static_cast<int>(ids.tid % 128);
      return static_cast<int>(ids.x) * kKeys + c * 64 + (u / 32) * 16 + (u % 32) / 4;
    };
    const int key_a =
        static_cast<int>(blockIdx.x) * kKeys + key_row0 + (t / 32) * 16 + (t % 32) / 4;
    // The rows that see each of the two keys (mask_spec::query_range: causal, window, kv_len;
    // the same for every head), formed once and kept in shared memory, where each partial tile
    // reads them (in registers, or formed per tile, they cost the consumers spills). Rows are
    // below 2^31 (TMA coordinates), so each end fits 32 bits once clamped to [0, len_q]. Each
    // consumer thread writes and reads only its own slot: no barrier.
    __shared__ std::int32_t key_rows[kC * 128][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const key_range q = p.mask.query_range(blockIdx.z, key_a + 8 * r);
      const auto clamp = [&](std::int64_t x) {
        return static_cast<std::int32_t>(x < 0 ? 0 : x > p.len_q ? p.len_q : x);
      };
      key_rows[threadIdx.x - 128][2 * r] = clamp(q.lo);
      key_rows[threadIdx.x - 128][2 * r + 1] = clamp(q.hi);
    }

    if constexpr (kBwdPipelined<kD>) {
      // With dQ the key is formed afresh (kept across the loop there, it spilled); without,
      // the kept key_a.
      if constexpr (kDq) {
        consume_pipelined<T, kD>(hp, consumer, smem, bar, key_rows, key_of, rdK, rdV);
      } else {
        consume_pipelined<T, kD>(
            hp, consumer, smem, bar, key_rows, [&](const block_ids&) { return key_a; }, rdK, rdV);
      }
    } else {
      int it = 0;
      for (;; ++it) {
        const int s = it % kBwdStages;
        mbar_wait(&bar.full[s], (it / kBwdStages) & 1);
        const bwd_stage_info info = read_stage_slot(bar.info[s]);
        if (info.tile == kNoMoreTiles) break;
        if (it == 0) {
          mbar_wait(&bar.resident, 0);
          if constexpr (kDq) zero_k_tail<kD>(hp, smem, consumer);
        }
        const unsigned char* sQ = smem.stage(0, s);
        const unsigned char* sdO = smem.stage(1, s);

        // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, issued together; Sᵀ is waited for first.
        float rS[32], rdP[32];
        wgmma_fence();
        product_ss<T, kKeys, kBwdRows, kBwdRows, kD>(rS, smem.resident[0], key_row0, sQ);
        wgmma_commit();
        product_ss<T, kKeys, kBwdRows, kBwdRows, kD>(rdP, smem.resident[1], key_row0, sdO);
        wgmma_commit();

        // With dQ the key is formed afresh (kept across the loop there, it spilled); without,
        // the kept key_a (formed afresh there, it spilled).
        std::uint32_t aP[4][4], adS[4][4];
        tile_gradients<T>(p, bar, s, info, key_rows, col0, rS, rdP, aP, adS,
                          [&](const block_ids& ids) { return kDq ? key_of(ids) : key_a; });
        if constexpr (kDq) {
          // D = 128 (D = 64 takes consume_pipelined): dQ's product first, over both consumers'
          // dSᵀ, then dV, dK behind it: dQ's hand-over (in fixed point its conversion) runs while
          // they do, and the stage is released once all three have completed. +1 to +6 % in fixed
          // point and +5 to +10 % in float32 (cuda/NOTES.md "b8"), where it holds dQ beside dK,
          // dV, Pᵀ and dSᵀ and needs the consumers' 232 registers (dkdv_registers). dSᵀ for
          // dQ = dS K is stored before the fragments go to wgmma.
          float rdQ[32];
          issue_dq_dv_dk<T, kD>(smem, key_row0, it, consumer, t, aP, adS, sQ, sdO, rdQ, rdV, rdK);
          wgmma_wait<1>();
          fence_operands(rdQ);
          add_dq<kD>(hp, smem, consumer, bar.info[s], bar.dq_scale[s], rdQ);
          wgmma_wait<0>();
          release_after_dv_dk(bar, s, aP, adS, rdV, rdK);
          continue;
        }
        // dV += Pᵀ dO, dK += dSᵀ Q.
        wgmma_fence();
        issue_dv_dk<T, kD>(aP, adS, sQ, sdO, rdV, rdK);
        wgmma_wait<0>();
        release_after_dv_dk(bar, s, aP, adS, rdV, rdK);
      }
    }
    if constexpr (kDq) {  // every addition performed before the block ends
      const unsigned tid = read_tid();
      if (tid == 128 || (kDqOwnKeys<kD> && tid == 256)) bulk_wait();
    }
    // Both gradients in 16-byte stores of whole columns where their rows allow (store.cuh):
    // element by element, dK and dV at D = 128 wrote 2-byte pieces of 8 rows per warp store,
    // 4 times the bytes in L2 sectors, and that bound every short block (cuda/NOTES.md, b3.5).
    // The block's place read afresh (volatile): kept from the kernel's start it would hold
    // registers across the loop; ids.tid / 128 - 1 is `consumer`.
    const block_ids ids = read_block_ids();
    const std::int64_t row0 = std::int64_t(ids.x) * kKeys + (ids.tid / 128 - 1) * 64;
    store_gradient<T, kD>(bp.dk, bp.dk_stride, bp.grad_out, bp.dk_store, ids.z, ids.y, row0,
                          p.len_k, rdK, p.scale);
    store_gradient<T, kD>(bp.dv, bp.dv_stride, bp.grad_out, bp.dv_store, ids.z, ids.y, row0,
                          p.len_k, rdV, 1.f);
  }

  // A tile's elementwise steps, with its Sᵀ and dPᵀ the two youngest groups in flight: the
  // visibility of a partial tile's pairs (bit 2 nb + c of visible[r]: query q0 + col0 + 8 nb + c
  // sees key key_for(ids) + 8 r), Pᵀ while dPᵀ runs, then dSᵀ (P in place of S, dS in place of
  // dP: with dK and dV this is what fits in the registers), and the A fragments of both.
  template <class T, class KeyFor>
  __device__ static void tile_gradients(const kernel_params& p, const barriers& bar, int s,
                                        const bwd_stage_info& info,
                                        const std::int32_t (*key_rows)[4], int col0,
                                        float (&rS)[32], float (&rdP)[32],
                                        std::uint32_t (&aP)[4][4], std::uint32_t (&adS)[4][4],
                                        const KeyFor& key_for) {
    const std::int64_t q0 = std::int64_t(info.tile) * kBwdRows;
    std::uint32_t visible[2] = {~0u, ~0u};
    if (info.full == 0) {
      // The batch and the thread's slot read afresh (volatile): kept across the loop for this
      // branch alone, they spilled.
      const block_ids ids = read_block_ids();
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const std::int32_t* slot = key_rows[ids.tid - 128];
        const key_range rows{slot[2 * r], slot[2 * r + 1]};
        visible[r] = query_bits<8>(p.mask, ids.z, info.head, key_for(ids) + 8 * r, q0 + col0, rows);
      }
    }
    const float* base = bar.lse_base[s];
    const float* delta = bar.delta[s];
    wgmma_wait<1>();
    fence_operands(rS);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int nb = i / 4, e = i % 4;
      const bool on = fragment_bit(visible, nb, e);
      rS[i] = probability(rS[i], on, base[8 * nb + col0 + e % 2], p.scale * kLog2e);
    }
    wgmma_wait<0>();
    fence_operands(rdP);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int nb = i / 4, e = i % 4;
      const bool on = fragment_bit(visible, nb, e);
      rdP[i] = score_gradient(rS[i], rdP[i], on, delta[8 * nb + col0 + e % 2]);
    }
    to_a_fragments<T>(rS, aP);
    to_a_fragments<T>(rdP, adS);
  }

  // dSᵀ stored for dQ = dS K, then dQ's product (a group) and dV += Pᵀ dO, dK += dSᵀ Q (a group
  // behind it).
  template <class T, int kD>
  __device__ static void issue_dq_dv_dk(const layout<kD>& smem, int key_row0, int it, int consumer,
                                        int t, const std::uint32_t (&aP)[4][4],
                                        const std::uint32_t (&adS)[4][4], const unsigned char* sQ,
                                        const unsigned char* sdO, float (&rdQ)[32],
                                        float (&rdV)[kD / 2], float (&rdK)[kD / 2]) {
    store_ds<T>(smem.ds(), key_row0, adS);
    fence_proxy_async();
    ds_stored<kD>(it, consumer, t);
    wgmma_fence();
    product_dq<T, kD, kKeys>(rdQ, smem.ds(), smem.resident[0]);
    wgmma_commit();
    issue_dv_dk<T, kD>(aP, adS, sQ, sdO, rdV, rdK);
  }

  // After dV's and dK's products have completed: their accumulators and A fragments fenced
  // (the compiler keeps them where wgmma read and wrote them), stage s released.
  template <int kN>
  __device__ static void release_after_dv_dk(barriers& bar, int s, std::uint32_t (&aP)[4][4],
                                             std::uint32_t (&adS)[4][4], float (&rdV)[kN],
                                             float (&rdK)[kN]) {
    fence_operands(rdV);
    fence_operands(rdK);
    fence_fragments(aP);
    fence_fragments(adS);
    bar.release(s);
  }

  // dV += Pᵀ dO and dK += dSᵀ Q as one group (the fragments fenced by the caller).
  template <class T, int kD>
  __device__ static void issue_dv_dk(const std::uint32_t (&aP)[4][4],
                                     const std::uint32_t (&adS)[4][4], const unsigned char* sQ,
                                     const unsigned char* sdO, float (&rdV)[kD / 2],
                                     float (&rdK)[kD / 2]) {
    product_rs<T, kBwdRows, kD>(rdV, aP, sdO);
    product_rs<T, kBwdRows, kD>(rdK, adS, sQ);
    wgmma_commit();
  }

  // D = 64 (kBwdPipelined): the next query tile's Sᵀ and dPᵀ are issued behind this tile's dV and
  // dK products (with dQ: behind dQ's too, before dQ's hand-over), so that the tensor cores go on
  // from one tile to the next while this warpgroup hands dQ over (in fixed point: converts it)
  // under four products and then forms the next tile's Pᵀ; the loop of `consume` waits for dK
  // before it issues the next Sᵀ. With dQ in fixed point +6 to +11 % at L = 16384, in float32
  // +1 to +2 % (cuda/NOTES.md, "b9").
  template <class T, int kD, class KeyOf>
  __device__ static void consume_pipelined(const hopper_bwd_params& hp, int consumer,
                                           const layout<kD>& smem, barriers& bar,
                                           const std::int32_t (*key_rows)[4], const KeyOf& key_for,
                                           float (&rdK)[kD / 2], float (&rdV)[kD / 2]) {
    const kernel_params& p = hp.bp.fwd;
    const int t = static_cast<int>(threadIdx.x % 128);
    const int key_row0 = consumer * 64;
    const int col0 = 2 * (t % 4);
    mbar_wait(&bar.full[0], 0);
    if (read_stage_slot(bar.info[0]).tile == kNoMoreTiles) return;
    mbar_wait(&bar.resident, 0);
    if constexpr (kDq) zero_k_tail<kD>(hp, smem, consumer);
    float rS[32], rdP[32];
    // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ of the tile in stage s, a group each.
    const auto issue_scores = [&](int s) {
      wgmma_fence();
      product_ss<T, kKeys, kBwdRows, kBwdRows, kD>(rS, smem.resident[0], key_row0,
                                                   smem.stage(0, s));
      wgmma_commit();
      product_ss<T, kKeys, kBwdRows, kBwdRows, kD>(rdP, smem.resident[1], key_row0,
                                                   smem.stage(1, s));
      wgmma_commit();
    };
    issue_scores(0);
    for (int it = 0;; ++it) {
      const int s = it % kBwdStages;
      const bwd_stage_info info = read_stage_slot(bar.info[s]);  // waited for before its Sᵀ
      const unsigned char* sQ = smem.stage(0, s);
      const unsigned char* sdO = smem.stage(1, s);
      std::uint32_t aP[4][4], adS[4][4];
      tile_gradients<T>(p, bar, s, info, key_rows, col0, rS, rdP, aP, adS, key_for);
      // The next tile's Sᵀ and dPᵀ, or two empty groups where there is none: the waits below
      // count the same either way.
      const int s1 = (it + 1) % kBwdStages;
      const auto issue_next = [&] {
        mbar_wait(&bar.full[s1], ((it + 1) / kBwdStages) & 1);
        const bool more = read_stage_slot(bar.info[s1]).tile != kNoMoreTiles;
        if (more) {
          issue_scores(s1);
        } else {
          wgmma_commit();
          wgmma_commit();
        }
        return more;
      };
      bool more = false;
      if constexpr (kDq) {
        float rdQ[32];
        issue_dq_dv_dk<T, kD>(smem, key_row0, it, consumer, t, aP, adS, sQ, sdO, rdQ, rdV, rdK);
        more = issue_next();
        wgmma_wait<3>();  // dQ's product, the oldest of four groups
        fence_operands(rdQ);
        add_dq<kD>(hp, smem, consumer, bar.info[s], bar.dq_scale[s], rdQ);
      } else {
        wgmma_fence();
        issue_dv_dk<T, kD>(aP, adS, sQ, sdO, rdV, rdK);
        more = issue_next();
      }
      wgmma_wait<2>();
      release_after_dv_dk(bar, s, aP, adS, rdV, rdK);
      if (!more) return;
    }
  }

  // The last tile's chunk read by the copy engine (add_dq) before anyone passes here, and the
  // dSᵀ rows stored: both consumers' at D = 128, this one's at D = 64.
  template <int kD>
  __device__ static void ds_stored(int it, int consumer, int t) {
    if constexpr (kDqOwnKeys<kD>) {
      if (it > 0 && t == 0) bulk_wait_read();
      named_barrier_sync(kOwnDsBarrier + consumer, 128);
    } else {
      if (it > 0 && consumer == 0 && t == 0) bulk_wait_read();
      named_barrier_sync(kDsBarrier, 128 * kC);
    }
  }

  // This thread's 32 floats of the query tile's dQ into the chunk buffer (in fixed point: times
  // its rows' scales `row_scale`, rounded to int32), then (once both consumers' are there; at
  // D = 64 each consumer's own chunk, once its own are there) one thread adds the chunk to the
  // tile's sums by a bulk reduction of the copy engine. The
  // buffer is reused a tile later: the adding thread waits for the engine to have read it before
  // the next tile's first barrier (kDsBarrier, kOwnDsBarrier), which every thread passes before
  // it writes the buffer again.
  // `slot`: the tile's stage descriptor, still held (read here by the adding thread alone:
  // tile and head kept in registers from the top of the loop made ptxas spill).
  template <int kD>
  __device__ static void add_dq(const hopper_bwd_params& hp, const layout<kD>& smem, int consumer,
                                const bwd_stage_info& slot, const float* row_scale,
                                const float (&acc)[32]) {
    const kernel_params& p = hp.bp.fwd;
    // Read in place, not hoisted (the chunk's addresses would be kept and spilled).
    const int t = static_cast<int>(read_tid() % 128);
    constexpr bool kOwn = kDqOwnKeys<kD>;
    float4* chunk = reinterpret_cast<float4*>(smem.dq(kOwn ? consumer : 0));
    if constexpr (kFixed) {
      // Element 4 g + e is row 16 (t / 32) + (t % 32) / 4 + 8 (e / 2) of the stage.
      const int row_a = 16 * (t / 32) + (t % 32) / 4;
      const float scale[2] = {row_scale[row_a], row_scale[row_a + 8]};
      bool in_range[2] = {true, true};
      int4* ichunk = reinterpret_cast<int4*>(chunk);
#pragma unroll
      for (int g = 0; g < 8; ++g) {
        int v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float y = acc[4 * g + e] * scale[e / 2];
          in_range[e / 2] = in_range[e / 2] && fabsf(y) < 0x1p30f;  // false for NaN
          v[e] = __float2int_rn(y);
        }
        ichunk[dq_chunk_float4(kOwn ? 0 : consumer, g, t)] = make_int4(v[0], v[1], v[2], v[3]);
      }
      if (!in_range[0] || !in_range[1]) {  // never with finite inputs and the forward's LSE
        // (Rows past Lq are left alone: their dS is 0, but a NaN key in the product gives them a
        // NaN part too, and their index would be the next head's rows.)
        const bwd_stage_info info = slot;
        const std::int64_t i0 = std::int64_t(info.tile) * kBwdRows + row_a;
        const std::int64_t n0 = (blockIdx.z * p.heads_q + info.head) * p.len_q + i0;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (!in_range[r] && i0 + 8 * r < p.len_q) atomicOr(hp.bp.dq_row_flags + n0 + 8 * r, 1u);
        }
      }
    } else {
#pragma unroll
      for (int g = 0; g < 8; ++g) {
        chunk[dq_chunk_float4(kOwn ? 0 : consumer, g, t)] =
            make_float4(acc[4 * g], acc[4 * g + 1], acc[4 * g + 2], acc[4 * g + 3]);
      }
    }
    fence_proxy_async();  // the stores above are read by the copy engine
    if constexpr (kOwn) {
      named_barrier_sync(kOwnDqBarrier + consumer, 128);
    } else {
      named_barrier_sync(kDqBarrier, 128 * kC);
    }
    if ((kOwn || consumer == 0) && t == 0) {
      const bwd_stage_info info = slot;
      const std::int64_t tiles_q = (p.len_q + kBwdRows - 1) / kBwdRows;
      const std::int64_t n = (blockIdx.z * p.heads_q + info.head) * tiles_q + info.tile;
      if constexpr (kFixed) {
        bulk_reduce_add_s32(static_cast<std::int32_t*>(hp.bp.dq_sums) + n * kDqChunkFloats<kD>,
                            chunk, kDqChunkFloats<kD> * 4);
      } else {
        bulk_reduce_add_f32(static_cast<float*>(hp.bp.dq_sums) + n * kDqChunkFloats<kD>, chunk,
                            kDqChunkFloats<kD> * 4);
      }
      bulk_commit();
    }
  }

  // Where kv_len cuts the block's keys, K's rows at or past it (maybe uninitialised) are set to
  // zero once K has landed, each consumer its own 64 rows: they meet dS = 0 in dQ = dS K, as in
  // the dQ kernel (TMA itself zero-fills rows past Lk). Sᵀ reads only the consumer's rows (its
  // warps' stores ordered by a barrier of the warpgroup); dQ = dS K reads both halves after
  // kDsBarrier (at D = 64 its own half, after kOwnDsBarrier).
  template <int kD>
  __device__ static void zero_k_tail(const hopper_bwd_params& hp, const layout<kD>& smem,
                                     int consumer) {
    const kernel_params& p = hp.bp.fwd;
    if (p.mask.kv_len == nullptr) return;  // past Lk TMA has zero-filled the rows
    const std::int64_t k0 = std::int64_t(blockIdx.x) * kKeys + consumer * 64;
    const std::int64_t end = p.mask.key_end(blockIdx.z);
    if (end >= k0 + 64) return;
    using k_tile = box_tile<kKeys, kD>;
    // Whole rows [r0, 64 consumer + 64) of each box, 16 bytes per store (the swizzle permutes
    // chunks within a row only).
    const int r0 = consumer * 64 + (end > k0 ? static_cast<int>(end - k0) : 0);
    constexpr int kRowChunks = 128 / 16;
    const int per_box = (consumer * 64 + 64 - r0) * kRowChunks;
    for (int idx = static_cast<int>(threadIdx.x % 128); idx < per_box * (kD / kBoxCols);
         idx += 128) {
      const int box = idx / per_box, within = idx % per_box;
      *reinterpret_cast<uint4*>(smem.resident[0] + box * k_tile::kBoxBytes + r0 * 128 +
                                within * 16) = make_uint4(0, 0, 0, 0);
    }
    fence_proxy_async();  // the stores above are read by wgmma
    named_barrier_sync(kKTailBarrier + consumer, 128);
  }
};
// The host sizes the sums (hopper_dq_sums_bytes) by the chunk rows these kernels add.
static_assert(kHopperDqRows == kBwdRows, "the dQ sums' chunks are the dK, dV kernel's stages");

inline constexpr int kDqFromSumsThreads = 256;

// Two floats as one register of two 16-bit elements of the run-time type e (bf16 or f16).
__device__ __forceinline__ std::uint32_t pack2_as(float lo, float hi, elem e) {
  return e == elem::f16 ? pack2<__half>(lo, hi) : pack2<__nv_bfloat16>(lo, hi);
}

// dQ = scale x the sums of the dK, dV kernel with dQ (chunks of dq_chunk_coords' order), rows
// past Lq skipped: float32 sums as they are; fixed-point ones divided by their row's scale (a
// power of two, at most 2^127: its reciprocal is exact, even where subnormal, so the product is
// the quotient's bits without a division per element), NaN in a flagged row. A block takes whole
// chunks: it reads one in the chunk's own order (16-byte loads), puts each value at its row and
// column in shared memory, then writes the rows out in the widest pieces dQ's layout takes
// (bp.dq_store: 16 bytes of 16-bit elements, 8-byte float pairs, else element by element). Each
// element is the same float expression, rounded once, whichever way it is stored. Writing the
// chunk's order straight out, each warp's store met 8 rows in 4-byte pieces: 126 us for the 192 MB
// at D = 128, L = 16384 (ncu), about a third of the bandwidth.
template <int kD, bool kFixed>
__global__ void __launch_bounds__(kDqFromSumsThreads) dq_from_sums(const backward_params bp) {
  constexpr int kPitch = kD + 8;  // floats per row in shared memory
  constexpr int kChunk4 = kDqChunkFloats<kD> / 4;
  constexpr int kPerThread = kChunk4 / kDqFromSumsThreads;
  static_assert(kChunk4 % kDqFromSumsThreads == 0, "whole 16-byte pieces per thread");
  __shared__ float rows[kBwdRows * kPitch];
  __shared__ float row_inv[kBwdRows];  // fixed point: 1 / the row's scale, or NaN if flagged
  const kernel_params& p = bp.fwd;
  const std::int64_t tiles_q = (p.len_q + kBwdRows - 1) / kBwdRows;
  const std::int64_t chunks = p.batch * p.heads_q * tiles_q;
  const int t = static_cast<int>(threadIdx.x);
  for (std::int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const std::int64_t tile = chunk % tiles_q, bh = chunk / tiles_q;
    const std::int64_t h = bh % p.heads_q, b = bh / p.heads_q;
    const std::int64_t row0 = tile * kBwdRows;
    const int rows_in = static_cast<int>(p.len_q - row0 < kBwdRows ? p.len_q - row0 : kBwdRows);
    // Every 16-byte piece of the thread's share loaded before any is used: one round trip to
    // memory per chunk instead of one per piece (the stores into rows between the loads kept
    // them apart: 44 % of DRAM bandwidth at D = 128, L = 16384).
    int4 raw[kPerThread];
#pragma unroll
    for (int u = 0; u < kPerThread; ++u)
      raw[u] = __ldg(static_cast<const int4*>(bp.dq_sums) + chunk * kChunk4 + t +
                     u * kDqFromSumsThreads);
    if constexpr (kFixed) {
      for (int r = t; r < rows_in; r += kDqFromSumsThreads) {
        const std::int64_t n = bh * p.len_q + row0 + r;
        row_inv[r] =
            bp.dq_row_flags[n] != 0 ? __int_as_float(0x7fffffff) : 1.f / bp.dq_row_scale[n];
      }
      __syncthreads();
    }
    // The thread's index read afresh per chunk: otherwise the compiler keeps every piece's
    // shared-memory addresses live across the chunks (119 registers at D = 128: two blocks
    // per SM).
    int tc;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tc));
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int f = tc + u * kDqFromSumsThreads;
      const int w[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const dq_coords at = dq_chunk_coords(f, e);
        if (at.row >= rows_in) continue;
        float value;
        if constexpr (kFixed) {  // NaN in a flagged row's every element
          value = static_cast<float>(w[e]) * row_inv[at.row];
        } else {
          value = __int_as_float(w[e]);
        }
        rows[at.row * kPitch + at.col] = p.scale * value;
      }
    }
    __syncthreads();
    const std::int64_t base = b * bp.dq_stride[0] + h * bp.dq_stride[1] + row0 * bp.dq_stride[2];
    if (bp.dq_store == row_store::packed16) {
      constexpr int kPieces = kD / 8;
      for (int idx = t; idx < rows_in * kPieces; idx += kDqFromSumsThreads) {
        const int r = idx / kPieces, c = idx % kPieces * 8;
        const float* s = rows + r * kPitch + c;
        const uint4 w =
            make_uint4(pack2_as(s[0], s[1], bp.grad_out), pack2_as(s[2], s[3], bp.grad_out),
                       pack2_as(s[4], s[5], bp.grad_out), pack2_as(s[6], s[7], bp.grad_out));
        *reinterpret_cast<uint4*>(static_cast<std::uint16_t*>(bp.dq) + base + r * bp.dq_stride[2] +
                                  c) = w;
      }
    } else if (bp.dq_store == row_store::pairs32) {
      constexpr int kPieces = kD / 2;
      for (int idx = t; idx < rows_in * kPieces; idx += kDqFromSumsThreads) {
        const int r = idx / kPieces, c = idx % kPieces * 2;
        const float* s = rows + r * kPitch + c;
        *reinterpret_cast<float2*>(static_cast<float*>(bp.dq) + base + r * bp.dq_stride[2] + c) =
            make_float2(s[0], s[1]);
      }
    } else {
      for (int idx = t; idx < rows_in * kD; idx += kDqFromSumsThreads) {
        const int r = idx / kD, c = idx % kD;
        store_elem(bp.dq, base + r * bp.dq_stride[2] + c * bp.dq_stride[3], rows[r * kPitch + c],
                   bp.grad_out);
      }
    }
    __syncthreads();  // the rows are read before the next chunk writes them
  }
}

// --- dQ ----------------------------------------------------------------------------------------

// Resident Q (tile 0) and dO (tile 1) of 128 rows; stages of K (tile 0) and V (tile 1).
template <int kD>
using dq_layout = bwd_layout<kBwdQRows, kBwdQKeysFor<kD>, kD>;

// Query tile blockIdx.x counted from the end: under a causal mask the last tiles see the most
// keys, so the heavy blocks start first.
[[maybe_unused]] __device__ __forceinline__ std::int64_t dq_row0() {
  return (std::int64_t(gridDim.x) - 1 - blockIdx.x) * kBwdQRows;
}

// The dQ pass: its barriers, register split and layout, the producer warp and a
// consumer warpgroup, as the kernel template below takes them.
struct dq_pass {
  static constexpr int kThreads = sm90::kThreads, kMinBlocks = 1;
  using barriers = dq_barriers;
  template <int kD>
  using registers = dq_registers;
  template <int kD>
  using layout = dq_layout<kD>;

  template <class T, int kD>
  __device__ static void produce(const hopper_bwd_params& hp, const dq_layout<kD>& smem,
                                 dq_barriers& bar) {
    constexpr int kKeys = kBwdQKeysFor<kD>;
    using L = dq_layout<kD>;
    const kernel_params& p = hp.bp.fwd;
    const bool leader = threadIdx.x % 32 == 0;
    const std::int64_t q0 = dq_row0();
    const std::int64_t q1 = q0 + kBwdQRows < p.len_q ? q0 + kBwdQRows : p.len_q;
    const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
    const int hk = h / static_cast<int>(p.group);
    tile_walker<kKeys> walker(p.mask, b, h, q0, q1);
    std::int64_t tile = 0;
    bool full = false;
    bool have = walker.next(tile, full);
    if (have && leader) {
      mbar_arrive_expect_tx(&bar.resident, 2 * L::resident_tile::kBytes);
      smem.load_resident(&hp.maps.q, &hp.maps.d_o, int(q0), h, b, &bar.resident);
    }
    const T* gK = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
    for (int it = 0;; ++it) {
      const int s = it % kBwdStages;
      mbar_wait(&bar.empty[s], ((it / kBwdStages) & 1) ^ 1);  // the consumers released stage s
      if (!have) {
        if (leader) {
          bar.info[s] = {kNoMoreTiles, 0, 0, 0};
          mbar_arrive(&bar.full[s]);
        }
        return;
      }
      const int k0 = static_cast<int>(tile) * kKeys;
      // The tile that straddles kv_len: K's rows past it zero-filled by the lanes (dS = 0 there
      // meets them in dQ += dS K); V's may stay as they are (dP is only selected from).
      const bool k_tail = k0 + kKeys > walker.key_end && walker.key_end < p.len_k;
      if (k_tail) {
        load_rows_zero_tail<T, kKeys, kD>(smem.stage(0, s), gK, p.k_stride[2], k0, walker.key_end);
        fence_proxy_async();  // the stores above are read by wgmma
        __syncwarp();
      }
      if (leader) {
        bar.info[s] = {int(tile), h, full ? 1 : 0, 0};
        mbar_arrive_expect_tx(&bar.full[s], (k_tail ? 1 : 2) * L::staged_tile::kBytes);
        smem.load_stage(s, k_tail ? nullptr : &hp.maps.k, &hp.maps.v, k0, hk, b, &bar.full[s]);
      }
      have = walker.next(tile, full);
    }
  }

  template <class T, int kD>
  __device__ static void consume(const hopper_bwd_params& hp, int consumer,
                                 const dq_layout<kD>& smem, dq_barriers& bar) {
    constexpr int kKeys = kBwdQKeysFor<kD>;
    const backward_params& bp = hp.bp;
    const kernel_params& p = bp.fwd;
    const std::int64_t q0 = dq_row0();
    const std::int64_t h = blockIdx.y, b = blockIdx.z;
    const fragment_coords at(consumer);  // rows at.row0, at.row0 + 8 of the block; columns col0
    float base[2], delta[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const row_terms row = row_terms_of(bp, b, h, q0 + at.row0 + 8 * r);
      base[r] = row.base;
      delta[r] = row.delta;
    }
    float rdQ[kD / 2] = {};  // (64 rows, kD): dQ / scale
    // A stage holds kKeys keys; the products take them kSub at a time (at D = 64 a stage's 128
    // keys as two halves of 64: S, dP, dQ and the dS fragments of 128 keys at once took the
    // consumers past their 216 registers, and ptxas serialised every wgmma).
    constexpr int kHalves = kKeys == 128 ? 2 : 1;
    constexpr int kSub = kKeys / kHalves;
    constexpr int kS = kSub / 2;   // accumulator floats of S and dP per thread
    std::uint32_t adS[kS / 8][4];  // dS of the keys whose dQ product is in flight

    // Each part issues S and dP behind the previous part's dQ += dS K, waits for that product
    // (releasing its stage when it was the stage's last part), and leaves its own running.
    int it = 0;
    for (;; ++it) {
      const int s = it % kBwdStages;
      mbar_wait(&bar.full[s], (it / kBwdStages) & 1);
      const bwd_stage_info info = read_stage_slot(bar.info[s]);
      if (info.tile == kNoMoreTiles) break;
      if (it == 0) mbar_wait(&bar.resident, 0);
#pragma unroll
      for (int half = 0; half < kHalves; ++half) {
        const int sub0 = half * kSub;  // the part's first key in the stage
        // S = Q Kᵀ and dP = dO Vᵀ, issued together.
        float rS[kS], rdP[kS];
        wgmma_fence();
        product_ss<T, kBwdQRows, kKeys, kSub, kD>(rS, smem.resident[0], consumer * 64,
                                                  smem.stage(0, s), sub0);
        wgmma_commit();
        product_ss<T, kBwdQRows, kKeys, kSub, kD>(rdP, smem.resident[1], consumer * 64,
                                                  smem.stage(1, s), sub0);
        wgmma_commit();

        // Bit 2 nb + c of visible[r]: row q0 + at.row0 + 8 r sees key k + at.col0 + 8 nb + c,
        // k the part's first key.
        std::uint32_t visible[2] = {~0u, ~0u};
        if (info.full == 0) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            visible[r] = key_bits<kS / 4>(p.mask, b, h, q0 + at.row0 + 8 * r,
                                          std::int64_t(info.tile) * kKeys + sub0 + at.col0);
          }
        }
        if (it > 0 || half > 0) {  // the previous part's dQ product is done
          wgmma_wait<2>();
          fence_operands(rdQ);
          fence_fragments(adS);
          if (half == 0) bar.release((it - 1) % kBwdStages);  // it was the stage's last part
        }
        wgmma_wait<1>();
        fence_operands(rS);
#pragma unroll
        for (int i = 0; i < kS; ++i) {
          const int nb = i / 4, e = i % 4;
          const bool on = fragment_bit(visible, nb, e);
          rS[i] = probability(rS[i], on, base[e / 2], p.scale * kLog2e);
        }
        wgmma_wait<0>();
        fence_operands(rdP);
#pragma unroll
        for (int i = 0; i < kS; ++i) {
          const int nb = i / 4, e = i % 4;
          const bool on = fragment_bit(visible, nb, e);
          rdP[i] = score_gradient(rS[i], rdP[i], on, delta[e / 2]);
        }
        to_a_fragments<T>(rdP, adS);

        // dQ += dS K (the part's rows of the stage's K), left running.
        wgmma_fence();
        product_rs<T, kKeys, kD>(rdQ, adS, smem.stage(0, s) + sub0 * 128);
        wgmma_commit();
      }
    }
    if (it > 0) {
      wgmma_wait<0>();
      fence_operands(rdQ);
      fence_fragments(adS);
      bar.release((it - 1) % kBwdStages);
    }
    store_gradient<T, kD>(bp.dq, bp.dq_stride, bp.grad_out, bp.dq_store, b, h, q0 + consumer * 64,
                          p.len_q, rdQ, p.scale);
  }
};

// --- the kernels -------------------------------------------------------------------------------

// One block of either pass: the barriers, the maps prefetched, then the producer warp and the
// consumer warpgroups with their register budgets.
template <class Pass, class T, int kD>
__global__ void __launch_bounds__(Pass::kThreads, Pass::kMinBlocks)
    hopper_bwd_kernel(const __grid_constant__ hopper_bwd_params hp) {
#if FLASHREF_SM90A
  extern __shared__ __align__(1024) unsigned char s_raw[];
  __shared__ typename Pass::barriers bar;
  const typename Pass::template layout<kD> smem(s_raw);
  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  if (threadIdx.x == 0) {
    bar.init();
    tma_prefetch_map(&hp.maps.q);
    tma_prefetch_map(&hp.maps.d_o);
    tma_prefetch_map(&hp.maps.k);
    tma_prefetch_map(&hp.maps.v);
  }
  __syncthreads();
  if (warpgroup == 0) {
    setmaxnreg_dec<Pass::template registers<kD>::kProducerRegs>();
    if (threadIdx.x < 32) Pass::template produce<T, kD>(hp, smem, bar);
  } else {
    setmaxnreg_inc<Pass::template registers<kD>::kConsumerRegs>();
    Pass::template consume<T, kD>(hp, warpgroup - 1, smem, bar);
  }
#else
  (void)hp;
  __trap();
#endif
}

// The four maps with the given row counts per box: Q and dO (rows), K and V (keys).
cudaError_t make_maps(bwd_maps& m, const backward_params& bp, elem input, int kD, int rows,
                      int keys) {
  const kernel_params& p = bp.fwd;
  cudaError_t e = make_map(&m.q, p.q, input, p.batch, p.heads_q, p.len_q, kD, p.q_stride, rows);
  if (e == cudaSuccess) {
    e = make_map(&m.d_o, bp.d_o, input, p.batch, p.heads_q, p.len_q, kD, bp.d_o_stride, rows);
  }
  if (e == cudaSuccess) {
    e = make_map(&m.k, p.k, input, p.batch, p.heads_k, p.len_k, kD, p.k_stride, keys);
  }
  if (e == cudaSuccess) {
    e = make_map(&m.v, p.v, input, p.batch, p.heads_k, p.len_k, kD, p.v_stride, keys);
  }
  return e;
}

// The dK, dV pass of `Pass`, then dQ: scaled from the sums the dK, dV kernel with dQ left
// (dq_sums::float32 or fixed: the rows' scales came with Delta), or by its own pass.
template <class Pass, class T, int kD>
cudaError_t launch_passes(const backward_params& bp, elem input, cudaStream_t stream) {
  const kernel_params& p = bp.fwd;
  hopper_bwd_params hp{};
  hp.bp = bp;
  constexpr bool kSums = Pass::kDq, kFixed = Pass::kFixed;
  constexpr int kDkdvSmem = Pass::template layout<kD>::kSmemBytes;
  constexpr int kDqSmem = dq_layout<kD>::kSmemBytes;
  cudaError_t e = cudaFuncSetAttribute(hopper_bwd_kernel<Pass, T, kD>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kDkdvSmem);
  if (e == cudaSuccess && Pass::kMinBlocks > 1) {  // room for the blocks that share an SM
    e = cudaFuncSetAttribute(hopper_bwd_kernel<Pass, T, kD>,
                             cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
  }
  if constexpr (!kSums) {
    if (e == cudaSuccess) {
      e = cudaFuncSetAttribute(hopper_bwd_kernel<dq_pass, T, kD>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, kDqSmem);
    }
  }
  if (e != cudaSuccess) return e;
  const bool queries = p.len_q > 0 && p.heads_q > 0 && p.batch > 0;
  if (kSums && queries) {
    e = cudaMemsetAsync(bp.dq_sums, 0, hopper_dq_sums_bytes(p.batch, p.heads_q, p.len_q, kD),
                        stream);
    if (e != cudaSuccess) return e;
  }
  if (p.len_k > 0 && p.heads_k > 0 && p.batch > 0) {
    e = make_maps(hp.maps, bp, input, kD, kBwdRows, Pass::kKeys);
    if (e != cudaSuccess) return e;
    const dim3 grid(static_cast<unsigned>((p.len_k + Pass::kKeys - 1) / Pass::kKeys),
                    static_cast<unsigned>(p.heads_k), static_cast<unsigned>(p.batch));
    hopper_bwd_kernel<Pass, T, kD><<<grid, Pass::kThreads, kDkdvSmem, stream>>>(hp);
  }
  if (!queries) return cudaGetLastError();
  if constexpr (kSums) {
    const std::int64_t chunks = hopper_dq_sums_bytes(p.batch, p.heads_q, p.len_q, kD) /
                                (sizeof(float) * kDqChunkFloats<kD>);
    const unsigned blocks = static_cast<unsigned>(chunks < 65535 ? chunks : 65535);
    dq_from_sums<kD, kFixed><<<blocks, kDqFromSumsThreads, 0, stream>>>(bp);
  } else {
    e = make_maps(hp.maps, bp, input, kD, kBwdQRows, kBwdQKeysFor<kD>);
    if (e != cudaSuccess) return e;
    const dim3 grid(static_cast<unsigned>((p.len_q + kBwdQRows - 1) / kBwdQRows),
                    static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
    hopper_bwd_kernel<dq_pass, T, kD><<<grid, kThreads, kDqSmem, stream>>>(hp);
  }
  return cudaGetLastError();
}

// With dQ's sums in the workspace (D = 64 and 128): dQ inside the dK, dV kernel, the sums in
// fixed point where the rows' scales are there too; otherwise dQ by its own pass.
// The pair blocks (one consumer warpgroup of 64 keys, two blocks per SM) at D = 64 where a
// block's walk is short: under a block mask, or over at most kPairMaxKeys keys. There the start
// and end of each block, which nothing inside it overlaps, weigh most, and the other block on
// the SM runs its products meanwhile (cuda/NOTES.md, "b14": +0.4 to +6.5 % from L = 1024 to
// 8192, +0.2 to +3.3 % under block masks at L = 16384; dense L = 16384 −1.9 %, so rows longer
// than 8192 keys without a block mask keep the block of two consumers).
inline constexpr std::int64_t kPairMaxKeys = 8192;

// The dK, dV pass of kC consumer warpgroups, with dQ's sums as the workspace holds them: in
// fixed point, in float32, or none (dQ by its own pass).
template <int kC, class T, int kD>
cudaError_t launch_with_sums(const backward_params& bp, elem input, cudaStream_t stream) {
  if (bp.dq_row_scale != nullptr) {
    return launch_passes<dkdv_pass_t<dq_sums::fixed, kC>, T, kD>(bp, input, stream);
  }
  if (bp.dq_sums != nullptr) {
    return launch_passes<dkdv_pass_t<dq_sums::float32, kC>, T, kD>(bp, input, stream);
  }
  return launch_passes<dkdv_pass_t<dq_sums::none, kC>, T, kD>(bp, input, stream);
}

template <class T, int kD>
cudaError_t launch(const backward_params& bp, elem input, cudaStream_t stream) {
  static_assert(kD == 64 || kD == 128, "the Hopper backward's head dims");
  if constexpr (kD == 64) {  // the pair blocks: no room for two blocks an SM at D = 128
    if (bp.fwd.mask.block_mask != nullptr || bp.fwd.len_k <= kPairMaxKeys) {
      return launch_with_sums<1, T, kD>(bp, input, stream);
    }
  }
  return launch_with_sums<kConsumers, T, kD>(bp, input, stream);
}

}  // namespace

cudaError_t launch_hopper_backward(const backward_params& bp, elem input, cudaStream_t stream) {
  const bool half = input == elem::f16;
  if (bp.fwd.head_dim == 64) {
    return half ? launch<__half, 64>(bp, input, stream)
                : launch<__nv_bfloat16, 64>(bp, input, stream);
  }
  return half ? launch<__half, 128>(bp, input, stream)
              : launch<__nv_bfloat16, 128>(bp, input, stream);
}

}  // namespace flashref::cuda::detail
