// The CUDA backend against the naive float64 reference: the float32 SIMT path and the bf16 /
// fp16 tensor-core paths (the Hopper kernel on a compute capability 9.0 device, the mma.sync
// kernel everywhere), each forced in turn, every mask alone and combined, edge cases first, then
// random problems; the device-pointer entry; determinism; tiles with no visible key are never
// read.
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "../common/check.hpp"
#include "flashref/cuda/attention.hpp"
#include "flashref/flashref.hpp"
#include "flashref/testdata/cases.hpp"
#include "flashref/testdata/fixture.hpp"
#include "flashref/testdata/random.hpp"

using flashref::causal_mode;
using flashref::input_dtype;
using flashref::problem_error;
using flashref::test::check_against_naive;
using flashref::test::owned_problem;
using flashref::test::problem_shape;
namespace fc = flashref::cuda;

namespace {

// Inputs exactly representable in `dtype`, so that the golden float64 result on the stored
// float32 values is also the answer for the half-precision kernels.
void round_inputs(input_dtype dtype, owned_problem& op) {
  for (auto* x : {&op.q, &op.k, &op.v})
    for (float& e : *x)
      e = flashref::testdata::round_to(dtype, e);
}

void cuda_check(cudaError_t e) {
  REQUIRE(std::string(cudaGetErrorString(e)) == "no error");
}

// Can the Hopper kernel run here (a build with it, compute capability 9.0)? Asked of the
// library itself: forcing it on a problem it takes throws exactly when it cannot run.
bool hopper_device() {
  fc::device_problem dp;
  const std::array<std::int64_t, 4> shape{1, 1, 16, 64};
  const std::array<std::int64_t, 4> stride{1024, 1024, 64, 1};
  alignas(16) static const std::uint16_t kDummy[8] = {};  // never read: only shapes are checked
  dp.q = {kDummy, shape, stride};
  dp.k = {kDummy, shape, stride};
  dp.v = {kDummy, shape, stride};
  dp.o = {const_cast<std::uint16_t*>(kDummy), shape, stride};
  dp.kernel = fc::kernel_choice::hopper;
  try {
    return std::string(fc::kernel_for(dp)) == "hopper";
  } catch (const problem_error&) {
    return false;
  }
}

// The half-precision kernels, each forced: the Hopper kernel only where it can run.
std::vector<fc::kernel_choice> half_kernels() {
  std::vector<fc::kernel_choice> k{fc::kernel_choice::tensor_core};
  if (hopper_device()) k.push_back(fc::kernel_choice::hopper);
  return k;
}

const char* name_of(fc::kernel_choice k) {
  switch (k) {
    case fc::kernel_choice::hopper:
      return "hopper";
    case fc::kernel_choice::tensor_core:
      return "tensor_core";
    case fc::kernel_choice::simt:
      return "simt";
    case fc::kernel_choice::automatic:
      break;
  }
  return "automatic";
}

// Runs the host entry with inputs rounded to `dtype` and judges the result with that dtype's
// tolerance.
// integer_qk: Q and K rounded to integers and scale 1, so that even scores of magnitude
// 1e3..1e4 are exact in float32 and only the softmax itself is judged.
void run_and_check(const problem_shape& s, std::uint64_t seed, input_dtype dtype,
                   bool integer_qk = false,
                   fc::kernel_choice kernel = fc::kernel_choice::automatic) {
  CAPTURE(s.describe(), seed, flashref::to_string(dtype), integer_qk, name_of(kernel));
  owned_problem op(s, seed);
  if (integer_qk) {
    for (auto* x : {&op.q, &op.k})
      for (float& e : *x)
        e = std::nearbyint(e);
    op.p.scale = 1.0;
  }
  round_inputs(dtype, op);
  op.p.dtype = dtype;
  op.poison_outputs();
  fc::attention(op.p, kernel);
  FLASHREF_REQUIRE_CONFORMS(check_against_naive(op, dtype));
}

// The edge cases of SPEC §2 at head dims d, dv; run for every dtype given, on `kernel`.
void edge_cases(std::int64_t d, std::int64_t dv, input_dtype dtype,
                fc::kernel_choice kernel = fc::kernel_choice::automatic) {
  auto run_and_check = [kernel](const problem_shape& s, std::uint64_t seed, input_dtype dt,
                                bool integer_qk = false) {
    ::run_and_check(s, seed, dt, integer_qk, kernel);
  };
  problem_shape s;
  s.D = d, s.Dv = dv;
  SECTION("zero-sized dimensions") {
    for (auto dims : {std::array<std::int64_t, 4>{0, 1, 4, 4},
                      {1, 0, 4, 4},
                      {1, 1, 0, 4},
                      {1, 1, 4, 0},
                      {1, 1, 1, 0}}) {
      s.B = dims[0], s.Hq = dims[1], s.Hk = 1, s.Lq = dims[2], s.Lk = dims[3];
      run_and_check(s, 1, dtype);
    }
  }
  SECTION("lengths around the tile sizes") {
    for (std::int64_t lq : {1, 31, 64, 65, 129}) {
      for (std::int64_t lk : {1, 33, 64, 127, 200, 257}) {
        s.Lq = lq, s.Lk = lk;
        run_and_check(s, 2, dtype);
      }
    }
  }
  SECTION("causal, both alignments, more and fewer queries than keys") {
    s.causal = GENERATE(causal_mode::bottom_right, causal_mode::top_left);
    for (auto [lq, lk] : {std::pair<std::int64_t, std::int64_t>{200, 70}, {70, 200}, {150, 150}}) {
      s.Lq = lq, s.Lk = lk;
      run_and_check(s, 3, dtype);
    }
  }
  SECTION("local window, including rows whose window is empty") {
    s.Lq = 160, s.Lk = 90;
    s.window_left = GENERATE(0, 5, 40, -1);
    s.window_right = GENERATE(0, 17, -1);
    run_and_check(s, 4, dtype);
  }
  SECTION("kv_len = 0 next to normal entries") {
    s.B = 4, s.Lq = 70, s.Lk = 150, s.use_kv_len = true;
    run_and_check(s, 5, dtype);
  }
  SECTION("block masks: all empty, sparse, all full, sizes that divide nothing") {
    s.Lq = 200, s.Lk = 260;
    s.block_density = GENERATE(0.0, 0.2, 0.6, 1.0);
    for (auto [bq, bk] : {std::pair<std::int64_t, std::int64_t>{128, 128},
                          {24, 40},
                          {1, 7},
                          {64, 64},
                          {300, 300}}) {
      s.block_q = bq, s.block_k = bk;
      run_and_check(s, 6, dtype);
    }
  }
  SECTION("block mask broadcast over batch and heads, with causal and kv_len") {
    s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 130, s.Lk = 190;
    s.block_q = 32, s.block_k = 48, s.block_density = 0.4;
    s.mask_broadcast_b = true, s.mask_broadcast_h = GENERATE(false, true);
    s.causal = causal_mode::bottom_right, s.use_kv_len = true;
    run_and_check(s, 7, dtype);
  }
  SECTION("GQA and MQA") {
    s.Hq = 8, s.Hk = GENERATE(2, 1), s.Lq = 70, s.Lk = 100;
    run_and_check(s, 8, dtype);
  }
  SECTION("[B, L, H, D] layout") {
    s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 90, s.Lk = 130, s.blhd = true;
    s.causal = causal_mode::top_left;
    run_and_check(s, 9, dtype);
  }
  SECTION("extreme scores: exp overflows without the max subtraction") {
    s.Lq = 70, s.Lk = 150, s.value_scale = 24.0;
    run_and_check(s, 10, dtype, /*integer_qk=*/true);
  }
}

}  // namespace

