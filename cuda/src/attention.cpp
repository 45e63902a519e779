// The CUDA forward's entries: the device entry and the host entry (validation, the choice of
// kernel, uploads and error reporting shared with the backward live in host.hpp). Kernels live
// in the .cu files behind launch.hpp.

#include "flashref/cuda/attention.hpp"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "flashref/reference/mask.hpp"
#include "guards.hpp"
#include "host.hpp"
#include "launch.hpp"

namespace flashref::cuda {

using namespace host;

namespace {

// Does the mask hide some key from some row (causal, a window, kv_len, a block mask)? Only
// then can a tensor-core kernel's P V carry a NaN or inf of V into a row that must not see it
// (0 times NaN in a partial tile): without a mask every row sees every key, in the reference
// too, so a non-finite V reaches each row there as well and the scan has nothing to protect.
// A window is counted as hiding keys whatever its width.
bool hides_keys(const mask_spec& m) {
  return m.causal != causal_mode::none || m.window_left >= 0 || m.window_right >= 0 ||
         m.kv_len != nullptr || m.block_mask != nullptr;
}

// Enqueues a validated problem; `mask` carries the problem's mask with kv_len in device memory.
// With `guard_v`, where the mask hides keys, a tensor-core kernel is followed by the SIMT kernel
// gated on flags that say whether V may have leaked a NaN or inf into a row that does not see
// its key (SPEC §2; cuda/NOTES.md): the Hopper kernel sets them itself from the values it
// stores, the mma.sync kernel is followed by a scan of V. `work_counter`: 4 bytes of device
// memory for the Hopper kernel's work counter, or null to take them from the stream-ordered pool.
void enqueue(const device_problem& p, kernel_kind kernel, const mask_spec& mask,
             double softmax_scale, cudaStream_t stream, bool guard_v = false,
             std::uint32_t* work_counter = nullptr) {
  if (p.q.shape[0] * p.q.shape[1] * p.q.shape[2] == 0) return;  // nothing to write
  detail::kernel_params kp = kernel_params_of(p, mask, softmax_scale);
  const detail::elem input = to_elem(p.q.dtype);
  const bool pool = detail::stream_scratch::available();
  guard_v = guard_v && hides_keys(mask) && kernel != kernel_kind::simt;
  // No stream-ordered pool here for the flags: the SIMT kernel alone.
  if (guard_v && !pool) kernel = kernel_kind::simt, guard_v = false;
  // When the gate's flags are set, the SIMT kernel writes every row again, a masked key's value
  // never entering a row. All stream-ordered.
  const auto launch_gated_simt = [&](std::uint32_t* flags, std::int64_t count) {
    kp.run_if = flags;
    kp.run_if_count = count;
    check(detail::launch_simt(kp, input, stream), "SIMT kernel launch");
  };
  switch (kernel) {
    case kernel_kind::hopper: {
#if defined(FLASHREF_CUDA_HOPPER)
      // The counter the persistent blocks take work items from (the caller's, else the first
      // word of a buffer from the stream-ordered pool; without either they take them in a fixed
      // stride), then the kernel's flags. Where no mask hides a key and Lq fills whole query
      // tiles, every item is the same work: a fixed stride shares such items as evenly as the
      // counter, and leaving the counter out saves the call the pool's allocation and the
      // counter's memset (host part 9.9 -> 6.6 µs; dense D = 128 +2 to +3 % at L = 512 and 1024,
      // cuda/NOTES.md "h20"). A short last tile per head (D = 64's 192-row items at L = 512:
      // -1.2 % with the stride) keeps the counter.
      const bool counted = hides_keys(mask) || kp.len_q % detail::hopper_tile_rows(kp) != 0;
      if (!counted) work_counter = nullptr;
      const bool counter_from_pool = counted && work_counter == nullptr;
      const int sms = detail::sm_count();
      const std::int64_t flags = guard_v ? detail::hopper_flag_count(kp, sms) : 0;
      std::optional<detail::stream_scratch> scratch;
      std::uint32_t* flag_words = nullptr;
      if (pool && (counter_from_pool || flags > 0)) {
        scratch.emplace("work_counter", std::size_t(1 + flags) * sizeof(std::uint32_t), stream);
        auto* words = static_cast<std::uint32_t*>(scratch->get());
        if (counter_from_pool) work_counter = words;
        if (flags > 0) flag_words = words + 1;
      }
      check(detail::launch_hopper(kp, input, work_counter, flag_words, sms, stream),
            "hopper kernel launch");
      if (flag_words != nullptr) launch_gated_simt(flag_words, flags);
#endif
      return;
    }
    case kernel_kind::tensor_core: {
      check(detail::launch_tensor_core(kp, input, stream), "tensor-core kernel launch");
      if (!guard_v) return;
      // The scan of V, after the fast kernel so that the host work here overlaps it.
      const dim3 grid = detail::nonfinite_scan_grid(kp, detail::sm_count());
      const std::size_t flags = std::size_t(grid.x) * grid.y;
      const detail::stream_scratch scratch("v", flags * sizeof(std::uint32_t), stream);
      auto* run_if = static_cast<std::uint32_t*>(scratch.get());
      check(detail::launch_nonfinite_scan(kp, input, grid, run_if, stream), "scan of V launch");
      launch_gated_simt(run_if, std::int64_t(flags));
      return;
    }
    case kernel_kind::simt:
      break;
  }
  check(detail::launch_simt(kp, input, stream), "SIMT kernel launch");
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
  // decides whether a tensor-core kernel applies. Only V's NaN or inf reaches other rows
  // through the forward's products (P·V), so only V's finiteness counts here.
  const bool half_kernel = tensor_core_applies(dp) || (hopper_applies(dp) && hopper_runs_here());
  const host_choice hc = host_input(p.dtype, kernel, half_kernel, v_finite);
  set_input_dtype(hc.input);
  dp.kernel = hc.kernel;
  const input_dtype in = hc.input;
  const kernel_kind chosen = choose(dp);
  check_device_limits(dp, chosen);

  cudaStream_t stream = nullptr;
  host_upload up;
  dp.q.data = up.tensor("q", q, in, stream);
  dp.k.data = up.tensor("k", k, in, stream);
  dp.v.data = up.tensor("v", v, in, stream);

  const std::array<std::int64_t, 4> o_shape{B, Hq, Lq, p.head_dim_v()};
  const std::array<std::int64_t, 3> lse_shape{B, Hq, Lq};
  device_buffer d_o("o", std::size_t(B * Hq * Lq * p.head_dim_v()) * sizeof(float));
  device_buffer d_lse("lse", std::size_t(B * Hq * Lq) * sizeof(float));
  // The Hopper kernel's work counter beside the outputs: the host entry holds no pool memory
  // after it returns.
  std::optional<device_buffer> d_counter;
  if (chosen == kernel_kind::hopper) d_counter.emplace("work_counter", sizeof(std::uint32_t));
  dp.o = {d_o.get(), input_dtype::float32, o_shape, dense_strides<4>(o_shape)};
  dp.lse = {d_lse.get(), input_dtype::float32, lse_shape, dense_strides<3>(lse_shape)};
  up.masks(p, dp);

  // The mask as the kernels see it: the block mask's device copy (dense strides), kv_len in
  // device memory (set by enqueue).
  attention_problem on_device = p;
  on_device.block_mask = dp.block_mask;
  enqueue(dp, chosen, make_mask_spec(on_device), p.softmax_scale(), stream, false,
          d_counter ? static_cast<std::uint32_t*>(d_counter->get()) : nullptr);
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
