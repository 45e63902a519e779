// The SIMT kernel: float32 arithmetic throughout, any head dims up to kSimtMaxHeadDim, any
// strides, input in float32, bf16 or fp16. It is the float32 path of the CUDA backend (SPEC §3's
// float32 tolerances) and the fallback for half-precision problems the tensor-core kernel does
// not cover. One block of 256 threads per 32 query rows; 8 threads share a row: thread g of a
// row scores keys g, g+8, g+16, g+24 of each 32-key tile and accumulates output columns
// g, g+8, g+16, ...

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "common.cuh"
#include "launch.hpp"

namespace flashref::cuda::detail {
namespace {

constexpr int kTileQ = 32;
constexpr int kTileK = 32;
constexpr int kThreads = 256;
constexpr int kLanesPerRow = kThreads / kTileQ;                // 8
constexpr int kKeysPerLane = kTileK / kLanesPerRow;            // 4
constexpr int kMaxCols = int(kSimtMaxHeadDim) / kLanesPerRow;  // 32
constexpr float kMaskedP = -1.0f;  // marks a masked key in sP: it never enters the sum

struct simt_smem {
  int d_pitch, dv_pitch;  // row pitches in floats, padded by one against bank conflicts
  __device__ simt_smem(std::int64_t d, std::int64_t dv)
      : d_pitch(int(d) + 1), dv_pitch(int(dv) + 1) {}
};

std::size_t simt_smem_bytes(std::int64_t d, std::int64_t dv) {
  return sizeof(float) * std::size_t(kTileQ * (d + 1) + kTileK * (d + 1) + kTileK * (dv + 1) +
                                     kTileQ * (kTileK + 1));
}

// Query rows [q0, q0 + kTileQ) of head h, batch b. Every thread of the block calls it.
template <class T>
__device__ void simt_tile(const kernel_params& p, float* s_mem, std::int64_t q0, std::int64_t h,
                          std::int64_t b) {
  const simt_smem lay(p.head_dim, p.head_dim_v);
  float* sQ = s_mem;                       // (kTileQ, D)
  float* sK = sQ + kTileQ * lay.d_pitch;   // (kTileK, D)
  float* sV = sK + kTileK * lay.d_pitch;   // (kTileK, Dv)
  float* sP = sV + kTileK * lay.dv_pitch;  // (kTileQ, kTileK)

  const int r = static_cast<int>(threadIdx.x) / kLanesPerRow;
  const int g = static_cast<int>(threadIdx.x) % kLanesPerRow;
  const std::int64_t hk = h / p.group;
  const std::int64_t q1 = q0 + kTileQ < p.len_q ? q0 + kTileQ : p.len_q;
  const std::int64_t i = q0 + r;
  const std::int64_t D = p.head_dim, Dv = p.head_dim_v;
  const mask_spec& mask = p.mask;

  const T* gQ = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];   // (Lq, D)
  const T* gK = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];  // (Lk, D)
  const T* gV = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];  // (Lk, Dv)

  online_softmax<float> st;  // row i; s is this thread's partial sum
  float acc[kMaxCols] = {};  // columns g + 8c of row i

  tile_walker<kTileK> walker(mask, b, h, q0, q1);
  std::int64_t tile = 0;
  bool tile_full = false;
  bool loaded_q = false;
  while (walker.next(tile, tile_full)) {
    __syncthreads();  // the previous tile's sK, sV, sP are no longer read
    if (!loaded_q) {
      load_rows<kThreads>(sQ, lay.d_pitch, gQ, elem_of<T>(), p.q_stride[2], p.q_stride[3], q0,
                          kTileQ, D, p.len_q);
      loaded_q = true;
    }
    const std::int64_t k0 = tile * kTileK;
    load_rows<kThreads>(sK, lay.d_pitch, gK, elem_of<T>(), p.k_stride[2], p.k_stride[3], k0, kTileK,
                        D, walker.key_end);
    load_rows<kThreads>(sV, lay.dv_pitch, gV, elem_of<T>(), p.v_stride[2], p.v_stride[3], k0,
                        kTileK, Dv, walker.key_end);
    __syncthreads();

    // Scores of keys g + 8u; masked keys at -inf.
    float s[kKeysPerLane];
    float block_max = -INFINITY;
#pragma unroll
    for (int u = 0; u < kKeysPerLane; ++u) {
      const int c = g + kLanesPerRow * u;
      if (!tile_full && !key_visible(mask, b, h, i, k0 + c)) {
        s[u] = -INFINITY;
        continue;
      }
      float dot = 0.f;
      for (std::int64_t d = 0; d < D; ++d)
        dot = fmaf(sQ[r * lay.d_pitch + d], sK[c * lay.d_pitch + d], dot);
      s[u] = dot * p.scale;
      block_max = fmaxf(block_max, s[u]);
    }
    for (int off = 1; off < kLanesPerRow; off *= 2) {
      block_max = fmaxf(block_max, __shfl_xor_sync(kFullWarp, block_max, off));
    }
    // acc = acc * exp(m_old - m_new) + Σ_j exp(s_j - m_new) v_j
    const float exp_old = st.update_max(block_max);
#pragma unroll
    for (int c = 0; c < kMaxCols; ++c)
      acc[c] *= exp_old;
    st.rescale(exp_old);
    float p_sum = 0.f;
#pragma unroll
    for (int u = 0; u < kKeysPerLane; ++u) {
      float pj = kMaskedP;
      if (s[u] != -INFINITY) {
        pj = st.prob(s[u]);
        p_sum += pj;
      }
      sP[r * (kTileK + 1) + g + kLanesPerRow * u] = pj;
    }
    st.absorb(p_sum);
    __syncwarp();  // a row's 8 threads are one warp's consecutive lanes
    for (int j = 0; j < kTileK; ++j) {
      const float pj = sP[r * (kTileK + 1) + j];
      if (pj == kMaskedP) continue;  // a masked key's value is never read
#pragma unroll
      for (int c = 0; c < kMaxCols; ++c) {
        const std::int64_t col = g + kLanesPerRow * c;
        if (col < Dv) acc[c] = fmaf(pj, sV[j * lay.dv_pitch + col], acc[c]);
      }
    }
  }

  // The row's sum is spread over its 8 threads; out = acc / s, or 0 with lse = -inf.
  for (int off = 1; off < kLanesPerRow; off *= 2)
    st.s += __shfl_xor_sync(kFullWarp, st.s, off);
  const finalized<float> fin = st.finalize();
  if (i >= p.len_q) return;
  const std::int64_t o_row = b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2];