TEST_CASE("cuda float32 path: edge cases", "[cuda][simt]") {
  const std::int64_t d = GENERATE(1, 16, 40, 64, 128, 256);
  edge_cases(d, d, input_dtype::float32);
}

TEST_CASE("cuda float32 path: Dv != D", "[cuda][simt][race]") {
  using dims = std::pair<std::int64_t, std::int64_t>;
  const auto [d, dv] = GENERATE(dims{24, 40}, dims{64, 128}, dims{96, 3});
  edge_cases(d, dv, input_dtype::float32);
}

TEST_CASE("cuda tensor cores (mma.sync): edge cases", "[cuda][tensor_core][race]") {
  const input_dtype dtype = GENERATE(input_dtype::bfloat16, input_dtype::float16);
  const std::int64_t d = GENERATE(64, 128);
  edge_cases(d, d, dtype, fc::kernel_choice::tensor_core);
}

TEST_CASE("cuda Hopper kernel: edge cases", "[cuda][hopper][race]") {
  if (!hopper_device()) {
    WARN("skipped: the Hopper kernel needs compute capability 9.0");
    return;
  }
  const input_dtype dtype = GENERATE(input_dtype::bfloat16, input_dtype::float16);
  const std::int64_t d = GENERATE(64, 128);
  edge_cases(d, d, dtype, fc::kernel_choice::hopper);
}

