#pragma once
// The Hopper (sm_90a) instructions besides wgmma that the Hopper kernel uses, written as PTX:
// mbarrier (transaction-counting shared-memory barriers), TMA (cp.async.bulk.tensor, the
// bulk tensor copy engine), the proxy fence, setmaxnreg, and wgmma's shared-memory matrix
// descriptors. Every address here is a shared-memory (shared::cta) address.

#include <cuda.h>

#include <cstdint>

// 1 in the sm_90a pass of the compiler, where these instructions exist; the kernels compile
// empty in the other passes (the dispatcher launches them on compute capability 9.0 alone).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASHREF_SM90A 1
#else
#define FLASHREF_SM90A 0
#endif

namespace flashref::cuda::detail::sm90 {

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// --- mbarrier --------------------------------------------------------------------------------
// A phase completes when `count` arrivals have been made and every expected transaction byte
// has landed; waiters name the phase by its parity (0, 1, 0, ...).

__device__ __forceinline__ void mbar_init(std::uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
// Makes the initialised barriers visible to the copy engine and the other threads.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// One arrival that also announces `bytes` of copies completing on this barrier.
__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
// `count` arrivals at once (standing in for arrivals that have nothing to wait for).
__device__ __forceinline__ void mbar_arrive_count(std::uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}
// One arrival; returns the state of the phase it arrived on, for mbar_wait_state.
__device__ __forceinline__ std::uint64_t mbar_arrive_state(std::uint64_t* bar) {
  std::uint64_t state;
  asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n"
               : "=l"(state)
               : "r"(smem_addr(bar))
               : "memory");
  return state;
}
// Waits until the phase that `state` names (mbar_arrive_state) has completed.
__device__ __forceinline__ void mbar_wait_state(std::uint64_t* bar, std::uint64_t state) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_STATE:\n"
      "mbarrier.try_wait.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_STATE;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "l"(state)
      : "memory");
}
// Waits until the phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(std::uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_AGAIN:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_AGAIN;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// --- TMA -------------------------------------------------------------------------------------

// Copies the box at coordinates (c0, c1, c2, c3) (innermost first) of a 4-d tensor map to
// shared memory; the bytes count on `bar`. Coordinates past the tensor's extent read zeros.
__device__ __forceinline__ void tma_load_4d(void* s_dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, int c3, std::uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_addr(s_dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(smem_addr(bar))
      : "memory");
}
// Shared memory (a box in the map's layout) to the box at coordinates (c0, c1, c2, c3) of a 4-d
// tensor map, in a bulk group (bulk_commit, bulk_wait_read below); the parts of the box past
// the tensor's extent are not written.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* s_src, int c0,
                                             int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<std::uint64_t>(map)),
      "r"(smem_addr(s_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// Four 8 x 8 matrices of 16-bit elements from the warp's registers to shared memory: lane t
// gives the address of row t % 8 of matrix t / 8, and x[m] is the lane's pair of matrix m (row
// lane / 4, columns 2 (lane % 4) and 2 (lane % 4) + 1), as an accumulator fragment holds it.
__device__ __forceinline__ void stmatrix_x4(std::uint32_t addr, const std::uint32_t (&x)[4]) {
  asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3])
               : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<std::uint64_t>(map)) : "memory");
}

// Orders this thread's ordinary shared-memory stores before later reads by the async proxy
// (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// --- named barriers and bulk reductions ------------------------------------------------------

// Named barrier `id` (1..15; 0 is __syncthreads) over `count` threads, a multiple of 32.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// dst[0 .. bytes / 4) += src[...] (float32), by the bulk copy engine; commit and wait below.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const void* s_src, unsigned bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
      "r"(smem_addr(s_src)), "r"(bytes)
      : "memory");
}
// dst[0 .. bytes / 4) += src[...] (32-bit integers, two's complement: the sum is the same
// whatever the order of the additions), by the bulk copy engine.
__device__ __forceinline__ void bulk_reduce_add_s32(std::int32_t* dst, const void* s_src,
                                                    unsigned bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u32 [%0], [%1], %2;\n" ::"l"(dst),
      "r"(smem_addr(s_src)), "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// The committed bulk operations have read their shared-memory source.
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// The committed bulk operations are complete (their writes performed).
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// --- registers -------------------------------------------------------------------------------

// Lowers (dec) or raises (inc) this warpgroup's per-thread register budget.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// The block's coordinates and the thread's index by volatile moves from the special registers:
// read where they are needed after a long loop, they hold no register across it (a plain read
// of blockIdx or threadIdx the compiler may merge with one before the loop and keep live).
struct block_ids {
  unsigned x, y, z, tid;
};
// This thread's index in the block and its lane, read the same way.
__device__ __forceinline__ unsigned read_tid() {
  unsigned tid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  return tid;
}
__device__ __forceinline__ unsigned read_lane() {
  unsigned lane;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lane));
  return lane;
}
__device__ __forceinline__ block_ids read_block_ids() {
  block_ids ids;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(ids.x));
  asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(ids.y));
  asm volatile("mov.u32 %0, %%ctaid.z;\n" : "=r"(ids.z));
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(ids.tid));
  return ids;
}

// x, through an empty asm statement the compiler must execute where it stands: a value formed
// from it cannot be hoisted out of the loop that holds it (and so held in registers across it).
__device__ __forceinline__ std::uint64_t opaque(std::uint64_t x) {
  asm volatile("" : "+l"(x));
  return x;
}
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// --- wgmma matrix descriptors ----------------------------------------------------------------
// A tile in shared memory in the 128-byte swizzle layout that TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B: rows of 64 16-bit elements (128 bytes), the 16-byte chunk c of
// row r stored at chunk c ^ (r % 8), each group of 8 rows a 1024-byte atom.
//   K-major operand (Q, K): sbo = 1024 (the next 8 rows); lbo unused; a k-step of 16
//     elements moves the start by 32 bytes inside the atom.
//   MN-major operand (V as B of P V): sbo = 1024 (the next 8 keys), lbo = the distance to the
//     next 64 columns (the next TMA box).
// sw128_desc and sw128_advance (launch.hpp, where the host tests reach them) form them.

}  // namespace flashref::cuda::detail::sm90
