#pragma once
// Host side of TMA: tensor maps over the problem's (B, H, L, D) tensors, built with the driver's
// cuTensorMapEncodeTiled (found through the runtime, so that nothing links libcuda). Shared by
// the Hopper forward (hopper.cu) and backward (hopper_backward.cu).

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "../launch.hpp"
#include "tiles.cuh"

namespace flashref::cuda::detail::sm90 {

// cuTensorMapEncodeTiled from the driver, found through the runtime (no link to libcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      ptr = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// A (D, L, H, B) map over a (B, H, L, D) tensor with the given element strides; boxes of
// (64, rows, 1, 1) written to shared memory in the 128-byte swizzle layout; reads past the
// extent give zeros. A dimension of extent 1 gets a nominal stride (its coordinate is 0).
inline cudaError_t make_map(CUtensorMap* map, const void* base, elem input, std::int64_t B,
                            std::int64_t H, std::int64_t L, std::int64_t D,
                            const std::int64_t* stride, int rows) {
  const auto fn = encode_tiled();
  if (fn == nullptr) return cudaErrorNotSupported;
  // No extent may be 0; with L, H or B = 0 no tile is ever loaded, so any extent describes it
  // (the backward's dK, dV kernel runs with Hq = 0 to write zeros, and builds Q's map).
  L = L > 0 ? L : 1;
  H = H > 0 ? H : 1;
  B = B > 0 ? B : 1;
  const cuuint64_t dims[4] = {cuuint64_t(D), cuuint64_t(L), cuuint64_t(H), cuuint64_t(B)};
  cuuint64_t strides[3];
  std::int64_t packed = D * 2;
  const std::int64_t extent[3] = {L, H, B};
  for (int i = 0; i < 3; ++i) {
    const std::int64_t bytes = stride[2 - i] * 2;
    strides[i] = cuuint64_t(extent[i] == 1 || bytes <= 0 ? (packed + 15) / 16 * 16 : bytes);
    packed = std::int64_t(strides[i]) * extent[i];
  }
  const cuuint32_t box[4] = {cuuint32_t(kBoxCols), cuuint32_t(rows), 1, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUresult r = fn(
      map, input == elem::f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
      4, const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace flashref::cuda::detail::sm90