TEST_CASE("cuda half inputs without a tensor-core kernel fall back to float32", "[cuda]") {
  const input_dtype dtype = GENERATE(input_dtype::bfloat16, input_dtype::float16);
  using dims = std::pair<std::int64_t, std::int64_t>;
  const auto [d, dv] = GENERATE(dims{96, 96}, dims{64, 128}, dims{8, 8});
  problem_shape s;
  s.D = d, s.Dv = dv, s.Lq = 70, s.Lk = 90, s.causal = causal_mode::bottom_right;
  run_and_check(s, 11, dtype);
}

TEST_CASE("cuda float32 path: random problems", "[cuda][simt][random]") {
  for (std::uint64_t seed = 1; seed <= 120; ++seed) {
    run_and_check(flashref::test::random_shape(seed), seed, input_dtype::float32);
  }
}

TEST_CASE("cuda tensor cores: random problems", "[cuda][tensor_core][hopper][random]") {
  const input_dtype dtype = GENERATE(input_dtype::bfloat16, input_dtype::float16);
  for (const fc::kernel_choice kernel : half_kernels()) {
    for (std::uint64_t seed = 1; seed <= 50; ++seed) {
      problem_shape s = flashref::test::random_shape(seed);
      s.D = s.Dv = seed % 2 == 0 ? 64 : 128;
      s.Lq *= 2, s.Lk *= 2;  // several tiles of the kernel
      run_and_check(s, seed, dtype, /*integer_qk=*/false, kernel);
    }
  }
}

namespace {

// Device copies of a host problem for the device entry, in `input` element type.
struct device_copy {
  std::vector<void*> allocations;
  ~device_copy() {
    for (void* p : allocations)
      cudaFree(p);
  }
  void* upload(const void* host, std::size_t bytes) {
    void* d = nullptr;
    cuda_check(cudaMalloc(&d, bytes == 0 ? 1 : bytes));
    allocations.push_back(d);
    cuda_check(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
    return d;
  }
  void* alloc(std::size_t bytes) {
    void* d = nullptr;
    cuda_check(cudaMalloc(&d, bytes));
    allocations.push_back(d);
    return d;
  }
};

// bf16 bits of a float that is exactly representable (the low 16 bits are zero).
std::uint16_t bf16_bits(float x) {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  return std::uint16_t(u >> 16);
}
float from_bf16_bits(std::uint16_t b) {
  const std::uint32_t u = std::uint32_t(b) << 16;
  float x = 0;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// The device entry on bf16 data stored [B, L, H, D] with bf16 output [B, L, H, Dv].
std::vector<float> run_device_entry(const owned_problem& op, fc::kernel_choice kernel,
                                    cudaStream_t stream, std::vector<float>* lse_out) {
  const auto& s = op.shape;
  auto to_bits = [](const std::vector<float>& x) {
    std::vector<std::uint16_t> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i)
      out[i] = bf16_bits(x[i]);
    return out;
  };
  device_copy dc;
  const auto q = to_bits(op.q), k = to_bits(op.k), v = to_bits(op.v);
  fc::device_problem dp;
  dp.input = input_dtype::bfloat16;
  dp.output = input_dtype::bfloat16;
  auto blhd = [](std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t D) {
    return std::pair{std::array<std::int64_t, 4>{B, H, L, D},
                     std::array<std::int64_t, 4>{L * H * D, D, H * D, 1}};
  };
  auto [qs, qst] = blhd(s.B, s.Lq, s.Hq, s.D);
  auto [ks, kst] = blhd(s.B, s.Lk, s.Hk, s.D);
  auto [vs, vst] = blhd(s.B, s.Lk, s.Hk, s.Dv);
  auto [os, ost] = blhd(s.B, s.Lq, s.Hq, s.Dv);
  dp.q = {dc.upload(q.data(), q.size() * 2), qs, qst};
  dp.k = {dc.upload(k.data(), k.size() * 2), ks, kst};
  dp.v = {dc.upload(v.data(), v.size() * 2), vs, vst};
  const std::size_t o_count = std::size_t(s.B * s.Lq * s.Hq * s.Dv);
  dp.o = {dc.alloc(o_count * 2), os, ost};
  const std::size_t rows = std::size_t(s.B * s.Hq * s.Lq);
  dp.lse = {dc.alloc(rows * 4), {s.B, s.Hq, s.Lq}, {s.Hq * s.Lq, s.Lq, 1}};
  dp.causal = op.p.causal;
  dp.window_left = op.p.window_left;
  dp.window_right = op.p.window_right;
  if (op.p.has_block_mask()) {
    dp.block_mask = {dc.upload(op.mask.data(), op.mask.size()), op.p.block_mask.shape,
                     op.p.block_mask.stride};
    dp.block_q = op.p.block_q;
    dp.block_k = op.p.block_k;
  }
  if (op.p.kv_len != nullptr) {
    dp.kv_len = static_cast<const std::int32_t*>(
        dc.upload(op.kv_len.data(), op.kv_len.size() * sizeof(std::int32_t)));
  }
  dp.kernel = kernel;
  REQUIRE(std::string(fc::kernel_for(dp)) == name_of(kernel));
  fc::attention(dp, stream);
  cuda_check(cudaStreamSynchronize(stream));
  std::vector<std::uint16_t> o_bits(o_count);
  cuda_check(cudaMemcpy(o_bits.data(), dp.o.data, o_count * 2, cudaMemcpyDeviceToHost));
  lse_out->resize(rows);
  cuda_check(cudaMemcpy(lse_out->data(), dp.lse.data, rows * 4, cudaMemcpyDeviceToHost));
  // Back to row-major (B, Hq, Lq, Dv).
  std::vector<float> o(o_count);
  std::size_t n = 0;
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.Hq; ++h)
      for (std::int64_t i = 0; i < s.Lq; ++i)
        for (std::int64_t d = 0; d < s.Dv; ++d)
          o[n++] = from_bf16_bits(o_bits[std::size_t(((b * s.Lq + i) * s.Hq + h) * s.Dv + d)]);
  return o;
}

}  // namespace

