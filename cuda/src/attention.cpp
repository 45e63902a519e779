// The CUDA backend's host side: validation, the choice of kernel, device memory for the host
// entry, and CUDA error reporting. Kernels live in the .cu files behind launch.hpp.

#include "flashref/cuda/attention.hpp"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "flashref/reference/mask.hpp"
#include "guards.hpp"
#include "launch.hpp"

namespace flashref::cuda {

namespace {

using detail::elem;

// Every CUDA call goes through here: an error becomes a problem_error with CUDA's text.
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw problem_error(std::string("cuda: ") + what + " failed: " + cudaGetErrorName(e) + " (" +
                        cudaGetErrorString(e) + ")");
  }
}

elem to_elem(input_dtype t) {
  switch (t) {
    case input_dtype::bfloat16:
      return elem::bf16;
    case input_dtype::float16:
      return elem::f16;
    case input_dtype::float32:
      break;
  }
  return elem::f32;
}

std::size_t elem_bytes(input_dtype t) {
  return t == input_dtype::float32 ? 4 : 2;
}

// Owns one device allocation of the host entry; out of memory is a problem_error naming the
// field, and leaves no error pending for the next launch check.
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
// entry validates with the same rules (and messages) as every backend. Only the device entry
// builds it; the host entry validates its own problem. kv_len is left out: it lives in device
// memory.
attention_problem shapes_of(const device_problem& p) {
  attention_problem m;
  m.q = shape_only<const float>(p.q);
  m.k = shape_only<const float>(p.k);
  m.v = shape_only<const float>(p.v);
  m.o = shape_only<float>(p.o);
  m.lse = shape_only<float>(p.lse);
  m.scale = p.scale;
  m.causal = p.causal;
  m.window_left = p.window_left;
  m.window_right = p.window_right;
  m.block_mask = p.block_mask;
  m.block_q = p.block_q;
  m.block_k = p.block_k;
  m.dtype = p.q.dtype;
  return m;
}

// The element types of a device problem: q, k, v alike; o float32 or the input dtype; lse
// float32.
void check_dtypes(const device_problem& p) {
  const input_dtype in = p.q.dtype;
  for (const auto& [name, t] : {std::pair{"k", &p.k}, std::pair{"v", &p.v}}) {
    if (t->dtype != in) {
      throw problem_error(std::string(name) + ": expected dtype " + to_string(in) + " (q's), got " +
                          to_string(t->dtype));
    }
  }
  if (p.o.dtype != input_dtype::float32 && p.o.dtype != in) {
    throw problem_error(std::string("o: expected dtype float32 or the input dtype ") +
                        to_string(in) + ", got " + to_string(p.o.dtype));
  }
  if (p.lse.data != nullptr && p.lse.dtype != input_dtype::float32) {
    throw problem_error(std::string("lse: expected dtype float32, got ") + to_string(p.lse.dtype));
  }
}

bool aligned16(const void* ptr) {
  return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0;
}

// The tensor-core kernels read 16-byte rows (cp.async, or TMA on Hopper): unit stride along the
// head dim, every other stride a multiple of 8 elements, the base 16-byte aligned.
bool tensor_core_layout(const device_tensor<4>& t) {
  return t.stride[3] == 1 && t.stride[0] % 8 == 0 && t.stride[1] % 8 == 0 && t.stride[2] % 8 == 0 &&
         aligned16(t.data);
}

bool tensor_core_applies(const device_problem& p) {
  const std::int64_t D = p.q.shape[3], Dv = p.v.shape[3];
  return p.q.dtype != input_dtype::float32 && D == Dv && (D == 64 || D == 128) &&
         tensor_core_layout(p.q) && tensor_core_layout(p.k) && tensor_core_layout(p.v);
}

// The Hopper kernel's machine code is sm_90a: it runs on compute capability 9.0 alone, and
// only when the library was built with it (CMake option FLASHREF_CUDA_HOPPER).
bool hopper_runs_here() {
#if defined(FLASHREF_CUDA_HOPPER)
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return false;
  }
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

enum class kernel_kind { hopper, tensor_core, simt };

const char* name_of(kernel_kind k) {
  switch (k) {
    case kernel_kind::hopper:
      return "hopper";
    case kernel_kind::tensor_core:
      return "tensor_core";
    case kernel_kind::simt:
      break;
  }
  return "simt";
}

