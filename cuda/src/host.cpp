// The host side shared by the CUDA entries; see host.hpp.
#include "host.hpp"

namespace flashref::cuda::host {

namespace {

bool aligned16(const void* ptr) {
  return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0;
}

}  // namespace

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

bool tensor_core_layout(const device_tensor<4>& t) {
  return t.stride[3] == 1 && t.stride[0] % 8 == 0 && t.stride[1] % 8 == 0 && t.stride[2] % 8 == 0 &&
         aligned16(t.data);
}

bool tensor_core_applies(const device_problem& p) {
  const std::int64_t D = p.q.shape[3], Dv = p.v.shape[3];
  return p.q.dtype != input_dtype::float32 && D == Dv && (D == 64 || D == 128) &&
         tensor_core_layout(p.q) && tensor_core_layout(p.k) && tensor_core_layout(p.v);
}

bool hopper_applies(const device_problem& p) {
  const std::int64_t D = p.q.shape[3], Dv = p.v.shape[3];
  return tensor_core_applies(p) ||
         (p.q.dtype != input_dtype::float32 && D == 256 && Dv == 256 && tensor_core_layout(p.q) &&
          tensor_core_layout(p.k) && tensor_core_layout(p.v));
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
      if (hopper_applies(p) && hopper_runs_here()) return kernel_kind::hopper;
      return tc ? kernel_kind::tensor_core : kernel_kind::simt;
    case kernel_choice::hopper:
      if (!hopper_applies(p) || !hopper_runs_here()) {
        throw problem_error(
            "kernel: expected a problem the hopper kernel takes (a build with it, compute "
            "capability 9.0, bf16 or fp16, D = Dv in {64, 128, 256}, 16-byte rows), got another");
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

detail::kernel_params kernel_params_of(const device_problem& p, const mask_spec& mask,
                                       double softmax_scale) {
  const std::int64_t Hq = p.q.shape[1], Hk = p.k.shape[1];
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
  kp.batch = p.q.shape[0];
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
  return kp;
}

host_choice host_input(input_dtype dtype, kernel_choice kernel, bool tensor_core_shape,
                       bool inputs_finite) {
  host_choice c{dtype, kernel};
  if (dtype != input_dtype::float32 && !tensor_core_shape && kernel == kernel_choice::automatic) {
    c.input = input_dtype::float32;
  }
  if (c.input != input_dtype::float32 && !inputs_finite) {
    c.input = input_dtype::float32;
    c.kernel = kernel_choice::automatic;
  }
  if (c.input == input_dtype::float32 && c.kernel != kernel_choice::simt) {
    c.kernel = kernel_choice::automatic;  // only the float32 kernel takes float32 input
  }
  return c;
}

void* host_upload::alloc(const char* field, std::size_t bytes) {
  keep_.emplace_back(field, bytes);
  return keep_.back().get();
}

void* host_upload::tensor(const char* field, const std::vector<float>& packed, input_dtype as,
                          cudaStream_t stream) {
  float* d32 = static_cast<float*>(alloc(field, packed.size() * sizeof(float)));
  check(cudaMemcpy(d32, packed.data(), packed.size() * sizeof(float), cudaMemcpyHostToDevice),
        "cudaMemcpy (inputs)");
  if (as == input_dtype::float32) return d32;
  void* converted = alloc(field, packed.size() * elem_bytes(as));
  check(detail::launch_convert(d32, converted, std::int64_t(packed.size()), to_elem(as), stream),
        "conversion kernel launch");
  return converted;
}

void host_upload::masks(const attention_problem& p, device_problem& dp) {
  if (p.has_block_mask()) {
    const std::vector<std::uint8_t> bm = pack(p.block_mask);
    void* d = alloc("block_mask", bm.size());
    check(cudaMemcpy(d, bm.data(), bm.size(), cudaMemcpyHostToDevice), "cudaMemcpy (block_mask)");
    dp.block_mask = {static_cast<const std::uint8_t*>(d), p.block_mask.shape,
                     dense_strides<4>(p.block_mask.shape)};
    dp.block_q = p.block_q;
    dp.block_k = p.block_k;
  }
  if (p.kv_len != nullptr) {
    const std::size_t bytes = std::size_t(p.batch()) * sizeof(std::int32_t);
    void* d = alloc("kv_len", bytes);
    check(cudaMemcpy(d, p.kv_len, bytes, cudaMemcpyHostToDevice), "cudaMemcpy (kv_len)");
    dp.kv_len = static_cast<const std::int32_t*>(d);
  }
  dp.scale = p.scale;
  dp.causal = p.causal;
  dp.window_left = p.window_left;
  dp.window_right = p.window_right;
}

void download(const void* device, const strided<float, 4>& out) {
  std::vector<float> host(std::size_t(out.size()));
  check(cudaMemcpy(host.data(), device, host.size() * sizeof(float), cudaMemcpyDeviceToHost),
        "cudaMemcpy (results)");
  std::size_t n = 0;
  for (std::int64_t b = 0; b < out.shape[0]; ++b)
    for (std::int64_t h = 0; h < out.shape[1]; ++h)
      for (std::int64_t i = 0; i < out.shape[2]; ++i)
        for (std::int64_t x = 0; x < out.shape[3]; ++x)
          out(b, h, i, x) = host[n++];
}

}  // namespace flashref::cuda::host
