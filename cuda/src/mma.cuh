#pragma once
// The mma.sync building blocks of the tensor-core kernels (forward and backward): cp.async
// copies, ldmatrix, the m16n8k16 product, and the XOR-swizzled shared-memory rows they read.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace flashref::cuda::detail {

// Rows of kD 16-bit elements, 16-byte chunks XOR-swizzled by (row % 8) so that the 8 rows an
// ldmatrix reads at one chunk index fall in 8 different bank groups.
template <int kD>
struct swizzled {
  static constexpr int kChunks = kD / 8;
  __device__ static int offset(int row, int chunk) { return row * kD + ((chunk ^ (row & 7)) << 3); }
};

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, zero-filled when !valid (the source is then not read).
__device__ __forceinline__ void cp_async_16(void* s_dst, const void* g_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(s_dst)),
               "l"(g_src), "r"(src_bytes));
}
// 4 bytes global -> shared, zero-filled when !valid (the source is then not read).
__device__ __forceinline__ void cp_async_4(void* s_dst, const void* g_src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(s_dst)), "l"(g_src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* s_ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(s_ptr)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* s_ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(s_ptr)));
}

// acc (16x8, f32) += a (16x16) * b (16x8)
template <class T>
__device__ __forceinline__ void mma_16816(float (&acc)[4], const std::uint32_t (&a)[4],
                                          std::uint32_t b0, std::uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Copies rows [row0, row0 + kRows) of a (rows, kD) tile to shared memory; rows at or past
// row_end are zero-filled (never read from global memory).
template <class T, int kD, int kRows, int kThreads>
__device__ __forceinline__ void load_tile(T* s_tile, const T* g_base, std::int64_t row_stride,
                                          std::int64_t row0, std::int64_t row_end) {
  constexpr int kChunks = swizzled<kD>::kChunks;
  constexpr int kPerThread = kRows * kChunks / kThreads;
  static_assert(kRows * kChunks % kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int it = 0; it < kPerThread; ++it) {
    const int idx = static_cast<int>(threadIdx.x) + it * kThreads;
    const int row = idx / kChunks;
    const int chunk = idx % kChunks;
    const bool valid = row0 + row < row_end;
    const T* src = valid ? g_base + (row0 + row) * row_stride + chunk * 8 : g_base;
    cp_async_16(s_tile + swizzled<kD>::offset(row, chunk), src, valid);
  }
}

}  // namespace flashref::cuda::detail