// The dispatch table of attention.hpp: a forced kernel that cannot take the problem throws.
kernel_kind choose(const device_problem& p) {
  const bool tc = tensor_core_applies(p);
  switch (p.kernel) {
    case kernel_choice::automatic:
      if (tc) return hopper_runs_here() ? kernel_kind::hopper : kernel_kind::tensor_core;
      return kernel_kind::simt;
    case kernel_choice::hopper:
      if (!tc || !hopper_runs_here()) {
        throw problem_error(
            "kernel: expected a problem the hopper kernel takes (a build with it, compute "
            "capability 9.0, bf16 or fp16, D = Dv in {64, 128}, 16-byte rows), got another");
      }
      return kernel_kind::hopper;
    case kernel_choice::tensor_core:
      if (!tc) {
        throw problem_error(
            "kernel: expected a problem the tensor_core kernel takes (bf16 or fp16, D = Dv in "
            "{64, 128}, 16-byte rows), got another");
      }
      return kernel_kind::tensor_core;
    case kernel_choice::simt:
      break;
  }
  return kernel_kind::simt;
}

// The checks beyond SPEC §2's validation that the CUDA kernels add; shared by both entries.
void check_device_limits(const device_problem& p, kernel_kind kernel) {
  const std::int64_t D = p.q.shape[3], Dv = p.v.shape[3];
  if (kernel == kernel_kind::simt) {
    if (D > detail::kSimtMaxHeadDim) {
      throw problem_error("head_dim: expected at most " + std::to_string(detail::kSimtMaxHeadDim) +
                          " on the CUDA backend, got " + std::to_string(D));
    }
    if (Dv > detail::kSimtMaxHeadDim) {
      throw problem_error("head_dim_v: expected at most " +
                          std::to_string(detail::kSimtMaxHeadDim) + " on the CUDA backend, got " +
                          std::to_string(Dv));
    }
  }
  // Grid limits: heads and batch are grid dimensions y and z.
  constexpr std::int64_t kMaxGridYZ = 65535;
  if (p.q.shape[1] > kMaxGridYZ) {
    throw problem_error("q: expected at most 65535 heads on the CUDA backend, got " +
                        std::to_string(p.q.shape[1]));
  }
  if (p.q.shape[0] > kMaxGridYZ) {
    throw problem_error("q: expected a batch of at most 65535 on the CUDA backend, got " +
                        std::to_string(p.q.shape[0]));
  }
}

template <std::size_t R>
void copy_array(std::int64_t (&dst)[R], const std::array<std::int64_t, R>& src) {
  for (std::size_t d = 0; d < R; ++d)
    dst[d] = src[d];
}

// Enqueues a validated problem; `mask` carries the problem's mask with kv_len in device memory.
// With `guard_v`, a tensor-core kernel is followed by the scan of V and the gated SIMT kernel
// (SPEC §2 for a V that may hold NaN or inf; cuda/NOTES.md).
void enqueue(const device_problem& p, kernel_kind kernel, const mask_spec& mask,
             double softmax_scale, cudaStream_t stream, bool guard_v = false) {
  const std::int64_t B = p.q.shape[0], Hq = p.q.shape[1], Hk = p.k.shape[1];
  if (B * Hq * p.q.shape[2] == 0) return;  // nothing to write
  detail::kernel_params kp{};
  kp.q = p.q.data;
  kp.k = p.k.data;
  kp.v = p.v.data;
  kp.o = p.o.data;
  kp.lse = static_cast<float*>(p.lse.data);
  copy_array(kp.q_stride, p.q.stride);
  copy_array(kp.k_stride, p.k.stride);
  copy_array(kp.v_stride, p.v.stride);
  copy_array(kp.o_stride, p.o.stride);
  copy_array(kp.lse_stride, p.lse.stride);
  kp.batch = B;
  kp.heads_q = Hq;
  kp.heads_k = Hk;
  kp.len_q = p.q.shape[2];
  kp.len_k = p.k.shape[2];
  kp.head_dim = p.q.shape[3];
  kp.head_dim_v = p.v.shape[3];
  kp.group = Hk > 0 ? Hq / Hk : 1;
  kp.scale = static_cast<float>(softmax_scale);
  kp.out = to_elem(p.o.dtype);
  kp.mask = mask;
  kp.mask.kv_len = p.kv_len;
  const elem input = to_elem(p.q.dtype);
  if (guard_v && kernel != kernel_kind::simt && detail::stream_scratch::available()) {
    // The fast kernel writes every row; when the scan finds a NaN or inf, the SIMT kernel
    // writes every row again, a masked key's value never entering a row. All stream-ordered;
    // the fast kernel is launched first, so that the host work below overlaps it.
    enqueue(p, kernel, mask, softmax_scale, stream);
    const dim3 grid = detail::nonfinite_scan_grid(kp, detail::sm_count());
    const std::size_t flags = std::size_t(grid.x) * grid.y;
    const detail::stream_scratch scratch("v", flags * sizeof(std::uint32_t), stream);
    auto* run_if = static_cast<std::uint32_t*>(scratch.get());
    check(detail::launch_nonfinite_scan(kp, input, grid, run_if, stream), "scan of V launch");
    kp.run_if = run_if;
    kp.run_if_count = std::int64_t(flags);
    check(detail::launch_simt(kp, input, stream), "SIMT kernel launch");
    return;
  }
  if (guard_v) kernel = kernel_kind::simt;  // no stream-ordered pool here: the SIMT kernel alone
  switch (kernel) {
    case kernel_kind::hopper:
#if defined(FLASHREF_CUDA_HOPPER)
      check(detail::launch_hopper(kp, input, stream), "hopper kernel launch");
#endif
      return;
    case kernel_kind::tensor_core:
      check(detail::launch_tensor_core(kp, input, stream), "tensor-core kernel launch");
      return;
    case kernel_kind::simt:
      break;
  }
  check(detail::launch_simt(kp, input, stream), "SIMT kernel launch");
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

}  // namespace

