// The scan of V for NaN and inf that lets the device entry keep SPEC §2's rule on the
// tensor-core kernels (cuda/NOTES.md, "NaN or inf in V"): one pass over V in 16-byte loads,
// one flag per block, no atomics and no zeroing beforehand.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "launch.hpp"

namespace flashref::cuda::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;       // independent 16-byte loads in flight per thread
constexpr int kBlocksPerSm = 8;  // 2048 threads per SM: one wave fills the device
constexpr std::int64_t kMaxGridY = 65535;

// A 32-bit word of two bf16 (exponent 0x7f80) or two f16 (exponent 0x7c00) values: is either
// half NaN or inf (exponent bits all set)?
template <std::uint32_t kExp>
__device__ __forceinline__ bool nonfinite_pair(std::uint32_t w) {
  return (w & kExp) == kExp || (w & (kExp << 16)) == (kExp << 16);
}

template <std::uint32_t kExp>
__device__ __forceinline__ bool nonfinite_vec(const uint4& x) {
  return nonfinite_pair<kExp>(x.x) || nonfinite_pair<kExp>(x.y) || nonfinite_pair<kExp>(x.z) ||
         nonfinite_pair<kExp>(x.w);
}

// V (B, Hk, Lk, Dv) as 16-byte vectors: block row y takes the (b, h) pairs y, y + gridDim.y,
// ...; within a pair, the threads of the blocks of that row take vector n = l * per_row + c
// (key l, columns [8c, 8c + 8)) in a grid-stride loop, kUnroll loads at a time.
template <std::uint32_t kExp>
__global__ void __launch_bounds__(kThreads)
    nonfinite_scan_kernel(const unsigned char* g_v,  // (B, Hk, Lk, Dv), strides in bytes below
                          std::int64_t stride_b, std::int64_t stride_h, std::int64_t stride_l,
                          std::int64_t heads, std::int64_t pairs, std::int64_t len,
                          int per_row_log2, std::uint32_t* g_flags) {
  bool bad = false;
  const std::int64_t per_pair = len << per_row_log2;
  const std::int64_t step = std::int64_t(gridDim.x) * kThreads;
  const std::int64_t column_mask = (std::int64_t(1) << per_row_log2) - 1;
  const auto load = [&](const unsigned char* base, std::int64_t n) {
    const std::int64_t l = n >> per_row_log2, c = n & column_mask;
    return __ldg(reinterpret_cast<const uint4*>(base + l * stride_l + c * 16));
  };
  for (std::int64_t bh = blockIdx.y; bh < pairs; bh += gridDim.y) {
    const unsigned char* base = g_v + bh / heads * stride_b + bh % heads * stride_h;
    std::int64_t n = std::int64_t(blockIdx.x) * kThreads + threadIdx.x;
    for (; n + (kUnroll - 1) * step < per_pair; n += kUnroll * step) {
      uint4 x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        x[u] = load(base, n + u * step);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        bad = bad || nonfinite_vec<kExp>(x[u]);
    }
    for (; n < per_pair; n += step)
      bad = bad || nonfinite_vec<kExp>(load(base, n));
  }
  const int any = __syncthreads_or(bad);
  if (threadIdx.x == 0) g_flags[std::int64_t(blockIdx.y) * gridDim.x + blockIdx.x] = any ? 1 : 0;
}

int log2_exact(std::int64_t x) {
  int k = 0;
  while ((std::int64_t(1) << k) < x)
    ++k;
  return k;
}

}  // namespace

dim3 nonfinite_scan_grid(const kernel_params& p, int sm_count) {
  const std::int64_t target = std::int64_t(std::max(sm_count, 1)) * kBlocksPerSm;
  const std::int64_t pairs = p.batch * p.heads_k;
  const std::int64_t per_pair = p.len_k * (p.head_dim_v / 8);
  const std::int64_t y = std::max<std::int64_t>(1, std::min({pairs, kMaxGridY, target}));
  const std::int64_t x_needed = (per_pair + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  const std::int64_t x = std::max<std::int64_t>(1, std::min(x_needed, target / y));
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y));
}

cudaError_t launch_nonfinite_scan(const kernel_params& p, elem input, dim3 grid,
                                  std::uint32_t* flags, cudaStream_t stream) {
  // Vectors of 8 elements per row: Dv / 8, a power of two for the head dims that reach here.
  const std::int64_t per_row = p.head_dim_v / 8;
  const int per_row_log2 = log2_exact(per_row);
  if (p.head_dim_v % 8 != 0 || (std::int64_t(1) << per_row_log2) != per_row) {
    return cudaErrorInvalidValue;
  }
  const auto* v = static_cast<const unsigned char*>(p.v);
  const std::int64_t sb = p.v_stride[0] * 2, sh = p.v_stride[1] * 2, sl = p.v_stride[2] * 2;
  const std::int64_t pairs = p.batch * p.heads_k;
  if (input == elem::f16) {
    nonfinite_scan_kernel<0x7c00u><<<grid, kThreads, 0, stream>>>(v, sb, sh, sl, p.heads_k, pairs,
                                                                  p.len_k, per_row_log2, flags);
  } else {
    nonfinite_scan_kernel<0x7f80u><<<grid, kThreads, 0, stream>>>(v, sb, sh, sl, p.heads_k, pairs,
                                                                  p.len_k, per_row_log2, flags);
  }
  return cudaGetLastError();
}

}  // namespace flashref::cuda::detail
