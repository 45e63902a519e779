// The tensor-core backward (bf16 / fp16 inputs, fp32 accumulation), FlashAttention-2 order
// (Dao 2023) on mma.sync m16n8k16, in two kernels that each own what they write, so that every
// sum has one fixed order (bitwise deterministic):
//
//  - dK, dV: one block of 4 warps per 64 keys of one key/value head. K_j and V_j stay in shared
//    memory; warp w owns keys 16w..16w+15 and holds their dK, dV in registers. The block walks
//    the query heads of the GQA group and, for each, only the query tiles that see its keys
//    (query_tile_walker: the block mask read column-wise), Q_i, dO_i, LSE_i, Delta_i streaming
//    through shared memory with cp.async, two stages deep. Working key-major, the products
//    come out in the layout the next product takes as its A operand, with no shared-memory
//    round trip:
//        Sᵀ = K_j Q_iᵀ,  dPᵀ = V_j dO_iᵀ               (16 keys x 64 rows per warp)
//        Pᵀ = exp(Sᵀ scale − LSE_i),  dSᵀ = Pᵀ ∘ (dPᵀ − Delta_i)
//        dV_j += Pᵀ dO_i,  dK_j += dSᵀ Q_i              (dK scaled once at the end)
//    A key tile no row sees writes dK = dV = 0 without loading anything.
//  - dQ: one block of 4 warps per 64 query rows (16 per warp), the forward's structure: the key
//    tiles the rows see (tile_walker) stream through shared memory,
//        S = Q_i K_jᵀ, dP = dO_i V_jᵀ, dS = P ∘ (dP − Delta), dQ_i += dS K_j.
//
// dQ by atomics instead (the dK, dV kernel adding dS K_j to a float32 dQ, as FlashAttention-2
// does) measured slower than the separate pass and is not kept (cuda/NOTES.md).
//
// P and dS are rounded to the input type before their products (SPEC §9). A masked pair gets
// P = dS = 0 by selection, never by a product, and a full tile skips the element mask.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common.cuh"
#include "launch.hpp"
#include "mma.cuh"

namespace flashref::cuda::detail {
namespace {

constexpr int kTileK = 64;  // keys per dK, dV block; keys per tile of the dQ kernel
constexpr int kTileQ = 64;  // rows per query tile of the dK, dV kernel; rows per dQ block
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
static_assert(kTileK == 16 * kWarps && kTileQ == 16 * kWarps, "16 keys (rows) per warp");
// The tiles' other side is taken kSubQ rows (kSubK keys) at a time: at D = 128 the 32 + 32
// registers of a 64-wide Sᵀ and dPᵀ do not fit beside dK and dV (ptxas spills).
template <int kD>
inline constexpr int kSubQ = kD == 128 ? 16 : 64;
template <int kD>
inline constexpr int kSubK = kD == 128 ? 32 : 64;

// acc (16 x kN) += A Bᵀ: A rows a_row0 + [0, 16) of sA (rows of kD), B the kN rows of sB.
template <class T, int kD, int kN>
__device__ __forceinline__ void mma_abt(float (&acc)[kN / 8][4], const T* sA, int a_row0,
                                        const T* sB, int lane) {
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    std::uint32_t af[4];
    ldmatrix_x4(af, sA + swizzled<kD>::offset(a_row0 + lane % 8 + ((lane / 8) % 2) * 8,
                                              2 * ks + lane / 16));
#pragma unroll
    for (int nb = 0; nb < kN / 8; nb += 2) {
      std::uint32_t bf[4];
      ldmatrix_x4(bf, sB + swizzled<kD>::offset(nb * 8 + (lane / 16) * 8 + lane % 8,
                                                2 * ks + (lane / 8) % 2));
      mma_16816<T>(acc[nb], af, bf[0], bf[1]);
      mma_16816<T>(acc[nb + 1], af, bf[2], bf[3]);
    }
  }
}

// acc (16 x 8 kCols) += P B[:, c0 : c0 + 8 kCols]: P (16 x kN) in accumulator registers,
// rounded to T; B the kN rows of sB (rows of kD), read transposed. c0 in units of 8 columns.
template <class T, int kD, int kN, int kCols>
__device__ __forceinline__ void mma_pb(float (&acc)[kCols][4], const float (&p)[kN / 8][4],
                                       const T* sB, int c0, int lane) {
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    const std::uint32_t pf[4] = {
        pack2<T>(p[2 * kk][0], p[2 * kk][1]), pack2<T>(p[2 * kk][2], p[2 * kk][3]),
        pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int nb = 0; nb < kCols; nb += 2) {
      std::uint32_t bf[4];
      ldmatrix_x4_trans(bf, sB + swizzled<kD>::offset(kk * 16 + lane % 8 + ((lane / 8) % 2) * 8,
                                                      c0 + nb + lane / 16));
      mma_16816<T>(acc[nb], pf, bf[0], bf[1]);
      mma_16816<T>(acc[nb + 1], pf, bf[2], bf[3]);
    }
  }
}

