// The tensor-core forward kernel (bf16 / fp16 inputs, fp32 accumulation), FlashAttention-2
// style (Dao 2023): one block of 8 warps per 128 query rows; each warp owns 16 rows and keeps
// its Q fragments, its output accumulator and its rows' online-softmax state in registers.
// Key tiles of 64 keys stream through shared memory with cp.async, two stages deep, so the
// next visible tile loads while the current one is computed. S = Q K^T and O += P V run on
// mma.sync m16n8k16 with operands fetched by ldmatrix from an XOR-swizzled layout.
//
// Masks: tile_walker yields only the key tiles that hold a visible key; a full tile skips the
// element mask, a partial one applies it; a query tile with no visible key writes (0, -inf)
// before loading anything.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "launch.hpp"
#include "mma.cuh"

namespace flashref::cuda::detail {
namespace {

constexpr int kTileQ = 128;             // query rows per block
constexpr int kTileK = 64;              // keys per tile
constexpr int kKeyBlocks = kTileK / 8;  // n8 blocks of S per warp

template <int kD>
struct tc_smem : swizzled<kD> {
  static constexpr int kQ = kTileQ * kD;   // sQ: (kTileQ, kD)
  static constexpr int kKV = kTileK * kD;  // sK[s], sV[s]: (kTileK, kD)
  static constexpr int kElems = kQ + 4 * kKV;
};

// kM: m16 row tiles per warp. A block always holds kTileQ = 128 query rows, so it has
// 8 / kM warps; a larger kM feeds each ldmatrix'd K/V fragment to kM mma instructions but
// needs twice the accumulator registers (kM = 2 spills at D = 128; see cuda/NOTES.md).
// The shipped kernels use kRowTiles.
constexpr int kRowTiles = 1;
template <int kM>
struct tc_warps {
  static constexpr int kWarps = kTileQ / (16 * kM);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlocksPerSM = kM == 1 ? 1 : 2;
};

template <class T, int kD, int kM>
__global__ void __launch_bounds__(tc_warps<kM>::kThreads, tc_warps<kM>::kBlocksPerSM)
    tensor_core_kernel(const kernel_params p) {
  using smem = tc_smem<kD>;
  constexpr int kThreads = tc_warps<kM>::kThreads;
  constexpr int kDSteps = kD / 16;    // k16 steps over the head dim
  constexpr int kOutBlocks = kD / 8;  // n8 blocks of O per row tile
  constexpr bool kQInRegisters = kM == 1;
  extern __shared__ __align__(128) unsigned char s_raw[];
  T* sQ = reinterpret_cast<T*>(s_raw);  // (kTileQ, kD)
  T* sK = sQ + smem::kQ;                // (2, kTileK, kD)
  T* sV = sK + 2 * smem::kKV;           // (2, kTileK, kD)

  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  // Heavy query tiles first: under a causal mask the last tiles see the most keys.
  const std::int64_t q0 = (std::int64_t(gridDim.x) - 1 - blockIdx.x) * kTileQ;
  const std::int64_t h = blockIdx.y;
  const std::int64_t b = blockIdx.z;
  const std::int64_t hk = h / p.group;
  const std::int64_t q1 = q0 + kTileQ < p.len_q ? q0 + kTileQ : p.len_q;
  const mask_spec& mask = p.mask;

  const T* gQ = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];   // (Lq, D)
  const T* gK = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];  // (Lk, D)
  const T* gV = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];  // (Lk, D)

  // Row tile m of this warp holds rows warp*16*kM + m*16 + [0, 16); this thread's two rows
  // in the m16n8 accumulator layout are row_a(m) and row_a(m) + 8.
  const int warp_row = warp * 16 * kM;
  const std::int64_t row_a = q0 + warp_row + lane / 4;

  online_softmax<float> st[kM][2];   // s is this thread's partial sum of the row
  float rO[kM][kOutBlocks][4] = {};  // (16 kM, kD) per warp: O accumulator

  tile_walker<kTileK> walker(mask, b, h, q0, q1);
  std::int64_t tile = 0;
  bool tile_full = false;
  bool have = walker.next(tile, tile_full);
  if (have) {
    load_tile<T, kD, kTileQ, kThreads>(sQ, gQ, p.q_stride[2], q0, p.len_q);
    load_tile<T, kD, kTileK, kThreads>(sK, gK, p.k_stride[2], tile * kTileK, walker.key_end);
    load_tile<T, kD, kTileK, kThreads>(sV, gV, p.v_stride[2], tile * kTileK, walker.key_end);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
  }
  // Q as A fragments: kept in registers with one row tile per warp, else read per k-step.
  auto load_q = [&](std::uint32_t(&frag)[4], int m, int ks) {
    const int row = warp_row + m * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
    ldmatrix_x4(frag, sQ + smem::offset(row, 2 * ks + lane / 16));
  };
  std::uint32_t rQ[kQInRegisters ? kDSteps : 1][4];  // (16, kD) per warp when kept
  if constexpr (kQInRegisters) {
    if (have) {
#pragma unroll
      for (int ks = 0; ks < kDSteps; ++ks)
        load_q(rQ[ks], 0, ks);
    }
  }

  int stage = 0;
  while (have) {
    std::int64_t next_tile = 0;
    bool next_full = false;
    const bool have_next = walker.next(next_tile, next_full);
    if (have_next) {  // the other stage was released by the barrier that ended the last tile
      load_tile<T, kD, kTileK, kThreads>(sK + (stage ^ 1) * smem::kKV, gK, p.k_stride[2],
                                         next_tile * kTileK, walker.key_end);
      load_tile<T, kD, kTileK, kThreads>(sV + (stage ^ 1) * smem::kKV, gV, p.v_stride[2],
                                         next_tile * kTileK, walker.key_end);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this tile's group has landed
    __syncthreads();

    const T* sKs = sK + stage * smem::kKV;  // (kTileK, kD)
    const T* sVs = sV + stage * smem::kKV;  // (kTileK, kD)

    // S = Q K^T for this warp's rows and the tile's 64 keys.
    float rS[kM][kKeyBlocks][4] = {};  // (16 kM, kTileK)
#pragma unroll
    for (int ks = 0; ks < kDSteps; ++ks) {
      std::uint32_t qf[kM][4];
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        if constexpr (kQInRegisters) {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            qf[m][e] = rQ[ks][e];
        } else {
          load_q(qf[m], m, ks);
        }
      }
#pragma unroll
      for (int nb = 0; nb < kKeyBlocks; nb += 2) {
        std::uint32_t kf[4];
        const int key = nb * 8 + (lane / 16) * 8 + lane % 8;
        ldmatrix_x4(kf, sKs + smem::offset(key, 2 * ks + (lane / 8) % 2));
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          mma_16816<T>(rS[m][nb], qf[m], kf[0], kf[1]);
          mma_16816<T>(rS[m][nb + 1], qf[m], kf[2], kf[3]);
        }
      }
    }

    // In a partial tile, one bit per key this thread holds: bit 2 nb + c is key
    // k0 + 8 nb + 2 (lane % 4) + c. Built in a rolled loop to keep registers for the tiles.
    std::uint32_t visible[kM][2];
