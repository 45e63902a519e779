#pragma once
// The wgmma (warpgroup matrix multiply-accumulate, sm_90a) instructions the Hopper kernel
// issues, one function each. The operand lists are long but regular: the accumulator of an
// m64nNk16 product is N / 2 floats per thread, in the m16n8 layout of mma.sync repeated over N
// (register 4 n8 + e holds row lane / 4 + 8 (e / 2), column 8 n8 + 2 (lane % 4) + e % 2, of
// the 16 rows of this thread's warp).
//
//   wgmma_ss: D (64 x N) (+)= A (64 x 16, shared memory) * B (16 x N, shared memory), both
//             K-major (Q K^T: Q rows and K rows hold the head dim contiguously).
//   wgmma_ss_n64_mn: the same, both MN-major (the backward's dQ = dS K from dSᵀ and K tiles).
//   wgmma_rs: D (64 x N) += A (64 x 16, registers, the mma.sync A-fragment layout per warp)
//             * B (16 x N, shared memory, MN-major: V rows hold the head dim contiguously).
//
// Each call only issues: the caller brackets a batch with wgmma_fence() / wgmma_commit() and
// waits with wgmma_wait<n>() before reading D.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../common.cuh"  // pack2

namespace flashref::cuda::detail::sm90 {

// Orders this thread's register writes to accumulators before the wgmma that reads them.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Tells the compiler that the accumulators may change under it (the asynchronous wgmma writes
// them): no read of them moves across this point.
template <int kN>
__device__ __forceinline__ void fence_operands(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i)
    asm volatile("" : "+f"(d[i])::"memory");
}

// The operand lists, written once: the accumulator's N / 2 registers and their PTX names.
#define FLASHREF_WGMMA_D32_REGS                            \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define FLASHREF_WGMMA_D64_REGS                                      \
  FLASHREF_WGMMA_D32_REGS                                            \
  ","                                                                \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define FLASHREF_WGMMA_D40_REGS \
  FLASHREF_WGMMA_D32_REGS       \
  ","                           \
  "%32,%33,%34,%35,%36,%37,%38,%39"
#define FLASHREF_WGMMA_D32_OPS                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FLASHREF_WGMMA_D40_OPS                                                             \
  FLASHREF_WGMMA_D32_OPS, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), \
      "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
#define FLASHREF_WGMMA_D64_OPS                                                                   \
  FLASHREF_WGMMA_D32_OPS, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),       \
      "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), \
      "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), \
      "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), \
      "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

#define FLASHREF_WGMMA_D88_REGS                                      \
  FLASHREF_WGMMA_D64_REGS                                            \
  ","                                                                \
  "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
  "%80,%81,%82,%83,%84,%85,%86,%87"
#define FLASHREF_WGMMA_D88_OPS                                                                   \
  FLASHREF_WGMMA_D64_OPS, "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]),       \
      "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), \
      "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), \
      "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])

// One instruction, as a statement, in the element type of T (__half: "f16", else "bf16"):
// each form below picks the type string and issues the instruction in it (FLASHREF_WGMMA_SS_AS
// and FLASHREF_WGMMA_RS_AS, whose accumulator operands D_OPS come last, as the variadic
// arguments, so that a list of them passes through one macro into the next).
// ss: D (64 x N) = A B (scale_d == 0) or D + A B (scale_d == 1), A and B in shared memory;
// TRANS "0, 0" for K-major A and B, "1, 1" for both MN-major (the backward's dQ = dS K, dS
// stored key-major and K's rows holding the head dim). DESCS and PRED name the operands that
// follow the accumulator's.
#define FLASHREF_WGMMA_SS_AS(TY, N, TRANS, D_REGS, DESCS, PRED, ...)       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED                    \
               ", 0;\n"                                                    \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY \
               " "                                                         \
               "{" D_REGS "}, " DESCS ", p, 1, 1, " TRANS ";\n}\n"         \
               : __VA_ARGS__                                               \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d))
#define FLASHREF_WGMMA_SS(N, TRANS, D_REGS, DESCS, PRED, ...)                 \
  if constexpr (std::is_same_v<T, __half>) {                                  \
    FLASHREF_WGMMA_SS_AS("f16", N, TRANS, D_REGS, DESCS, PRED, __VA_ARGS__);  \
  } else {                                                                    \
    FLASHREF_WGMMA_SS_AS("bf16", N, TRANS, D_REGS, DESCS, PRED, __VA_ARGS__); \
  }
// rs: D += A B, A (four registers) from registers. A_REGS, DESC and PRED name the operands
// that follow the accumulator's.
#define FLASHREF_WGMMA_RS_AS(TY, N, D_REGS, A_REGS, DESC, PRED, ...)       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED                    \
               ", 0;\n"                                                    \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY \
               " "                                                         \
               "{" D_REGS "}, {" A_REGS "}, " DESC ", p, 1, 1, 1;\n}\n"    \
               : __VA_ARGS__                                               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1))