// P = exp(S scale − LSE) through the guard (exp_base: an empty row's LSE = −inf counts as 0,
// and every score of such a row is masked), dS = P (dP − Delta); masked pairs 0 by selection.
// s becomes P and dp becomes dS.
__device__ __forceinline__ void probabilities_and_ds(float& s, float& dp, bool on, float lse,
                                                     float delta, float scale) {
  const float base_log2 = online_softmax<float>::exp_base(lse) * kLog2e;
  const float pij = on ? fast_exp2(fmaf(s * scale, kLog2e, -base_log2)) : 0.f;
  dp = on ? pij * (dp - delta) : 0.f;
  s = pij;
}

template <int kD>
struct dkdv_smem {
  static constexpr int kKV = kTileK * kD;  // sK, sV: (kTileK, kD)
  static constexpr int kQ = kTileQ * kD;   // sQ[s], sdO[s]: (kTileQ, kD)
  static constexpr int kElems = 2 * kKV + 4 * kQ;
  static constexpr int kFloats = 4 * kTileQ;  // sLSE[s], sDelta[s]: (kTileQ)
  static constexpr int kBytes = kElems * 2 + kFloats * 4;
};

template <class T, int kD>
__global__ void __launch_bounds__(kThreads, 1) tc_dkdv_kernel(const backward_params bp) {
  using smem = dkdv_smem<kD>;
  constexpr int kCols = kD / 8;  // n8 blocks of dK, dV
  const kernel_params& p = bp.fwd;
  extern __shared__ __align__(128) unsigned char s_raw[];
  T* sK = reinterpret_cast<T*>(s_raw);                         // (kTileK, kD)
  T* sV = sK + smem::kKV;                                      // (kTileK, kD)
  T* sQ = sV + smem::kKV;                                      // (2, kTileQ, kD)
  T* sdO = sQ + 2 * smem::kQ;                                  // (2, kTileQ, kD)
  float* sLSE = reinterpret_cast<float*>(sdO + 2 * smem::kQ);  // (2, kTileQ)
  float* sDelta = sLSE + 2 * kTileQ;                           // (2, kTileQ)

  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t k0 = std::int64_t(blockIdx.x) * kTileK;
  const std::int64_t hk = blockIdx.y, b = blockIdx.z;
  const std::int64_t k1 = k0 + kTileK < p.len_k ? k0 + kTileK : p.len_k;
  const mask_spec& mask = p.mask;
  const std::int64_t key_end = mask.key_end(b);
  // A tile running past the last key has keys that do not exist: element-mask it.
  const bool keys_past_end = k0 + kTileK > p.len_k;
  // This thread's keys in the m16n8 layout: key_a and key_a + 8.
  const std::int64_t key_a = k0 + warp * 16 + lane / 4;

  float rdK[kCols][4] = {};  // (16, kD) per warp: dK / scale
  float rdV[kCols][4] = {};  // (16, kD) per warp

  auto load_rows_of = [&](int stage, std::int64_t h, std::int64_t tile) {
    const std::int64_t q0 = tile * kTileQ;
    const T* gQ = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];
    const T* gdO = static_cast<const T*>(bp.d_o) + b * bp.d_o_stride[0] + h * bp.d_o_stride[1];
    load_tile<T, kD, kTileQ, kThreads>(sQ + stage * smem::kQ, gQ, p.q_stride[2], q0, p.len_q);
    load_tile<T, kD, kTileQ, kThreads>(sdO + stage * smem::kQ, gdO, bp.d_o_stride[2], q0, p.len_q);
    for (int r = static_cast<int>(threadIdx.x); r < kTileQ; r += kThreads) {
      const std::int64_t i = q0 + r;
      const bool valid = i < p.len_q;
      const float* lse =
          p.lse + (valid ? b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2] : 0);
      const float* delta = bp.delta + (valid ? (b * p.heads_q + h) * p.len_q + i : 0);
      cp_async_4(sLSE + stage * kTileQ + r, lse, valid);
      cp_async_4(sDelta + stage * kTileQ + r, delta, valid);
    }
  };

  query_tile_walker<kTileQ> walker(mask, b, hk * p.group, (hk + 1) * p.group, k0, k1);
  std::int64_t h = 0, tile = 0;
  bool tile_full = false;
  bool have = walker.next(h, tile, tile_full);
  if (have) {
    const T* gK = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
    const T* gV = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];
    load_tile<T, kD, kTileK, kThreads>(sK, gK, p.k_stride[2], k0, key_end);
    load_tile<T, kD, kTileK, kThreads>(sV, gV, p.v_stride[2], k0, key_end);
    load_rows_of(0, h, tile);
  }
  cp_async_commit();

  int stage = 0;
  while (have) {
    std::int64_t next_h = 0, next_tile = 0;
    bool next_full = false;
    const bool have_next = walker.next(next_h, next_tile, next_full);
    if (have_next) load_rows_of(stage ^ 1, next_h, next_tile);  // released by the last barrier
    cp_async_commit();
    cp_async_wait<1>();  // this tile's group has landed
    __syncthreads();

    const T* sQs = sQ + stage * smem::kQ;        // (kTileQ, kD)
    const T* sdOs = sdO + stage * smem::kQ;      // (kTileQ, kD)
    const float* sL = sLSE + stage * kTileQ;     // (kTileQ)
    const float* sDl = sDelta + stage * kTileQ;  // (kTileQ)
    const std::int64_t q0 = tile * kTileQ;

#pragma unroll 1
    for (int r0 = 0; r0 < kTileQ; r0 += kSubQ<kD>) {  // rows [r0, r0 + kSubQ) of the tile
      constexpr int kN = kSubQ<kD>;
      const T* sQr = sQs + r0 * kD;    // (kN, kD)
      const T* sdOr = sdOs + r0 * kD;  // (kN, kD)
      float rS[kN / 8][4] = {};        // (16 keys, kN rows) per warp: Sᵀ, then Pᵀ
      float rdP[kN / 8][4] = {};       // dPᵀ, then dSᵀ
      mma_abt<T, kD, kN>(rS, sK, warp * 16, sQr, lane);
      mma_abt<T, kD, kN>(rdP, sV, warp * 16, sdOr, lane);

      // Bit 2 nb + c of visible[r]: row q0 + r0 + 8 nb + 2 (lane % 4) + c sees key_a + 8 r.
      std::uint32_t visible[2] = {~0u, ~0u};
      if (!tile_full || keys_past_end) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          visible[r] = query_bits<kN / 8>(mask, b, h, key_a + 8 * r, q0 + r0 + (lane % 4) * 2);
        }
      }