#pragma unroll
  for (int c = 0; c < kMaxCols; ++c) {
    const std::int64_t col = g + kLanesPerRow * c;
    if (col < Dv) store_out<T>(p.o, o_row + col * p.o_stride[3], acc[c] * fin.out_scale, p.out);
  }
  if (p.lse != nullptr && g == 0) {
    p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] = fin.lse;
  }
}

// Is one of the gate's flags set? Every thread of the block gets the answer.
__device__ bool gate_open(const std::uint32_t* flags, std::int64_t count) {
  bool any = false;
  for (std::int64_t k = threadIdx.x; k < count; k += kThreads)
    any = any || flags[k] != 0;
  return __syncthreads_or(any) != 0;
}

// Block n takes the work items n, n + gridDim.x, ...; item (b, h, tile) in that order of
// significance, the tiles of a head heaviest first (under a causal mask the last query tiles
// see the most keys). Ungated, the grid has one block per item.
template <class T>
__global__ void __launch_bounds__(kThreads) simt_kernel(const kernel_params p) {
  extern __shared__ float s_mem[];
  if (p.run_if != nullptr && !gate_open(p.run_if, p.run_if_count)) return;
  const std::int64_t tiles = (p.len_q + kTileQ - 1) / kTileQ;
  const std::int64_t items = tiles * p.heads_q * p.batch;
  for (std::int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const std::int64_t tile = tiles - 1 - item % tiles;
    const std::int64_t h = item / tiles % p.heads_q, b = item / (tiles * p.heads_q);
    simt_tile<T>(p, s_mem, tile * kTileQ, h, b);
  }
}