TEST_CASE("cuda device entry: bf16 in and out, [B, L, H, D] storage, a stream", "[cuda][race]") {
  problem_shape s;
  s.B = 2, s.Hq = 8, s.Hk = 2, s.Lq = 300, s.Lk = 257, s.D = s.Dv = GENERATE(64, 128);
  s.causal = causal_mode::bottom_right;
  s.block_q = 40, s.block_k = 72, s.block_density = 0.5, s.use_kv_len = true;
  s.blhd = true;  // the host copies are stored [B, L, H, D], as the device ones
  const std::vector<fc::kernel_choice> kernels = half_kernels();
  const fc::kernel_choice kernel = GENERATE_COPY(from_range(kernels));
  CAPTURE(s.describe(), name_of(kernel));
  owned_problem op(s, 21);
  round_inputs(input_dtype::bfloat16, op);
  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreate(&stream));
  std::vector<float> lse;
  const std::vector<float> o = run_device_entry(op, kernel, stream, &lse);
  cuda_check(cudaStreamDestroy(stream));
  const flashref::reference::golden g = flashref::reference::naive_attention(op.p);
  double max_v = 0;
  for (float x : op.v)
    max_v = std::max(max_v, double(std::abs(x)));
  FLASHREF_REQUIRE_CONFORMS(
      compare(g, o.data(), lse.data(), default_tolerance(input_dtype::bfloat16, max_v)));
}

TEST_CASE("cuda is bitwise deterministic from run to run", "[cuda][big]") {
  problem_shape s;
  s.B = 2, s.Hq = 8, s.Hk = 4, s.Lq = 1500, s.Lk = 2100, s.D = s.Dv = 128;
  s.block_q = 128, s.block_k = 128, s.block_density = 0.3, s.causal = causal_mode::bottom_right;
  const input_dtype dtype = GENERATE(input_dtype::bfloat16, input_dtype::float32);
  std::vector<fc::kernel_choice> kernels{fc::kernel_choice::simt};
  if (dtype != input_dtype::float32) kernels = half_kernels();
  const fc::kernel_choice kernel = GENERATE_COPY(from_range(kernels));
  CAPTURE(flashref::to_string(dtype), name_of(kernel));
  owned_problem op(s, 31);
  round_inputs(dtype, op);
  op.p.dtype = dtype;
  fc::attention(op.p, kernel);
  const std::vector<float> o1 = op.o, lse1 = op.lse;
  op.poison_outputs();
  fc::attention(op.p, kernel);
  REQUIRE(std::memcmp(o1.data(), op.o.data(), o1.size() * sizeof(float)) == 0);
  REQUIRE(std::memcmp(lse1.data(), op.lse.data(), lse1.size() * sizeof(float)) == 0);
}

