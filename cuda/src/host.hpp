#pragma once
// The host side shared by the CUDA entries (forward and backward): CUDA error reporting,
// device allocations, validation of device problems, the choice of kernel, packing host views,
// and the upload of a host problem's inputs and masks. Plain C++: no kernels here.

#include <cuda_runtime_api.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "flashref/cuda/attention.hpp"
#include "flashref/reference/mask.hpp"
#include "launch.hpp"

namespace flashref::cuda::host {

using detail::elem;

// Every CUDA call goes through here: an error becomes a problem_error with CUDA's text.
void check(cudaError_t e, const char* what);

elem to_elem(input_dtype t);
std::size_t elem_bytes(input_dtype t);

// Owns one device allocation.
// Out of memory is a problem_error naming the field, and leaves no error pending for the next
// launch check.
class device_buffer {
 public:
  device_buffer(const char* field, std::size_t bytes) {
    const cudaError_t e = cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      ptr_ = nullptr;
      throw problem_error(std::string(field) + ": expected " + std::to_string(bytes) +
                          " bytes of device memory, got " + cudaGetErrorName(e) + " (" +
                          cudaGetErrorString(e) + ")");
    }
  }
  ~device_buffer() { cudaFree(ptr_); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  device_buffer(device_buffer&& other) noexcept : ptr_(other.ptr_) { other.ptr_ = nullptr; }
  device_buffer& operator=(device_buffer&&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

template <class T, int R>
strided<T, R> shape_only(const device_tensor<R>& t) {
  // Used for shape validation only: the pointer is never dereferenced on the host.
  return {static_cast<T*>(t.data), t.shape, t.stride};
}

// The shapes and masks of a device problem as the reference's problem type, so that the device
// entries validate with the same rules (and messages) as every backend. kv_len is left out: it
// lives in device memory.
attention_problem shapes_of(const device_problem& p);

// The element types of a device problem: q, k, v alike; o float32 or the input dtype; lse
// float32.
void check_dtypes(const device_problem& p);

// The tensor-core kernels read 16-byte rows (cp.async, or TMA on Hopper): unit stride along the
// head dim, every other stride a multiple of 8 elements, the base 16-byte aligned.
bool tensor_core_layout(const device_tensor<4>& t);
bool tensor_core_applies(const device_problem& p);
// The Hopper forward's shapes: tensor_core_applies, or D = Dv = 256 with the same dtypes and
// layout.
bool hopper_applies(const device_problem& p);

// The Hopper kernel's machine code is sm_90a: it runs on compute capability 9.0 alone, and
// only when the library was built with it (CMake option FLASHREF_CUDA_HOPPER).
bool hopper_runs_here();

enum class kernel_kind { hopper, tensor_core, simt };
const char* name_of(kernel_kind k);

// The dispatch table of attention.hpp: a forced kernel that cannot take the problem throws.
kernel_kind choose(const device_problem& p);

// The checks beyond SPEC §2's validation that the CUDA kernels add; shared by every entry.
void check_device_limits(const device_problem& p, kernel_kind kernel);

// The kernels' parameters of a validated problem; `mask` carries the problem's mask (kv_len is
// taken from p, in device memory).
detail::kernel_params kernel_params_of(const device_problem& p, const mask_spec& mask,
                                       double softmax_scale);

template <std::size_t R>
void copy_array(std::int64_t (&dst)[R], const std::array<std::int64_t, R>& src) {
  for (std::size_t d = 0; d < R; ++d)
    dst[d] = src[d];
}

// Packs a strided host view into a contiguous row-major vector, in one pass that also tells
// whether every element is finite (when `finite` is given).
template <class T, int R>
std::vector<std::remove_const_t<T>> pack(const strided<T, R>& v, bool* finite = nullptr) {
  std::vector<std::remove_const_t<T>> out(std::size_t(v.size()));
  std::array<std::int64_t, R> idx{};
  bool all_finite = true;
  for (std::size_t n = 0; n < out.size(); ++n) {
    std::int64_t off = 0;
    for (int d = 0; d < R; ++d)
      off += idx[std::size_t(d)] * v.stride[std::size_t(d)];
    out[n] = v.data[off];
    if constexpr (std::is_floating_point_v<std::remove_const_t<T>>) {
      all_finite = all_finite && std::isfinite(out[n]);
    }
    for (int d = R - 1; d >= 0; --d) {
      if (++idx[std::size_t(d)] < v.shape[std::size_t(d)]) break;
      idx[std::size_t(d)] = 0;
    }
  }
  if (finite != nullptr) *finite = all_finite;
  return out;
}

template <int R>
std::array<std::int64_t, R> dense_strides(const std::array<std::int64_t, R>& shape) {
  return row_major_strides<float, R>(shape);
}

// The element type a host entry uploads q, k, v in, and the kernel choice that goes with it.
// The host holds float32 data; bfloat16 / float16 (p.dtype, whose values the caller promises
// are exact) go to a tensor-core kernel where `tensor_core_shape` says one takes the problem,
// else (under automatic) to the float32 kernel. Non-finite inputs go to the float32 kernel
// whatever the choice: a tensor-core product carries a NaN or inf into the pairs of a partial
// tile that mask it (0 · NaN), the float32 kernel never reads a masked pair (SPEC §2).
struct host_choice {
  input_dtype input;
  kernel_choice kernel;
};
host_choice host_input(input_dtype dtype, kernel_choice kernel, bool tensor_core_shape,
                       bool inputs_finite);

// The device copies of a host problem, owned here: inputs uploaded as float32 and converted on
// the device to `as` when it is bfloat16 / float16 (the caller promises each value is exact, or
// accepts the rounding), the block mask and kv_len as they are.
class host_upload {
 public:
  // Uploads a packed tensor; returns its device copy in element type `as`.
  void* tensor(const char* field, const std::vector<float>& packed, input_dtype as,
               cudaStream_t stream);
  // Sets dp's mask fields (block mask with dense strides, kv_len, causal, window, scale) from
  // p's.
  void masks(const attention_problem& p, device_problem& dp);
  // An uninitialised device allocation, kept alive with the rest.
  void* alloc(const char* field, std::size_t bytes);

 private:
  std::vector<device_buffer> keep_;
};

// Writes a row-major (B, H, L, X) float32 device tensor into a strided host view.
void download(const void* device, const strided<float, 4>& out);

}  // namespace flashref::cuda::host