// The blocks of `kernel` that the current device holds at once, remembered per device and
// shared-memory size (the gated launch asks on every call).
template <class T>
cudaError_t one_wave(std::size_t smem_bytes, std::int64_t* wave) {
  constexpr int kDevices = 64;
  constexpr int kDims = int(kSimtMaxHeadDim) + 1;
  static std::atomic<std::int64_t> cache[kDevices][kDims];  // (smem bytes << 32) | wave; 0 unknown
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  const std::size_t slot = (smem_bytes / sizeof(float)) % kDims;
  std::atomic<std::int64_t>* cached = device < kDevices ? &cache[device][slot] : nullptr;
  if (cached != nullptr) {
    const std::int64_t known = cached->load(std::memory_order_relaxed);
    if (known > 0 && known >> 32 == std::int64_t(smem_bytes)) {
      *wave = known & 0xffffffff;
      return cudaSuccess;
    }
  }
  int sms = 0, per_sm = 0;
  e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, simt_kernel<T>, kThreads,
                                                      smem_bytes);
  }
  if (e != cudaSuccess) return e;
  *wave = std::int64_t(sms) * std::max(per_sm, 1);
  if (cached != nullptr) cached->store(std::int64_t(smem_bytes) << 32 | *wave);
  return cudaSuccess;
}

template <class T>
cudaError_t launch(const kernel_params& p, cudaStream_t stream) {
  const std::size_t smem_bytes = simt_smem_bytes(p.head_dim, p.head_dim_v);
  cudaError_t e = cudaFuncSetAttribute(simt_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem_bytes));
  if (e != cudaSuccess) return e;
  constexpr std::int64_t kMaxGridX = 2147483647;
  std::int64_t blocks = (p.len_q + kTileQ - 1) / kTileQ * p.heads_q * p.batch;
  if (p.run_if != nullptr) {  // one wave
    std::int64_t wave = 0;
    e = one_wave<T>(smem_bytes, &wave);
    if (e != cudaSuccess) return e;
    blocks = std::min(blocks, wave);
  }
  const unsigned grid = static_cast<unsigned>(std::min(blocks, kMaxGridX));
  simt_kernel<T><<<grid, kThreads, smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

template <class T>
__global__ void convert_kernel(const float* src, T* dst, std::int64_t n) {
  for (std::int64_t idx = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += std::int64_t(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<T, __half>) {
      dst[idx] = __float2half_rn(src[idx]);
    } else {
      dst[idx] = __float2bfloat16_rn(src[idx]);
    }
  }
}

}  // namespace

cudaError_t launch_simt(const kernel_params& p, elem input, cudaStream_t stream) {
  switch (input) {
    case elem::bf16:
      return launch<__nv_bfloat16>(p, stream);
    case elem::f16:
      return launch<__half>(p, stream);
    default:
      return launch<float>(p, stream);
  }
}

cudaError_t launch_convert(const float* src, void* dst, std::int64_t n, elem to,
                           cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(n / 256 + 1 < 4096 ? n / 256 + 1 : 4096);
  if (to == elem::f16) {
    convert_kernel<<<blocks, 256, 0, stream>>>(src, static_cast<__half*>(dst), n);
  } else {
    convert_kernel<<<blocks, 256, 0, stream>>>(src, static_cast<__nv_bfloat16*>(dst), n);
  }
  return cudaGetLastError();
}

}  // namespace flashref::cuda::detail