TEST_CASE("cuda never reads key tiles with no visible key", "[cuda][race]") {
  // Key blocks 1 and 4 are invisible to every query and hold NaN in K and V; query block 1
  // sees nothing. A kernel that loaded and computed any of those tiles would produce NaN.
  problem_shape s;
  s.Hq = 2, s.Lq = 384, s.Lk = 384, s.block_q = 128, s.block_k = 64, s.block_density = 0.7;
  s.D = s.Dv = GENERATE(64, 128);
  const input_dtype dtype = GENERATE(input_dtype::float32, input_dtype::bfloat16);
  std::vector<fc::kernel_choice> kernels{fc::kernel_choice::simt};
  if (dtype != input_dtype::float32) kernels = half_kernels();
  const fc::kernel_choice kernel = GENERATE_COPY(from_range(kernels));
  CAPTURE(s.D, flashref::to_string(dtype), name_of(kernel));
  owned_problem op(s, 41);
  round_inputs(dtype, op);
  op.p.dtype = dtype;
  const auto& bm = op.p.block_mask;
  auto* mask = op.mask.data();
  for (std::int64_t h = 0; h < bm.shape[1]; ++h) {
    for (std::int64_t qb = 0; qb < bm.shape[2]; ++qb) {
      for (std::int64_t kb = 0; kb < bm.shape[3]; ++kb) {
        const std::int64_t off = h * bm.stride[1] + qb * bm.stride[2] + kb * bm.stride[3];
        if (kb == 1 || kb == 4 || qb == 1) mask[off] = 0;
        if (qb == 0 && kb == 0) mask[off] = 1;
      }
    }
  }
  for (std::int64_t j : {64, 100, 127, 256, 300, 319}) {
    for (std::int64_t d = 0; d < s.D; ++d)
      op.k[std::size_t(j * s.D + d)] = NAN;
    for (std::int64_t d = 0; d < s.Dv; ++d)
      op.v[std::size_t(j * s.Dv + d)] = NAN;
  }
  op.poison_outputs();
  fc::attention(op.p, kernel);
  const flashref::conformance_report r = check_against_naive(op, dtype);
  CHECK(r.empty_rows == 2 * 128);
  FLASHREF_REQUIRE_CONFORMS(r);
}

TEST_CASE("cuda: a NaN or inf in V reaches only the rows that see its key", "[cuda][race]") {
  // Causal, Lq = Lk = 128: key 70 is visible to rows 70.. only, and rows 64..69 share its
  // query and key tiles. In the tensor-core kernel's P·V, 0 · NaN would reach them; the host
  // entry routes such a V to the float32 kernel, which never reads a masked key's value.
  problem_shape s;
  s.Lq = s.Lk = 128, s.causal = causal_mode::bottom_right;
  s.D = s.Dv = GENERATE(64, 128);
  const input_dtype dtype = GENERATE(input_dtype::bfloat16, input_dtype::float16);
  const float bad = GENERATE(NAN, INFINITY);
  CAPTURE(s.D, flashref::to_string(dtype), bad);
  owned_problem op(s, 43);
  round_inputs(dtype, op);
  op.p.dtype = dtype;
  op.v[std::size_t(70 * s.Dv + 5)] = bad;
  op.poison_outputs();
  fc::attention(op.p);
  for (std::int64_t i = 0; i < s.Lq; ++i) {
    CAPTURE(i);
    bool finite = std::isfinite(op.p.lse(0, 0, i));
    for (std::int64_t d = 0; d < s.Dv; ++d)
      finite = finite && std::isfinite(op.p.o(0, 0, i, d));
    REQUIRE(finite == (i < 70));
  }
  // A finite V still takes the tensor-core kernel, and meets the contract.
  op.v[std::size_t(70 * s.Dv + 5)] = 0.5f;
  op.poison_outputs();
  fc::attention(op.p);
  FLASHREF_REQUIRE_CONFORMS(check_against_naive(op, dtype));
}