#pragma unroll
      for (int nb = 0; nb < kN / 8; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = r0 + nb * 8 + (lane % 4) * 2 + e % 2;
          const bool on = fragment_bit(visible, nb, e);
          probabilities_and_ds(rS[nb][e], rdP[nb][e], on, sL[row], sDl[row], p.scale);
        }
      }

      mma_pb<T, kD, kN, kCols>(rdV, rS, sdOr, 0, lane);  // dV += Pᵀ dO
      mma_pb<T, kD, kN, kCols>(rdK, rdP, sQr, 0, lane);  // dK += dSᵀ Q
    }
    __syncthreads();  // every warp is done with this stage before it is refilled

    have = have_next;
    h = next_h;
    tile = next_tile;
    tile_full = next_full;
    stage ^= 1;
  }
  cp_async_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::int64_t j = key_a + 8 * r;
    if (j >= p.len_k) continue;
    const std::int64_t dk_row = b * bp.dk_stride[0] + hk * bp.dk_stride[1] + j * bp.dk_stride[2];
    const std::int64_t dv_row = b * bp.dv_stride[0] + hk * bp.dv_stride[1] + j * bp.dv_stride[2];
#pragma unroll
    for (int nb = 0; nb < kCols; ++nb) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const std::int64_t d = nb * 8 + (lane % 4) * 2 + c;
        store_out<T>(bp.dk, dk_row + d * bp.dk_stride[3], p.scale * rdK[nb][2 * r + c],
                     bp.grad_out);
        store_out<T>(bp.dv, dv_row + d * bp.dv_stride[3], rdV[nb][2 * r + c], bp.grad_out);
      }
    }
  }
}