#pragma unroll
    for (int m = 0; m < kM; ++m) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        visible[m][r] = ~0u;
        if (!tile_full) {
          visible[m][r] = key_bits<kKeyBlocks>(mask, b, h, row_a + m * 16 + r * 8,
                                               tile * kTileK + (lane % 4) * 2);
        }
      }
    }
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      // Scale; masked keys become -inf.
#pragma unroll
      for (int nb = 0; nb < kKeyBlocks; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool on = (visible[m][e / 2] >> (2 * nb + e % 2)) & 1u;
          rS[m][nb][e] = on ? rS[m][nb][e] * p.scale : -INFINITY;
        }
      }

      // Online softmax per row: m_new = max(m_old, block max); O *= exp(m_old - m_new).
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float block_max = -INFINITY;
#pragma unroll
        for (int nb = 0; nb < kKeyBlocks; ++nb) {
          block_max = fmaxf(block_max, fmaxf(rS[m][nb][2 * r], rS[m][nb][2 * r + 1]));
        }
        // The four lanes of a quad hold the row's 64 keys between them.
        block_max = fmaxf(block_max, __shfl_xor_sync(kFullWarp, block_max, 1));
        block_max = fmaxf(block_max, __shfl_xor_sync(kFullWarp, block_max, 2));
        const float exp_old = st[m][r].update_max(block_max);
