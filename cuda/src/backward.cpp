// The CUDA backward's host side: validation, the choice of kernel, the workspace, and the host
// entry's device copies. Kernels live in simt_backward.cu and tensor_core_backward.cu.

#include "flashref/cuda/backward.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "guards.hpp"
#include "host.hpp"
#include "launch.hpp"

namespace flashref::cuda {

using namespace host;

namespace {

// The workspace (Delta) in whole 256-byte pieces.
constexpr std::size_t kWorkspaceAlign = 256;

std::size_t round_up(std::size_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// The backward's tensors as the reference's type, for validate_backward's shape rules.
attention_gradients gradient_shapes(const device_backward_problem& p) {
  attention_gradients g;
  g.d_o = shape_only<const float>(p.d_o);
  g.dq = shape_only<float>(p.d_q);
  g.dk = shape_only<float>(p.d_k);
  g.dv = shape_only<float>(p.d_v);
  return g;
}

// d_o float32 or q's dtype; d_q, d_k, d_v one dtype, float32 or q's.
void check_gradient_dtypes(const device_backward_problem& p) {
  const input_dtype in = p.forward.q.dtype;
  if (p.d_o.dtype != input_dtype::float32 && p.d_o.dtype != in) {
    throw problem_error(std::string("d_o: expected dtype float32 or the input dtype ") +
                        to_string(in) + ", got " + to_string(p.d_o.dtype));
  }
  if (p.d_q.dtype != input_dtype::float32 && p.d_q.dtype != in) {
    throw problem_error(std::string("d_q: expected dtype float32 or the input dtype ") +
                        to_string(in) + ", got " + to_string(p.d_q.dtype));
  }
  for (const auto& [name, t] : {std::pair{"d_k", &p.d_k}, std::pair{"d_v", &p.d_v}}) {
    if (t->dtype != p.d_q.dtype) {
      throw problem_error(std::string(name) + ": expected dtype " + to_string(p.d_q.dtype) +
                          " (d_q's), got " + to_string(t->dtype));
    }
  }
}

bool tensor_core_backward_applies(const device_backward_problem& p) {
  return tensor_core_applies(p.forward) && p.d_o.dtype == p.forward.q.dtype &&
         tensor_core_layout(p.d_o);
}

// The dispatch table of backward.hpp: a forced kernel that cannot take the problem throws.
kernel_kind choose_backward(const device_backward_problem& p) {
  const bool tc = tensor_core_backward_applies(p);
  switch (p.forward.kernel) {
    case kernel_choice::automatic:
      if (tc) return hopper_runs_here() ? kernel_kind::hopper : kernel_kind::tensor_core;
      return kernel_kind::simt;
    case kernel_choice::hopper:
      if (!tc || !hopper_runs_here()) {
        throw problem_error(
            "kernel: expected a problem the hopper backward takes (a build with it, compute "
            "capability 9.0, bf16 or fp16, D = Dv in {64, 128}, 16-byte rows, d_o in the input "
            "dtype), got another");
      }
      return kernel_kind::hopper;
    case kernel_choice::tensor_core:
      if (!tc) {
        throw problem_error(
            "kernel: expected a problem the tensor_core backward takes (bf16 or fp16, D = Dv in "
            "{64, 128}, 16-byte rows, d_o in the input dtype), got another");
      }
      return kernel_kind::tensor_core;
    case kernel_choice::simt:
      break;
  }
  return kernel_kind::simt;
}

// Validates p; returns the kernel that runs it.
kernel_kind validate_device_backward(const device_backward_problem& p) {
  check_dtypes(p.forward);
  check_gradient_dtypes(p);
  validate_backward(shapes_of(p.forward), gradient_shapes(p));
  const kernel_kind kernel = choose_backward(p);
  check_device_limits(p.forward, kernel);
  return kernel;
}

// The most keys one query row can see: Lk, or less where a window bounds both sides (a causal
// mask bounds the right side at the diagonal).
std::int64_t keys_a_row_sees(const device_problem& f) {
  const std::int64_t lk = f.k.shape[2];
  const std::int64_t right = f.causal != causal_mode::none ? 0 : f.window_right;
  if (f.window_left < 0 || right < 0 || f.window_left >= lk || right >= lk) return lk;
  return std::min(lk, f.window_left + right + 1);
}

// Whether the Hopper kernel forms dQ beside dK and dV: where that measured faster than dQ's
// own pass on an H200 (cuda/NOTES.md, "b4.3", "b6"). Its extra cost is fixed per query row (the
// sums zeroed, then scaled into dQ; in fixed point also the bounds, and the conversion of each
// part), its saving grows with the keys a row sees. Float32 sums (deterministic = false): without
// a block mask from 2048 keys (dense +5.5 % at D = 64, +6.1 % at D = 128 there; causal +2.9 %,
// +2.0 %; at 1024 from +2.7 % to -6.6 %); with one, whose density the host does not know, from
// 8192 (+3.6 to +10.4 % at densities 0.5 / 0.2 / 0.05 there, but -3.1 % at D = 128, density
// 0.05; at 4096 down to -16 %). Fixed point (the default): where the rows see 2048 keys or more
// on average (visible_pairs: the saving is per pair, the cost per row; causal over Lq = Lk from
// 4096); with a block mask, whose density the host does not know, where a row can see 8192 or
// more (each part costs a conversion more than float32's). Measured against the dQ pass: at
// D = 64, whose dK, dV kernel hides the conversion under the next tile's products (b9), +4.4 %
// dense and +0.9 % causal at 4096, dense +4.1 % and +5.5 % at 2048 (b9, b19), causal -3.6 % and
// -0.5 % there; +1.7 % at density 0.2 with 8192 keys (-0.8 % at 4096). At D = 128, after b8
// put dQ's product ahead of dV's and dK's: +5.0 % dense and +0.9 % causal at 4096 (b18), +0.3 %
// dense and -3.8 % causal at 2048 (b19), +1.8 % at density 0.2 with 8192 keys (cuda/NOTES.md,
// b18-b20; an H100).
constexpr std::int64_t kSumsMinKeys = 2048, kSumsMinKeysBlockSparse = 8192;
constexpr std::int64_t kFixedMinMeanKeys = 2048, kFixedMinKeysBlockSparse = 8192;
bool dq_beside_dkdv(const device_backward_problem& p, kernel_kind kernel) {
  if (kernel != kernel_kind::hopper) return false;
  const device_problem& f = p.forward;
  const bool sparse = f.block_mask.data != nullptr;
  if (p.deterministic && !sparse) {
    const std::int64_t lq = f.q.shape[2];
    return lq > 0 && detail::visible_pairs(lq, f.k.shape[2], f.causal, f.window_left,
                                           f.window_right) >= kFixedMinMeanKeys * lq;
  }
  const std::int64_t keys = keys_a_row_sees(f);
  if (p.deterministic) return keys >= kFixedMinKeysBlockSparse;
  return keys >= (sparse ? kSumsMinKeysBlockSparse : kSumsMinKeys);
}

// The workspace: Delta (B·Hq·Lq floats), then, where dQ is formed beside dK and dV, its sums
// (launch.hpp: D = 64 and 128 only), and for fixed-point sums (deterministic) the rows' flags
// and scales (B·Hq·Lq words each) and the key/value heads' bounds (B·Hk pairs); `kernel` the
// one that runs p.
std::size_t delta_bytes(const device_backward_problem& p) {
  const auto& q = p.forward.q.shape;
  return round_up(std::size_t(q[0] * q[1] * q[2]) * sizeof(float));
}
std::size_t dq_sums_bytes(const device_backward_problem& p, kernel_kind kernel) {
  if (!dq_beside_dkdv(p, kernel)) return 0;
  const auto& q = p.forward.q.shape;
  return round_up(detail::hopper_dq_sums_bytes(q[0], q[1], q[2], q[3]));
}
bool fixed_point_sums(const device_backward_problem& p, kernel_kind kernel) {
  return p.deterministic && dq_sums_bytes(p, kernel) > 0;
}
// Fixed point's two bounds per (batch, key/value head).
std::size_t kv_bounds_bytes(const device_backward_problem& p, kernel_kind kernel) {
  if (!fixed_point_sums(p, kernel)) return 0;
  return round_up(std::size_t(p.forward.k.shape[0] * p.forward.k.shape[1]) * 8);
}
std::size_t workspace_bytes(const device_backward_problem& p, kernel_kind kernel) {
  // Delta, then the flags and the scales the same size again each.
  const std::size_t rows = fixed_point_sums(p, kernel) ? 2 * delta_bytes(p) : 0;
  return delta_bytes(p) + dq_sums_bytes(p, kernel) + rows + kv_bounds_bytes(p, kernel) +
         kWorkspaceAlign;  // never empty
}
std::size_t workspace_bytes(const device_backward_problem& p) {
  return workspace_bytes(p, choose_backward(p));
}

// Enqueues a validated backward; `mask` carries the problem's mask (kv_len from p.forward).
void enqueue_backward(const device_backward_problem& p, kernel_kind kernel, const mask_spec& mask,
                      double softmax_scale, cudaStream_t stream) {
  detail::backward_params bp{};
  bp.fwd = kernel_params_of(p.forward, mask, softmax_scale);
  bp.d_o = p.d_o.data;
  bp.d_o_elem = to_elem(p.d_o.dtype);
  bp.dq = p.d_q.data;
  bp.dk = p.d_k.data;
  bp.dv = p.d_v.data;
  bp.grad_out = to_elem(p.d_q.dtype);
  copy_array(bp.d_o_stride, p.d_o.stride);
  copy_array(bp.dq_stride, p.d_q.stride);
  copy_array(bp.dk_stride, p.d_k.stride);
  copy_array(bp.dv_stride, p.d_v.stride);
  bp.dq_store = detail::row_store_of(bp.dq, bp.dq_stride, bp.grad_out);
  bp.dk_store = detail::row_store_of(bp.dk, bp.dk_stride, bp.grad_out);
  bp.dv_store = detail::row_store_of(bp.dv, bp.dv_stride, bp.grad_out);

  const std::size_t need = workspace_bytes(p, kernel);
  void* ws = p.workspace;
  // Without the caller's workspace, flashref's pool lends it: that pool keeps what it has
  // mapped across synchronizations, where the device's default pool gives it back at each one
  // and the next call maps it again (measured on an H100: a call's host part 78–236 µs before,
  // 33–50 µs after; cuda/NOTES.md, "Pointers and memory in the device entry").
  std::optional<detail::stream_scratch> scratch;
  if (ws == nullptr) {
    scratch.emplace("workspace", need, stream);
    ws = scratch->get();
  } else if (p.workspace_bytes < need) {
    throw problem_error("workspace_bytes: expected at least " + std::to_string(need) + ", got " +
                        std::to_string(p.workspace_bytes));
  }
  char* next = static_cast<char*>(ws);
  const auto take = [&next](std::size_t bytes) { return std::exchange(next, next + bytes); };
  bp.delta = reinterpret_cast<float*>(take(delta_bytes(p)));
  if (dq_sums_bytes(p, kernel) > 0) bp.dq_sums = take(dq_sums_bytes(p, kernel));
  if (fixed_point_sums(p, kernel)) {
    bp.dq_row_flags = reinterpret_cast<std::uint32_t*>(take(delta_bytes(p)));
    bp.dq_row_scale = reinterpret_cast<float*>(take(delta_bytes(p)));
    bp.kv_bounds = reinterpret_cast<std::uint32_t*>(take(kv_bounds_bytes(p, kernel)));
  }
  const input_dtype in = p.forward.q.dtype;
  cudaError_t e = detail::launch_backward_delta(bp, to_elem(in), stream);
  if (e == cudaSuccess) {
    switch (kernel) {
      case kernel_kind::hopper:
#if defined(FLASHREF_CUDA_HOPPER)
        e = detail::launch_hopper_backward(bp, to_elem(in), stream);
#endif
        break;
      case kernel_kind::tensor_core:
        e = detail::launch_tensor_core_backward(bp, to_elem(in), stream);
        break;
      case kernel_kind::simt:
        e = detail::launch_simt_backward(bp, to_elem(in), stream);
        break;
    }
  }
  check(e, kernel == kernel_kind::hopper        ? "hopper backward launch"
           : kernel == kernel_kind::tensor_core ? "tensor-core backward launch"
                                                : "SIMT backward launch");
}

}  // namespace

std::size_t backward_workspace_bytes(const device_backward_problem& p) {
  validate_device_backward(p);
  return workspace_bytes(p);
}

const char* backward_kernel_for(const device_backward_problem& p) {
  return name_of(validate_device_backward(p));
}

void attention_backward(const device_backward_problem& p, cudaStream_t stream) {
  const kernel_kind kernel = validate_device_backward(p);
  check_device_memory(p);  // before any launch
  const attention_problem shapes = shapes_of(p.forward);
  enqueue_backward(p, kernel, make_mask_spec(shapes), shapes.softmax_scale(), stream);
}

void attention_backward(const attention_problem& p, const attention_gradients& g,
                        kernel_choice kernel) {
  validate_backward(p, g);
  const std::int64_t B = p.batch(), Hq = p.heads_q(), Hk = p.heads_k();
  const std::int64_t Lq = p.len_q(), Lk = p.len_k(), D = p.head_dim(), Dv = p.head_dim_v();

  // Each input is read once, into a contiguous copy that also tells whether it is finite: a
  // NaN or inf in q, k, v or dO would reach masked pairs through the tensor-core products.
  bool q_finite = true, k_finite = true, v_finite = true, d_o_finite = true;
  const std::vector<float> q = pack(p.q, &q_finite), k = pack(p.k, &k_finite),
                           v = pack(p.v, &v_finite), d_o = pack(g.d_o, &d_o_finite);
  const std::vector<float> o = pack(strided<const float, 4>{p.o.data, p.o.shape, p.o.stride});
  const std::vector<float> lse =
      pack(strided<const float, 3>{p.lse.data, p.lse.shape, p.lse.stride});

  device_backward_problem dp;
  const auto packed = [](const std::array<std::int64_t, 4>& shape, input_dtype t) {
    return device_tensor<4>{nullptr, t, shape, dense_strides<4>(shape)};
  };
  const auto describe_inputs = [&](input_dtype t) {
    dp.forward.q = packed(p.q.shape, t);
    dp.forward.k = packed(p.k.shape, t);
    dp.forward.v = packed(p.v.shape, t);
    dp.d_o = packed(g.d_o.shape, t);
  };
  describe_inputs(p.dtype);
  const host_choice hc = host_input(p.dtype, kernel, tensor_core_backward_applies(dp),
                                    q_finite && k_finite && v_finite && d_o_finite);
  describe_inputs(hc.input);
  dp.forward.kernel = hc.kernel;
  const kernel_kind chosen = choose_backward(dp);
  check_device_limits(dp.forward, chosen);

  cudaStream_t stream = nullptr;
  host_upload up;
  dp.forward.q.data = up.tensor("q", q, hc.input, stream);
  dp.forward.k.data = up.tensor("k", k, hc.input, stream);
  dp.forward.v.data = up.tensor("v", v, hc.input, stream);
  dp.d_o.data = up.tensor("d_o", d_o, hc.input, stream);  // rounded to bf16 / fp16 for tensor cores
  dp.forward.o = packed(p.o.shape, input_dtype::float32);
  dp.forward.o.data = up.tensor("o", o, input_dtype::float32, stream);
  const std::array<std::int64_t, 3> lse_shape{B, Hq, Lq};
  dp.forward.lse = {up.tensor("lse", lse, input_dtype::float32, stream), input_dtype::float32,
                    lse_shape, dense_strides<3>(lse_shape)};
  up.masks(p, dp.forward);
  const std::array<std::int64_t, 4> dq_shape{B, Hq, Lq, D}, dk_shape{B, Hk, Lk, D},
      dv_shape{B, Hk, Lk, Dv};
  dp.d_q = packed(dq_shape, input_dtype::float32);
  dp.d_k = packed(dk_shape, input_dtype::float32);
  dp.d_v = packed(dv_shape, input_dtype::float32);
  dp.d_q.data = up.alloc("dq", std::size_t(B * Hq * Lq * D) * sizeof(float));
  dp.d_k.data = up.alloc("dk", std::size_t(B * Hk * Lk * D) * sizeof(float));
  dp.d_v.data = up.alloc("dv", std::size_t(B * Hk * Lk * Dv) * sizeof(float));
  dp.workspace_bytes = workspace_bytes(dp);
  dp.workspace = up.alloc("workspace", dp.workspace_bytes);

  // The mask as the kernels see it: the block mask's device copy (dense strides), kv_len in
  // device memory (set from dp.forward).
  attention_problem on_device = p;
  on_device.block_mask = dp.forward.block_mask;
  enqueue_backward(dp, chosen, make_mask_spec(on_device), p.softmax_scale(), stream);
  check(cudaStreamSynchronize(stream), "backward kernels");
  download(dp.d_q.data, g.dq);
  download(dp.d_k.data, g.dk);
  download(dp.d_v.data, g.dv);
}

}  // namespace flashref::cuda