template <int kD>
struct dq_smem {
  static constexpr int kQ = kTileQ * kD;   // sQ, sdO: (kTileQ, kD)
  static constexpr int kKV = kTileK * kD;  // sK[s], sV[s]: (kTileK, kD)
  static constexpr int kBytes = (2 * kQ + 4 * kKV) * 2;
};

template <class T, int kD>
__global__ void __launch_bounds__(kThreads) tc_dq_kernel(const backward_params bp) {
  using smem = dq_smem<kD>;
  constexpr int kCols = kD / 8;  // n8 blocks of dQ
  const kernel_params& p = bp.fwd;
  extern __shared__ __align__(128) unsigned char s_raw[];
  T* sQ = reinterpret_cast<T*>(s_raw);  // (kTileQ, kD)
  T* sdO = sQ + smem::kQ;               // (kTileQ, kD)
  T* sK = sdO + smem::kQ;               // (2, kTileK, kD)
  T* sV = sK + 2 * smem::kKV;           // (2, kTileK, kD)

  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  // Heavy query tiles first: under a causal mask the last tiles see the most keys.
  const std::int64_t q0 = (std::int64_t(gridDim.x) - 1 - blockIdx.x) * kTileQ;
  const std::int64_t h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const std::int64_t q1 = q0 + kTileQ < p.len_q ? q0 + kTileQ : p.len_q;
  const mask_spec& mask = p.mask;
  const std::int64_t row_a = q0 + warp * 16 + lane / 4;  // this thread's rows: row_a, row_a + 8

  float lse[2], delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::int64_t i = row_a + 8 * r;
    const bool valid = i < p.len_q;
    lse[r] =
        valid ? p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] : -INFINITY;
    delta[r] = valid ? bp.delta[(b * p.heads_q + h) * p.len_q + i] : 0.f;
  }

  const T* gK = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
  const T* gV = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];
  float rdQ[kCols][4] = {};  // (16, kD) per warp: dQ / scale

  tile_walker<kTileK> walker(mask, b, h, q0, q1);
  std::int64_t tile = 0;
  bool tile_full = false;
  bool have = walker.next(tile, tile_full);
  if (have) {
    const T* gQ = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];
    const T* gdO = static_cast<const T*>(bp.d_o) + b * bp.d_o_stride[0] + h * bp.d_o_stride[1];
    load_tile<T, kD, kTileQ, kThreads>(sQ, gQ, p.q_stride[2], q0, p.len_q);
    load_tile<T, kD, kTileQ, kThreads>(sdO, gdO, bp.d_o_stride[2], q0, p.len_q);
    load_tile<T, kD, kTileK, kThreads>(sK, gK, p.k_stride[2], tile * kTileK, walker.key_end);
    load_tile<T, kD, kTileK, kThreads>(sV, gV, p.v_stride[2], tile * kTileK, walker.key_end);
  }
  cp_async_commit();

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