#pragma unroll
        for (int nb = 0; nb < kOutBlocks; ++nb) {
          rO[m][nb][2 * r] *= exp_old;
          rO[m][nb][2 * r + 1] *= exp_old;
        }
        st[m][r].rescale(exp_old);
        // p = exp(s - m) = 2^(s log2e - base log2e), base = exp_base(m) (0 while m == -inf).
        const float base_log2 = online_softmax<float>::exp_base(st[m][r].m) * kLog2e;
        float p_sum = 0.f;
#pragma unroll
        for (int nb = 0; nb < kKeyBlocks; ++nb) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            rS[m][nb][e] = fast_exp2(fmaf(rS[m][nb][e], kLog2e, -base_log2));
            p_sum += rS[m][nb][e];
          }
        }
        st[m][r].absorb(p_sum);
      }
    }

    // O += P V: P's accumulator layout is the A-fragment layout of the next mma.
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) {
      std::uint32_t pf[kM][4];
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        pf[m][0] = pack2<T>(rS[m][2 * kk][0], rS[m][2 * kk][1]);
        pf[m][1] = pack2<T>(rS[m][2 * kk][2], rS[m][2 * kk][3]);
        pf[m][2] = pack2<T>(rS[m][2 * kk + 1][0], rS[m][2 * kk + 1][1]);
        pf[m][3] = pack2<T>(rS[m][2 * kk + 1][2], rS[m][2 * kk + 1][3]);
      }
#pragma unroll
      for (int nb = 0; nb < kOutBlocks; nb += 2) {
        std::uint32_t vf[4];
        const int key = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        ldmatrix_x4_trans(vf, sVs + smem::offset(key, nb + lane / 16));
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          mma_16816<T>(rO[m][nb], pf[m], vf[0], vf[1]);
          mma_16816<T>(rO[m][nb + 1], pf[m], vf[2], vf[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled

    have = have_next;
    tile = next_tile;
    tile_full = next_full;
    stage ^= 1;
  }
  cp_async_wait<0>();

  // Finalize: the row's sum is spread over the quad; out = acc / s, or 0 with lse = -inf.
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      online_softmax<float>& row = st[m][r];
      row.s += __shfl_xor_sync(kFullWarp, row.s, 1);
      row.s += __shfl_xor_sync(kFullWarp, row.s, 2);
      const finalized<float> fin = row.finalize();
      const std::int64_t i = row_a + m * 16 + r * 8;
      if (i >= p.len_q) continue;
      const std::int64_t o_row = b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2];
#pragma unroll
      for (int nb = 0; nb < kOutBlocks; ++nb) {
        const std::int64_t d = nb * 8 + (lane % 4) * 2;
        store_out<T>(p.o, o_row + d * p.o_stride[3], rO[m][nb][2 * r] * fin.out_scale, p.out);
        store_out<T>(p.o, o_row + (d + 1) * p.o_stride[3], rO[m][nb][2 * r + 1] * fin.out_scale,
                     p.out);
      }
      if (p.lse != nullptr && lane % 4 == 0) {
        p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] = fin.lse;
      }
    }
  }
}

template <class T, int kD, int kM>
cudaError_t launch(const kernel_params& p, cudaStream_t stream) {
  const int smem_bytes = tc_smem<kD>::kElems * static_cast<int>(sizeof(T));
  cudaError_t e = cudaFuncSetAttribute(tensor_core_kernel<T, kD, kM>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>((p.len_q + kTileQ - 1) / kTileQ),
                  static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
  tensor_core_kernel<T, kD, kM>
      <<<grid, tc_warps<kM>::kThreads, static_cast<std::size_t>(smem_bytes), stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_tensor_core(const kernel_params& p, elem input, cudaStream_t stream) {
  const bool half = input == elem::f16;
  if (p.head_dim == 64) {
    return half ? launch<__half, 64, kRowTiles>(p, stream)
                : launch<__nv_bfloat16, 64, kRowTiles>(p, stream);
  }
  return half ? launch<__half, 128, kRowTiles>(p, stream)
              : launch<__nv_bfloat16, 128, kRowTiles>(p, stream);
}

}  // namespace flashref::cuda::detail
