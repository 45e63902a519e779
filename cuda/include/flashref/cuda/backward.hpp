#pragma once
// flashref's CUDA backward pass (SPEC §9). Two entries, as for the forward:
//
//  - attention_backward(problem, gradients): the host entry used by
//    flashref::attention_backward(problem, gradients, backend::cuda). It copies the host float32
//    data to the device, runs, and copies dQ, dK, dV back. When problem.dtype is bfloat16 or
//    float16 it runs the tensor-core kernels (dO rounded to that dtype), otherwise the float32
//    kernel.
//  - attention_backward(device_backward_problem, stream): caller-owned device memory and a CUDA
//    stream.
//
// Both recompute P = exp(S·scale − LSE) from the forward's LSE through the guard of SPEC §9: a
// row with no visible key (LSE = −inf) gets dQ = 0 and adds nothing to dK, dV; a key no row
// sees gets dK = dV = 0 exactly. dK and dV of a key/value head sum its query heads (GQA/MQA).
// Every sum has a fixed order: the result is bitwise the same from run to run.

#include <cstddef>

#include <cuda_runtime_api.h>

#include "flashref/cuda/attention.hpp"
#include "flashref/reference/backward.hpp"

namespace flashref::cuda {

// Which kernel runs a backward.
//
// clang-format off
// | kernel      | input       | D = Dv       | layout of q, k, v, d_o                              |
// | ----------- | ----------- | ------------ | --------------------------------------------------- |
// | hopper      | bf16, fp16  | 64, 128      | as tensor_core; compute capability 9.0 (sm_90a)     |
// | tensor_core | bf16, fp16  | 64, 128      | unit stride along D, 16-byte rows; d_o in q's dtype |
// | simt        | any         | D, Dv <= 256 | any strides                                         |
// clang-format on
//
// `automatic` takes hopper where it applies, else tensor_core where it applies, else simt.

// The backward of SPEC §9 over caller-owned device memory.
struct device_backward_problem {
  // q, k, v, the masks and the kernel choice; o and lse hold the forward's results and are
  // read, never written (lse is required).
  device_problem forward;
  device_tensor<4> d_o;  // (B, Hq, Lq, Dv) upstream gradient: float32 or q's dtype
  device_tensor<4> d_q;  // (B, Hq, Lq, D)  output: float32 or q's dtype, like d_k and d_v
  device_tensor<4> d_k;  // (B, Hk, Lk, D)  output
  device_tensor<4> d_v;  // (B, Hk, Lk, Dv) output
  // Scratch of at least backward_workspace_bytes(*this) bytes in device memory, 256-byte
  // aligned; when null, the entry takes it on the stream from flashref's stream-ordered pool
  // and frees it there after the kernels (the pool keeps what it has mapped for the next call;
  // the driver takes it back when an allocation elsewhere fails).
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  // true: bitwise the same gradients on every run. Where the hopper kernel (D = 64, 128) forms
  // dQ beside dK and dV (rows that see 2048 keys or more on average; with a block mask, rows
  // that can see 8192) it adds each key tile's part to fixed-point int32 sums, whose additions
  // give the same bits in any order (cuda/NOTES.md, "b6"); elsewhere dQ has its own pass. A row
  // whose LSE lies far below its log-sum-exp (not the forward's) can leave the fixed-point
  // range: its dQ is then NaN.
  // false lets those sums be float32, added in whatever order the key tiles finish, and from
  // fewer keys (2048; 8192 with a block mask): faster, dQ within the same tolerance but not
  // bitwise repeatable; dK and dV unchanged.
  bool deterministic = true;
};

// Scratch the backward needs: Delta = rowsum(dO ∘ O), B·Hq·Lq floats, and where dQ is formed
// beside dK and dV its sums, B·Hq·Lq·D words (Lq rounded up to a multiple of 64), with, in
// fixed point, two more words per query row and two per (batch, key/value head).
std::size_t backward_workspace_bytes(const device_backward_problem& p);

// Device entry: validates shapes, dtypes and pointers on the host (check_device_memory), then
// enqueues the kernels on `stream`. It does not synchronize; errors of the launches themselves
// are thrown.
void attention_backward(const device_backward_problem& p, cudaStream_t stream);

// The pointer checks of attention_backward(p, stream), alone, by the forward's rules
// (check_device_memory(device_problem)): the forward's views, d_o, d_q, d_k, d_v, and the
// workspace's workspace_bytes when one is given.
void check_device_memory(const device_backward_problem& p);

// Which kernel attention_backward(p, stream) would run: "tensor_core" or "simt". Throws like it.
const char* backward_kernel_for(const device_backward_problem& p);

// Host entry: validates (validate_backward), copies to the device, computes g.dq, g.dk, g.dv,
// copies back. `kernel` applies to bfloat16 / float16 problems (p.dtype); a float32 problem,
// and one whose q, k, v or dO holds NaN or inf, runs the simt kernel (it never reads a masked
// pair, so a NaN reaches only what it feeds; SPEC §2, §9).
void attention_backward(const attention_problem& p, const attention_gradients& g,
                        kernel_choice kernel = kernel_choice::automatic);

}  // namespace flashref::cuda