#pragma unroll 1
    for (int c0 = 0; c0 < kTileK; c0 += kSubK<kD>) {  // keys [c0, c0 + kSubK) of the tile
      constexpr int kN = kSubK<kD>;
      const T* sKc = sKs + c0 * kD;  // (kN, kD)
      const T* sVc = sVs + c0 * kD;  // (kN, kD)
      float rS[kN / 8][4] = {};      // (16 rows, kN keys) per warp: S, then P
      float rdP[kN / 8][4] = {};     // dP, then dS
      mma_abt<T, kD, kN>(rS, sQ, warp * 16, sKc, lane);
      mma_abt<T, kD, kN>(rdP, sdO, warp * 16, sVc, lane);

      // Bit 2 nb + c of visible[r]: row row_a + 8 r sees key k0 + c0 + 8 nb + 2 (lane % 4) + c.
      std::uint32_t visible[2] = {~0u, ~0u};
      if (!tile_full) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          visible[r] =
              key_bits<kN / 8>(mask, b, h, row_a + 8 * r, tile * kTileK + c0 + (lane % 4) * 2);
        }
      }
#pragma unroll
      for (int nb = 0; nb < kN / 8; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool on = fragment_bit(visible, nb, e);
          probabilities_and_ds(rS[nb][e], rdP[nb][e], on, lse[e / 2], delta[e / 2], p.scale);
        }
      }
      mma_pb<T, kD, kN, kCols>(rdQ, rdP, sKc, 0, lane);  // dQ += dS K
    }
    __syncthreads();  // every warp is done with this stage before it is refilled

    have = have_next;
    tile = next_tile;
    tile_full = next_full;
    stage ^= 1;
  }
  cp_async_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::int64_t i = row_a + 8 * r;
    if (i >= p.len_q) continue;
    const std::int64_t dq_row = b * bp.dq_stride[0] + h * bp.dq_stride[1] + i * bp.dq_stride[2];
#pragma unroll
    for (int nb = 0; nb < kCols; ++nb) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const std::int64_t d = nb * 8 + (lane % 4) * 2 + c;
        store_out<T>(bp.dq, dq_row + d * bp.dq_stride[3], p.scale * rdQ[nb][2 * r + c],
                     bp.grad_out);
      }
    }
  }
}

template <class T, int kD>
cudaError_t launch_bwd(const backward_params& bp, cudaStream_t stream) {
  const kernel_params& p = bp.fwd;
  cudaError_t e = cudaFuncSetAttribute(
      tc_dkdv_kernel<T, kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, dkdv_smem<kD>::kBytes);
  if (e != cudaSuccess) return e;
  e = cudaFuncSetAttribute(tc_dq_kernel<T, kD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           dq_smem<kD>::kBytes);
  if (e != cudaSuccess) return e;
  if (p.len_k > 0 && p.heads_k > 0 && p.batch > 0) {
    const dim3 grid(static_cast<unsigned>((p.len_k + kTileK - 1) / kTileK),
                    static_cast<unsigned>(p.heads_k), static_cast<unsigned>(p.batch));
    tc_dkdv_kernel<T, kD><<<grid, kThreads, dkdv_smem<kD>::kBytes, stream>>>(bp);
  }
  if (p.len_q > 0 && p.heads_q > 0 && p.batch > 0) {
    const dim3 grid(static_cast<unsigned>((p.len_q + kTileQ - 1) / kTileQ),
                    static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
    tc_dq_kernel<T, kD><<<grid, kThreads, dq_smem<kD>::kBytes, stream>>>(bp);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_tensor_core_backward(const backward_params& bp, elem input,
                                        cudaStream_t stream) {
  const bool half = input == elem::f16;
  if (bp.fwd.head_dim == 64) {
    return half ? launch_bwd<__half, 64>(bp, stream) : launch_bwd<__nv_bfloat16, 64>(bp, stream);
  }
  return half ? launch_bwd<__half, 128>(bp, stream) : launch_bwd<__nv_bfloat16, 128>(bp, stream);
}

}  // namespace flashref::cuda::detail
