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

// Owns one device allocation.
class device_buffer {
 public:
  explicit device_buffer(std::size_t bytes) {
    check(cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes), "cudaMalloc");
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

template <int R>
strided<const float, R> shape_only(const device_view<R>& v) {
  // Used for shape validation only: the pointer is never dereferenced on the host.
  return {static_cast<const float*>(v.data), v.shape, v.stride};
}

// The host-side mirror of a device problem, for validate() and make_mask_spec(). kv_len is left
// out: it lives in device memory.
attention_problem mirror(const device_problem& p) {
  attention_problem m;
  m.q = shape_only(p.q);
  m.k = shape_only(p.k);
  m.v = shape_only(p.v);
  m.o = {static_cast<float*>(p.o.data), p.o.shape, p.o.stride};
  m.lse = {static_cast<float*>(p.lse.data), p.lse.shape, p.lse.stride};
  m.scale = p.scale;
  m.causal = p.causal;
  m.window_left = p.window_left;
  m.window_right = p.window_right;
  m.block_mask = {static_cast<const std::uint8_t*>(p.block_mask.data), p.block_mask.shape,
                  p.block_mask.stride};
  m.block_q = p.block_q;
  m.block_k = p.block_k;
  return m;
}

bool aligned16(const void* ptr) {
  return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0;
}

// The tensor-core kernel reads 16-byte rows: unit stride along the head dim, every other
// stride a multiple of 8 elements, the base 16-byte aligned.
bool tensor_core_layout(const device_view<4>& t) {
  return t.stride[3] == 1 && t.stride[0] % 8 == 0 && t.stride[1] % 8 == 0 && t.stride[2] % 8 == 0 &&
         aligned16(t.data);
}

bool use_tensor_core(const device_problem& p) {
  const std::int64_t D = p.q.shape[3], Dv = p.v.shape[3];
  return p.input != input_dtype::float32 && D == Dv && (D == 64 || D == 128) &&
         tensor_core_layout(p.q) && tensor_core_layout(p.k) && tensor_core_layout(p.v);
}

void check_device_problem(const device_problem& p) {
  validate(mirror(p));
  if (p.output != input_dtype::float32 && p.output != p.input) {
    throw problem_error(std::string("output: expected float32 or the input dtype ") +
                        to_string(p.input) + ", got " + to_string(p.output));
  }
  const std::int64_t D = p.q.shape[3], Dv = p.v.shape[3];
  if (!use_tensor_core(p)) {
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

// Is every element of a host view finite?
bool all_finite(const strided<const float, 4>& v) {
  for (std::int64_t b = 0; b < v.shape[0]; ++b)
    for (std::int64_t h = 0; h < v.shape[1]; ++h)
      for (std::int64_t j = 0; j < v.shape[2]; ++j)
        for (std::int64_t d = 0; d < v.shape[3]; ++d)
          if (!std::isfinite(v(b, h, j, d))) return false;
  return true;
}

// Packs a strided host view into a contiguous row-major vector.
template <class T, int R>
std::vector<std::remove_const_t<T>> pack(const strided<T, R>& v) {
  std::vector<std::remove_const_t<T>> out(std::size_t(v.size()));
  std::array<std::int64_t, R> idx{};
  for (std::size_t n = 0; n < out.size(); ++n) {
    std::int64_t off = 0;
    for (int d = 0; d < R; ++d)
      off += idx[std::size_t(d)] * v.stride[std::size_t(d)];
    out[n] = v.data[off];
    for (int d = R - 1; d >= 0; --d) {
      if (++idx[std::size_t(d)] < v.shape[std::size_t(d)]) break;
      idx[std::size_t(d)] = 0;
    }
  }
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
  check_device_problem(p);
  return use_tensor_core(p) ? "tensor_core" : "simt";
}

void attention(const device_problem& p, cudaStream_t stream) {
  check_device_problem(p);
  const attention_problem m = mirror(p);
  if (m.batch() * m.heads_q() * m.len_q() == 0) return;  // nothing to write

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
  kp.batch = m.batch();
  kp.heads_q = m.heads_q();
  kp.heads_k = m.heads_k();
  kp.len_q = m.len_q();
  kp.len_k = m.len_k();
  kp.head_dim = m.head_dim();
  kp.head_dim_v = m.head_dim_v();
  kp.group = m.group_size();
  kp.scale = static_cast<float>(m.softmax_scale());
  kp.out = to_elem(p.output);
  kp.mask = make_mask_spec(m);
  kp.mask.kv_len = p.kv_len;

  if (use_tensor_core(p)) {
    check(detail::launch_tensor_core(kp, to_elem(p.input), stream), "tensor-core kernel launch");
  } else {
    check(detail::launch_simt(kp, to_elem(p.input), stream), "SIMT kernel launch");
  }
}

void attention(const attention_problem& p) {
  validate(p);
  const std::int64_t B = p.batch(), Hq = p.heads_q(), Lq = p.len_q();
  if (B * Hq * Lq == 0) return;  // nothing to write

  // float32 data on the host; the tensor-core kernels take it in the problem's dtype, which
  // the caller promises represents every input value exactly.
  const input_dtype in = p.dtype;
  device_problem dp;
  dp.input = in;
  dp.output = input_dtype::float32;
  dp.q = {nullptr, p.q.shape, dense_strides<4>(p.q.shape)};
  dp.k = {nullptr, p.k.shape, dense_strides<4>(p.k.shape)};
  dp.v = {nullptr, p.v.shape, dense_strides<4>(p.v.shape)};
  // The packed copies live in cudaMalloc'ed (256-byte aligned) buffers, so the shape alone
  // decides whether the tensor-core kernel applies; otherwise the float32 kernel runs.
  if (in != input_dtype::float32 && !use_tensor_core(dp)) dp.input = input_dtype::float32;
  // The tensor-core kernel's P·V would carry a NaN or inf of V into the rows of a partial tile
  // that mask its key (0 · NaN). Such a V goes to the float32 kernel, which never reads a
  // masked key's value: a NaN reaches only the rows that see it (SPEC §2).
  if (dp.input != input_dtype::float32 && !all_finite(p.v)) dp.input = input_dtype::float32;

  cudaStream_t stream = nullptr;
  auto upload = [&](const strided<const float, 4>& host, device_view<4>& dev,
                    std::vector<device_buffer>& keep) {
    const std::vector<float> packed = pack(host);
    keep.emplace_back(packed.size() * sizeof(float));
    float* d32 = static_cast<float*>(keep.back().get());
    check(cudaMemcpy(d32, packed.data(), packed.size() * sizeof(float), cudaMemcpyHostToDevice),
          "cudaMemcpy (inputs)");
    if (dp.input == input_dtype::float32) {
      dev.data = d32;
      return;
    }
    keep.emplace_back(packed.size() * elem_bytes(dp.input));
    check(detail::launch_convert(d32, keep.back().get(), std::int64_t(packed.size()),
                                 to_elem(dp.input), stream),
          "conversion kernel launch");
    dev.data = keep.back().get();
  };
  std::vector<device_buffer> keep;
  keep.reserve(8);
  upload(p.q, dp.q, keep);
  upload(p.k, dp.k, keep);
  upload(p.v, dp.v, keep);

  const std::array<std::int64_t, 4> o_shape{B, Hq, Lq, p.head_dim_v()};
  const std::array<std::int64_t, 3> lse_shape{B, Hq, Lq};
  device_buffer d_o(std::size_t(B * Hq * Lq * p.head_dim_v()) * sizeof(float));
  device_buffer d_lse(std::size_t(B * Hq * Lq) * sizeof(float));
  dp.o = {d_o.get(), o_shape, dense_strides<4>(o_shape)};
  dp.lse = {d_lse.get(), lse_shape, dense_strides<3>(lse_shape)};

  dp.scale = p.scale;
  dp.causal = p.causal;
  dp.window_left = p.window_left;
  dp.window_right = p.window_right;
  std::vector<device_buffer> mask_keep;
  if (p.has_block_mask()) {
    const std::vector<std::uint8_t> bm = pack(p.block_mask);
    mask_keep.emplace_back(bm.size());
    check(cudaMemcpy(mask_keep.back().get(), bm.data(), bm.size(), cudaMemcpyHostToDevice),
          "cudaMemcpy (block_mask)");
    dp.block_mask = {mask_keep.back().get(), p.block_mask.shape,
                     dense_strides<4>(p.block_mask.shape)};
    dp.block_q = p.block_q;
    dp.block_k = p.block_k;
  }
  if (p.kv_len != nullptr) {
    mask_keep.emplace_back(std::size_t(B) * sizeof(std::int32_t));
    check(cudaMemcpy(mask_keep.back().get(), p.kv_len, std::size_t(B) * sizeof(std::int32_t),
                     cudaMemcpyHostToDevice),
          "cudaMemcpy (kv_len)");
    dp.kv_len = static_cast<const std::int32_t*>(mask_keep.back().get());
  }

  attention(dp, stream);
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