TEST_CASE("cuda device entry: kernel choice and errors name the field", "[cuda]") {
  fc::device_problem dp;
  const std::array<std::int64_t, 4> shape{1, 2, 16, 64};
  const std::array<std::int64_t, 4> stride{2048, 1024, 64, 1};
  static const float kDummy[4] = {};  // never read: only shapes are checked before a launch
  dp.q = {kDummy, shape, stride};
  dp.k = {kDummy, shape, stride};
  dp.v = {kDummy, shape, stride};
  dp.o = {nullptr, shape, stride};
  dp.input = input_dtype::bfloat16;
  dp.o.data = const_cast<float*>(kDummy);
  CHECK(std::string(fc::kernel_for(dp)) == (hopper_device() ? "hopper" : "tensor_core"));
  dp.kernel = fc::kernel_choice::tensor_core;
  CHECK(std::string(fc::kernel_for(dp)) == "tensor_core");
  dp.kernel = fc::kernel_choice::simt;
  CHECK(std::string(fc::kernel_for(dp)) == "simt");
  dp.kernel = fc::kernel_choice::automatic;
  dp.input = input_dtype::float32;
  CHECK(std::string(fc::kernel_for(dp)) == "simt");
  dp.kernel = fc::kernel_choice::hopper;  // float32 input: no tensor-core kernel takes it
  REQUIRE_THROWS_WITH(fc::kernel_for(dp), Catch::Contains("kernel: expected a problem the hopper"));
  dp.kernel = fc::kernel_choice::automatic;

  dp.input = input_dtype::bfloat16;
  dp.q.stride = {2048, 1024, 1, 16};  // not unit stride along D: the SIMT kernel
  CHECK(std::string(fc::kernel_for(dp)) == "simt");
  dp.q.stride = stride;

  dp.output = input_dtype::float16;
  REQUIRE_THROWS_WITH(fc::kernel_for(dp), Catch::Contains("output: expected float32"));
  dp.output = input_dtype::float32;

  const std::array<std::int64_t, 4> big{1, 2, 16, 300};
  dp.q.shape = big, dp.k.shape = big;
  REQUIRE_THROWS_WITH(fc::kernel_for(dp), Catch::Contains("head_dim: expected at most 256"));
  dp.q.shape = shape, dp.k.shape = shape;

  dp.k.shape = {1, 3, 16, 64};
  REQUIRE_THROWS_AS(fc::kernel_for(dp), problem_error);
}

TEST_CASE("automatic prefers the CUDA backend when a device is present", "[cuda]") {
  REQUIRE(flashref::resolve(flashref::backend::automatic) == flashref::backend::cuda);
  const auto all = flashref::backends();
  bool found = false;
  for (const auto& b : all) {
    if (b.id == flashref::backend::cuda) found = b.built && b.available;
  }
  REQUIRE(found);
}

TEST_CASE("cuda passes every golden fixture, float32 and half-precision paths",
          "[cuda][fixtures]") {
  // The fixture folder: FLASHREF_TESTDATA_DIR in the environment, else the source tree's.
  const char* env = std::getenv("FLASHREF_TESTDATA_DIR");
  const std::filesystem::path dir = env != nullptr ? env : FLASHREF_TESTDATA_DIR;
  for (const flashref::testdata::case_info& c : flashref::testdata::cases()) {
    const flashref::testdata::fixture fx = flashref::testdata::read_fixture(dir / (c.name + ".h5"));
    // Every fixture on the float32 kernel; half-precision fixtures also on their own dtype
    // (the tensor-core kernel where the head dims allow).
    std::vector<std::pair<input_dtype, fc::kernel_choice>> runs{
        {input_dtype::float32, fc::kernel_choice::automatic}};
    if (fx.in.opt.dtype != input_dtype::float32) {
      runs.emplace_back(fx.in.opt.dtype, fc::kernel_choice::automatic);
      const std::int64_t d = fx.in.q.shape()[3], dv = fx.in.v.shape()[3];
      if (d == dv && (d == 64 || d == 128)) {
        for (const fc::kernel_choice k : half_kernels())
          runs.emplace_back(fx.in.opt.dtype, k);
      }
    }
    for (const auto& [dtype, kernel] : runs) {
      CAPTURE(c.name, flashref::to_string(dtype), name_of(kernel));
      xt::xtensor<float, 4> o;
      xt::xtensor<float, 3> lse;
      flashref::attention_problem p = fx.in.problem(o, lse);
      p.dtype = dtype;
      std::fill(o.begin(), o.end(), NAN);
      std::fill(lse.begin(), lse.end(), NAN);
      fc::attention(p, kernel);
      FLASHREF_REQUIRE_CONFORMS(flashref::compare(fx.golden, o.data(), lse.data(), fx.tol));
    }
  }
}