#define FLASHREF_WGMMA_RS(N, D_REGS, A_REGS, DESC, PRED, ...)                 \
  if constexpr (std::is_same_v<T, __half>) {                                  \
    FLASHREF_WGMMA_RS_AS("f16", N, D_REGS, A_REGS, DESC, PRED, __VA_ARGS__);  \
  } else {                                                                    \
    FLASHREF_WGMMA_RS_AS("bf16", N, D_REGS, A_REGS, DESC, PRED, __VA_ARGS__); \
  }

// D (64 x 128) = A B (scale_d == 0) or D + A B (scale_d == 1).
template <class T>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], std::uint64_t desc_a,
                                              std::uint64_t desc_b, int scale_d) {
  FLASHREF_WGMMA_SS(128, "0, 0", FLASHREF_WGMMA_D64_REGS, "%64, %65", "%66", FLASHREF_WGMMA_D64_OPS)
}

// D (64 x 176) = A B (scale_d == 0) or D + A B (scale_d == 1).
template <class T>
__device__ __forceinline__ void wgmma_ss_n176(float (&d)[88], std::uint64_t desc_a,
                                              std::uint64_t desc_b, int scale_d) {
  FLASHREF_WGMMA_SS(176, "0, 0", FLASHREF_WGMMA_D88_REGS, "%88, %89", "%90", FLASHREF_WGMMA_D88_OPS)
}

// D (64 x 64) = A B (scale_d == 0) or D + A B (scale_d == 1).
template <class T>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], std::uint64_t desc_a,
                                             std::uint64_t desc_b, int scale_d) {
  FLASHREF_WGMMA_SS(64, "0, 0", FLASHREF_WGMMA_D32_REGS, "%32, %33", "%34", FLASHREF_WGMMA_D32_OPS)
}

// D (64 x 80) = A B (scale_d == 0) or D + A B (scale_d == 1).
template <class T>
__device__ __forceinline__ void wgmma_ss_n80(float (&d)[40], std::uint64_t desc_a,
                                             std::uint64_t desc_b, int scale_d) {
  FLASHREF_WGMMA_SS(80, "0, 0", FLASHREF_WGMMA_D40_REGS, "%40, %41", "%42", FLASHREF_WGMMA_D40_OPS)
}

// The same with both operands MN-major: A (64 x 16) stored as 16 rows of its 64 rows' values
// (A's columns contiguous), B (16 x 64) as 16 rows of 64 columns.
template <class T>
__device__ __forceinline__ void wgmma_ss_n64_mn(float (&d)[32], std::uint64_t desc_a,
                                                std::uint64_t desc_b, int scale_d) {
  FLASHREF_WGMMA_SS(64, "1, 1", FLASHREF_WGMMA_D32_REGS, "%32, %33", "%34", FLASHREF_WGMMA_D32_OPS)
}

// D (64 x 64) += A B, A from registers.
template <class T>
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const std::uint32_t (&a)[4],
                                             std::uint64_t desc_b) {
  FLASHREF_WGMMA_RS(64, FLASHREF_WGMMA_D32_REGS, "%32,%33,%34,%35", "%36", "%37",
                    FLASHREF_WGMMA_D32_OPS)
}

// D (64 x 128) += A B, A from registers.
template <class T>
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const std::uint32_t (&a)[4],
                                              std::uint64_t desc_b) {
  FLASHREF_WGMMA_RS(128, FLASHREF_WGMMA_D64_REGS, "%64,%65,%66,%67", "%68", "%69",
                    FLASHREF_WGMMA_D64_OPS)
}

#undef FLASHREF_WGMMA_RS
#undef FLASHREF_WGMMA_RS_AS
#undef FLASHREF_WGMMA_SS
#undef FLASHREF_WGMMA_SS_AS
#undef FLASHREF_WGMMA_D88_OPS
#undef FLASHREF_WGMMA_D64_OPS
#undef FLASHREF_WGMMA_D40_OPS
#undef FLASHREF_WGMMA_D32_OPS
#undef FLASHREF_WGMMA_D88_REGS
#undef FLASHREF_WGMMA_D64_REGS
#undef FLASHREF_WGMMA_D40_REGS
#undef FLASHREF_WGMMA_D32_REGS

// An accumulator (64, kN / 2 columns: this thread's kN floats) as wgmma A fragments, one per 16
// columns: the accumulator layout over columns [16 kk, 16 kk + 16) is the A-operand layout of
// an m64k16 product (P of the forward, Pᵀ and dS of the backward).
template <class T, int kN>
__device__ __forceinline__ void to_a_fragments(const float (&s)[kN],
                                               std::uint32_t (&a)[kN / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < kN / 8; ++kk) {
    a[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
    a[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
    a[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
    a[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

// S (64, kN) = Q K^T over the head dim: one m64nN wgmma per 16 columns of it.
// Keeps the A fragments of an in-flight wgmma alive in their registers: the compiler sees
// them read here, so it cannot reuse those registers before the wgmma that reads them ends.
template <int kN>
__device__ __forceinline__ void fence_fragments(std::uint32_t (&a)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      asm volatile("" : "+r"(a[i][e])::"memory");
}

}  // namespace flashref::cuda::detail::sm90