bool device_available(std::string* reason) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    if (reason != nullptr) {
      *reason = e != cudaSuccess ? std::string("no CUDA device: ") + cudaGetErrorString(e)
                                 : std::string("no CUDA device present");
    }
    return false;
  }
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    if (reason != nullptr) *reason = "the CUDA device could not be queried";
    return false;
  }
  if (major < 8) {
    if (reason != nullptr) {
      *reason = "CUDA device of compute capability " + std::to_string(major) +
                ".x; flashref's kernels need 8.0 or newer";
    }
    return false;
  }
  if (reason != nullptr) reason->clear();
  return true;
}

const char* kernel_for(const device_problem& p) {
  check_dtypes(p);
  validate(shapes_of(p));
  const kernel_kind kernel = choose(p);
  check_device_limits(p, kernel);
  return name_of(kernel);
}

void attention(const device_problem& p, cudaStream_t stream) {
  check_dtypes(p);
  const attention_problem shapes = shapes_of(p);
  validate(shapes);
  const kernel_kind kernel = choose(p);
  check_device_limits(p, kernel);
  check_device_memory(p);  // before any launch
  enqueue(p, kernel, make_mask_spec(shapes), shapes.softmax_scale(), stream, !p.v_finite);
}

void attention(const attention_problem& p, kernel_choice kernel) {
  validate(p);
  const std::int64_t B = p.batch(), Hq = p.heads_q(), Lq = p.len_q();
  if (B * Hq * Lq == 0) return;  // nothing to write

  // Each input is read once, into a contiguous copy; V's pass also tells whether it is finite.
  bool v_finite = true;
  const std::vector<float> q = pack(p.q), k = pack(p.k), v = pack(p.v, &v_finite);

  // float32 data on the host; the tensor-core kernels take it in the problem's dtype, which
  // the caller promises represents every input value exactly. The device copies are described
  // by the device entry's own type, so the choice of kernel below is the device entry's.
  device_problem dp;
  dp.kernel = kernel;
  const auto packed_tensor = [](const std::array<std::int64_t, 4>& shape, input_dtype t) {
    return device_tensor<4>{nullptr, t, shape, dense_strides<4>(shape)};
  };
  const auto set_input_dtype = [&](input_dtype t) {
    dp.q = packed_tensor(p.q.shape, t);
    dp.k = packed_tensor(p.k.shape, t);
    dp.v = packed_tensor(p.v.shape, t);
  };
  set_input_dtype(p.dtype);
  // The packed copies live in cudaMalloc'ed (256-byte aligned) buffers, so the shape alone
  // decides whether a tensor-core kernel applies; otherwise the float32 kernel runs.
  if (p.dtype != input_dtype::float32 && !tensor_core_applies(dp) &&
      kernel == kernel_choice::automatic) {
    set_input_dtype(input_dtype::float32);
  }
  // The tensor-core kernels' P·V would carry a NaN or inf of V into the rows of a partial tile
  // that mask its key (0 · NaN). Such a V goes to the float32 kernel, which never reads a
  // masked key's value: a NaN reaches only the rows that see it (SPEC §2).
  if (dp.q.dtype != input_dtype::float32 && !v_finite) {
    set_input_dtype(input_dtype::float32);
    dp.kernel = kernel_choice::automatic;
  }
  const input_dtype in = dp.q.dtype;
  if (in == input_dtype::float32 && dp.kernel != kernel_choice::simt) {
    dp.kernel = kernel_choice::automatic;  // only the float32 kernel takes float32 input
  }
  const kernel_kind chosen = choose(dp);
  check_device_limits(dp, chosen);

  cudaStream_t stream = nullptr;
  auto upload = [&](const char* field, const std::vector<float>& packed, device_tensor<4>& dev,
                    std::vector<device_buffer>& keep) {
    keep.emplace_back(field, packed.size() * sizeof(float));
    float* d32 = static_cast<float*>(keep.back().get());
    check(cudaMemcpy(d32, packed.data(), packed.size() * sizeof(float), cudaMemcpyHostToDevice),
          "cudaMemcpy (inputs)");
    if (in == input_dtype::float32) {
      dev.data = d32;
      return;
    }
    keep.emplace_back(field, packed.size() * elem_bytes(in));
    check(detail::launch_convert(d32, keep.back().get(), std::int64_t(packed.size()), to_elem(in),
                                 stream),
          "conversion kernel launch");
    dev.data = keep.back().get();
  };
  std::vector<device_buffer> keep;
  keep.reserve(8);
  upload("q", q, dp.q, keep);
  upload("k", k, dp.k, keep);
  upload("v", v, dp.v, keep);

  const std::array<std::int64_t, 4> o_shape{B, Hq, Lq, p.head_dim_v()};
  const std::array<std::int64_t, 3> lse_shape{B, Hq, Lq};
  device_buffer d_o("o", std::size_t(B * Hq * Lq * p.head_dim_v()) * sizeof(float));
  device_buffer d_lse("lse", std::size_t(B * Hq * Lq) * sizeof(float));
  dp.o = {d_o.get(), input_dtype::float32, o_shape, dense_strides<4>(o_shape)};
  dp.lse = {d_lse.get(), input_dtype::float32, lse_shape, dense_strides<3>(lse_shape)};

  dp.scale = p.scale;
  dp.causal = p.causal;
  dp.window_left = p.window_left;
  dp.window_right = p.window_right;
  std::vector<device_buffer> mask_keep;
  if (p.has_block_mask()) {
    const std::vector<std::uint8_t> bm = pack(p.block_mask);
    mask_keep.emplace_back("block_mask", bm.size());
    check(cudaMemcpy(mask_keep.back().get(), bm.data(), bm.size(), cudaMemcpyHostToDevice),
          "cudaMemcpy (block_mask)");
    dp.block_mask = {static_cast<const std::uint8_t*>(mask_keep.back().get()), p.block_mask.shape,
                     dense_strides<4>(p.block_mask.shape)};
    dp.block_q = p.block_q;
    dp.block_k = p.block_k;
  }
  if (p.kv_len != nullptr) {
    mask_keep.emplace_back("kv_len", std::size_t(B) * sizeof(std::int32_t));
    check(cudaMemcpy(mask_keep.back().get(), p.kv_len, std::size_t(B) * sizeof(std::int32_t),
                     cudaMemcpyHostToDevice),
          "cudaMemcpy (kv_len)");
    dp.kv_len = static_cast<const std::int32_t*>(mask_keep.back().get());
  }

  // The mask as the kernels see it: the block mask's device copy (dense strides), kv_len in
  // device memory (set by enqueue).
  attention_problem on_device = p;
  on_device.block_mask = dp.block_mask;
  enqueue(dp, chosen, make_mask_spec(on_device), p.softmax_scale(), stream);
  check(cudaStreamSynchronize(stream), "attention kernel");

  std::vector<float> o(std::size_t(B * Hq * Lq * p.head_dim_v()));
  std::vector<float> lse(std::size_t(B * Hq * Lq));
  check(cudaMemcpy(o.data(), d_o.get(), o.size() * sizeof(float), cudaMemcpyDeviceToHost),
        "cudaMemcpy (o)");
  check(cudaMemcpy(lse.data(), d_lse.get(), lse.size() * sizeof(float), cudaMemcpyDeviceToHost),
        "cudaMemcpy (lse)");
  std::size_t n = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < Hq; ++h) {
      for (std::int64_t i = 0; i < Lq; ++i) {
        for (std::int64_t d = 0; d < p.head_dim_v(); ++d)
          p.o(b, h, i, d) = o[n++];
        if (p.lse.data != nullptr) p.lse(b, h, i) = lse[std::size_t((b * Hq + h) * Lq + i)];
      }
    }
  }
}

}  // namespace flashref::cuda
