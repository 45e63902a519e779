#pragma once
// flashref's CUDA backend. Two entries:
//
//  - attention(problem): the host entry used by flashref::attention(problem, backend::cuda).
//    It copies the host float32 data to the device, runs, and copies O and LSE back. When
//    problem.dtype is bfloat16 or float16 (every input exactly representable) it runs the
//    tensor-core kernels, otherwise the float32 kernel.
//  - attention(device_problem, stream): caller-owned device memory and a CUDA stream; inputs
//    in float32, bfloat16 or float16, output in float32 or the input dtype, LSE in float32.
//
// Both give SPEC §2's meaning, including rows with no visible key: O = 0, LSE = -inf.
// Every CUDA error becomes a flashref::problem_error carrying the CUDA error text.

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include <cuda_runtime_api.h>

#include "flashref/reference/problem.hpp"

namespace flashref::cuda {

// Is a CUDA device usable now? On false, *reason (when given) says why in one line.
bool device_available(std::string* reason);

// Which kernel runs a problem. `automatic` takes the fastest one that applies on the current
// device: hopper (sm_90 only), then tensor_core, then simt. Naming another forces it and throws
// problem_error when that kernel cannot take the problem (tests use this to cover each kernel).
//
// clang-format off
// | kernel      | device           | input       | D = Dv       | layout of q, k, v                 |
// | ----------- | ---------------- | ----------- | ------------ | --------------------------------- |
// | hopper      | compute cap 9.0  | bf16, fp16  | 64, 128, 256 | unit stride along D, 16-byte rows |
// | tensor_core | 8.0 or newer     | bf16, fp16  | 64, 128      | unit stride along D, 16-byte rows |
// | simt        | 8.0 or newer     | any         | D, Dv <= 256 | any strides                       |
// clang-format on
enum class kernel_choice { automatic, hopper, tensor_core, simt };

// Host entry: validates, copies to the device, computes p.o and p.lse, copies back. `kernel`
// applies to bfloat16 / float16 problems (p.dtype); a float32 problem, and one whose V holds
// NaN or inf (SPEC §2, cuda/NOTES.md), runs the simt kernel whatever the choice.
void attention(const attention_problem& p, kernel_choice kernel = kernel_choice::automatic);

// A tensor in device memory: pointer, element type, shape and strides (in elements). The one
// view type of the CUDA entries: the device entry takes it from the caller, the host entry
// describes its own device copies with it, and the kernels' parameters are built from it.
template <int R>
struct device_tensor {
  void* data = nullptr;
  input_dtype dtype = input_dtype::float32;  // float32, bfloat16 or float16
  std::array<std::int64_t, R> shape{};
  std::array<std::int64_t, R> stride{};
};

// The attention problem of SPEC §2 over caller-owned device memory.
struct device_problem {
  device_tensor<4> q;    // (B, Hq, Lq, D); q, k and v share one dtype
  device_tensor<4> k;    // (B, Hk, Lk, D)
  device_tensor<4> v;    // (B, Hk, Lk, Dv)
  device_tensor<4> o;    // (B, Hq, Lq, Dv) output: float32 or the input dtype
  device_tensor<3> lse;  // (B, Hq, Lq) output: float32, natural log; data may be null

  std::optional<double> scale;  // default 1/sqrt(D)
  causal_mode causal = causal_mode::none;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;

  // Block mask (Bm, Hm, ceil(Lq/block_q), ceil(Lk/block_k)) of uint8 in device memory;
  // Bm in {1, B}, Hm in {1, Hq}; absent when block_mask.data is null.
  strided<const std::uint8_t, 4> block_mask;
  std::int64_t block_q = 0;
  std::int64_t block_k = 0;

  // (B) int32 in device memory, or null. Values must lie in [0, Lk]; device memory is not read
  // on the host, so they are not validated here.
  const std::int32_t* kv_len = nullptr;

  kernel_choice kernel = kernel_choice::automatic;

  // true: the caller promises that V holds no NaN or inf, and the guard below is left out (a
  // broken promise may put NaN in rows that do not see the key; SPEC §2, cuda/NOTES.md).
  bool v_finite = false;
};

// Device entry: validates shapes and pointers on the host (check_device_memory), then enqueues
// the kernel on `stream`. It does not synchronize; errors of the launch itself are thrown.
// o must not overlap q, k, v.
//
// The kernel is chosen by p.kernel and the table above kernel_choice; bfloat16 / float16
// problems no tensor-core kernel takes run on the float32-accumulating SIMT kernel. SPEC §2's
// rule for NaN and inf in V holds on every kernel: where the mask hides some key from some row
// (causal, a window, kv_len, a block mask) and unless p.v_finite, a tensor-core kernel is
// followed on the same stream by the SIMT kernel, which recomputes the problem only when the
// fast result may carry a leaked NaN or inf (the Hopper kernel flags any non-finite value it
// stores; after the mma.sync kernel a scan of V decides), with no host synchronization. Without
// such a mask every row sees every key, and a non-finite V reaches the reference's rows alike.
void attention(const device_problem& p, cudaStream_t stream);

// The pointer checks of attention(p, stream), alone; each failure is a problem_error naming the
// field. Every non-null pointer of a view with elements must be memory the current device
// reads at that address: device memory of the current device, managed memory, or page-locked
// host memory mapped at the same address (cudaMallocHost, cudaHostRegister). Pageable host
// memory is refused even where the device could read it (HMM, ATS): a host pointer and a
// wild one look the same. Where the driver knows the allocation (device and managed memory),
// the view's bytes must lie inside it; chunks mapped side by side through the virtual memory
// management API count as one allocation.
void check_device_memory(const device_problem& p);

// Which kernel attention(p, stream) would run: "hopper", "tensor_core" or "simt" (for a V
// without NaN or inf; with one, the SIMT kernel's result replaces a tensor-core kernel's).
// Throws like attention, the pointer checks aside.
const char* kernel_for(const device_problem& p);

}  // namespace flashref::cuda
