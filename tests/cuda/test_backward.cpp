// The CUDA backward (SPEC §9) against the naive float64 golden gradients: the float32 SIMT
// kernel and the bf16 / fp16 tensor-core kernels, each forced; every backward fixture; the
// backward catalogue; random problems at the tensor-core head dims; bitwise determinism from run
// to run (dQ included); the device entry with caller memory, a workspace and a stream;
// block-sparse masks with empty query-block rows and key tiles no row sees (dK = dV = 0
// exactly); NaN confinement; errors that name the field.
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "../common/backward_check.hpp"
#include "../common/catalogue.hpp"
#include "cuda_test.hpp"
#include "flashref/cuda/attention.hpp"
#include "flashref/cuda/backward.hpp"
#include "flashref/flashref.hpp"
#include "flashref/testdata/cases.hpp"
#include "flashref/testdata/fixture.hpp"
#include "kernel_names.hpp"

using flashref::causal_mode;
using flashref::input_dtype;
using flashref::problem_data;
using flashref::problem_error;
using flashref::test::catalogue_case;
using flashref::test::problem_shape;
namespace fc = flashref::cuda;
using flashref::test::name_of;

namespace {

using flashref::test::bf16_bits;
using flashref::test::cuda_check;
using flashref::test::from_bf16_bits;

// The tensor-core backward takes D = Dv in {64, 128}.
bool tensor_core_dims(const problem_shape& s) {
  return s.D == s.Dv && (s.D == 64 || s.D == 128);
}

// The kernels to run a dtype on, each forced: simt, and tensor_core too for half precision at
// its head dims (automatic takes one of the two: tests/cuda checks the choice below).
// A bf16 backward problem at D = 64 that every kernel takes, for the kernel-choice checks; its
// memory is never read.
fc::device_backward_problem choice_probe() {
  fc::device_backward_problem dp;
  alignas(16) static float dummy[4] = {};  // never read: only shapes and dtypes are checked
  const std::array<std::int64_t, 4> shape{1, 1, 16, 64}, stride{1024, 1024, 64, 1};
  dp.forward.q = dp.forward.k = dp.forward.v = {dummy, input_dtype::bfloat16, shape, stride};
  dp.forward.o = {dummy, input_dtype::float32, shape, stride};
  dp.forward.lse = {dummy, input_dtype::float32, {1, 1, 16}, {16, 16, 1}};
  dp.d_o = dp.forward.q;
  dp.d_q = dp.d_k = dp.d_v = {dummy, input_dtype::float32, shape, stride};
  return dp;
}

// Can the Hopper backward run here (a build with it, compute capability 9.0)? Asked of the
// library: forcing it on a problem it takes throws exactly when it cannot run.
bool hopper_backward_device() {
  fc::device_backward_problem dp = choice_probe();
  dp.forward.kernel = fc::kernel_choice::hopper;
  try {
    return std::string(fc::backward_kernel_for(dp)) == "hopper";
  } catch (const problem_error&) {
    return false;
  }
}

// The half-precision backward kernels, each forced: the Hopper one only where it can run.
std::vector<fc::kernel_choice> half_backward_kernels() {
  std::vector<fc::kernel_choice> k{fc::kernel_choice::tensor_core};
  if (hopper_backward_device()) k.push_back(fc::kernel_choice::hopper);
  return k;
}

std::vector<fc::kernel_choice> backward_kernels(input_dtype dtype, const problem_shape& s) {
  std::vector<fc::kernel_choice> k{fc::kernel_choice::simt};
  if (dtype != input_dtype::float32 && tensor_core_dims(s)) {
    for (const fc::kernel_choice half : half_backward_kernels())
      k.push_back(half);
  }
  return k;
}

// The forward on the CUDA backend (its O and LSE are what the backward starts from, as in
// use), then the backward on `kernel`, judged against the golden gradients with `dtype`'s
// tolerance.
void run_and_check(problem_data& d, input_dtype dtype, fc::kernel_choice kernel,
                   std::uint64_t seed) {
  CAPTURE(name_of(kernel), flashref::to_string(dtype));
  fc::attention(d.problem());
  flashref::test::add_upstream_gradient(d, seed);
  fc::attention_backward(d.problem(), d.gradients(), kernel);
  FLASHREF_REQUIRE_GRADIENTS_CONFORM(flashref::test::check_backward_against_naive(d, dtype));
}

void check_on_every_kernel(const catalogue_case& c, input_dtype dtype) {
  CAPTURE(c.name, c.shape.describe(), c.seed);
  for (const fc::kernel_choice kernel : backward_kernels(dtype, c.shape)) {
    problem_data d = flashref::test::build(c, dtype);
    run_and_check(d, dtype, kernel, c.seed);
  }
}

std::vector<float> as_vector(const xt::xtensor<float, 4>& x) {
  return {x.begin(), x.end()};
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("cuda backward passes every backward fixture on every kernel",
          "[cuda][backward][fixtures]") {
  // The fixture folder: FLASHREF_TESTDATA_DIR in the environment, else the source tree's.
  const char* env = std::getenv("FLASHREF_TESTDATA_DIR");
  const std::filesystem::path dir = env != nullptr ? env : FLASHREF_TESTDATA_DIR;
  int on_simt = 0, on_tensor_cores = 0, on_hopper = 0;
  for (const flashref::testdata::case_info& c : flashref::testdata::cases()) {
    const flashref::testdata::fixture fx = flashref::testdata::read_fixture(dir / (c.name + ".h5"));
    if (!fx.grads) continue;  // the case states why it has none (test_fixtures checks that)
    const input_dtype dtype = fx.in.opt.dtype;
    problem_shape s;
    s.D = std::int64_t(fx.in.q.shape()[3]);
    s.Dv = std::int64_t(fx.in.v.shape()[3]);
    for (const fc::kernel_choice kernel : backward_kernels(dtype, s)) {
      CAPTURE(c.name, flashref::to_string(dtype), name_of(kernel));
      problem_data d = fx.in;
      fc::attention(d.problem());
      const flashref::attention_gradients g = d.gradients();
      for (auto* x : {&d.dq, &d.dk, &d.dv})
        std::fill(x->begin(), x->end(), NAN);  // unwritten elements must show
      fc::attention_backward(d.problem(), g, kernel);
      const auto& gold = *fx.grads;
      const std::int64_t D = gold.q_shape[3], Dv = gold.v_shape[3];
      using flashref::test::gather;
      FLASHREF_REQUIRE_GRADIENT_CONFORMS(
          "dq", flashref::compare_gradient(gold.dq, gather(g.dq).data(), D, gold.row_empty, dtype));
      FLASHREF_REQUIRE_GRADIENT_CONFORMS(
          "dk",
          flashref::compare_gradient(gold.dk, gather(g.dk).data(), D, gold.key_unseen, dtype));
      FLASHREF_REQUIRE_GRADIENT_CONFORMS(
          "dv",
          flashref::compare_gradient(gold.dv, gather(g.dv).data(), Dv, gold.key_unseen, dtype));
      on_simt += kernel == fc::kernel_choice::simt;
      on_tensor_cores += kernel == fc::kernel_choice::tensor_core;
      on_hopper += kernel == fc::kernel_choice::hopper;
    }
  }
  // Every fixture with gradients (test_fixtures counts at least 27) on the float32 kernel, and
  // the half-precision ones at D = Dv in {64, 128} on tensor cores: half_inputs_bf16 and
  // half_inputs_fp16 (the other twins carry no gradients).
  CHECK(on_simt >= 27);
  CHECK(on_tensor_cores >= 2);
  CHECK(on_hopper == (hopper_backward_device() ? on_tensor_cores : 0));
}

TEST_CASE("cuda backward: the backward catalogue on every kernel", "[cuda][backward]") {
  // float32 (the SIMT kernel) and both half-precision types (tensor_core where it applies).
  const input_dtype dtype =
      GENERATE(input_dtype::float32, input_dtype::bfloat16, input_dtype::float16);
  for (const catalogue_case& c : flashref::test::backward_cases())
    check_on_every_kernel(c, dtype);
}

TEST_CASE("cuda backward: random problems at the tensor-core head dims",
          "[cuda][backward][random]") {
  const input_dtype dtype = GENERATE(input_dtype::bfloat16, input_dtype::float16);
  for (catalogue_case c : flashref::test::random_cases(200, 24)) {
    c.shape = flashref::test::well_conditioned(c.shape);
    c.shape.D = c.shape.Dv = c.seed % 2 == 0 ? 64 : 128;
    c.shape.Lq = c.shape.Lq * 3 + 5, c.shape.Lk = c.shape.Lk * 3 + 7;  // several tiles
    if (c.shape.window_left == 0 && c.shape.window_right == 0) c.shape.window_right = 1;
    check_on_every_kernel(c, dtype);
  }
}

TEST_CASE("cuda backward: block-sparse with empty query-block rows and key tiles no row sees",
          "[cuda][backward][race]") {
  // Sparse enough that some key blocks are seen by no row of a whole GQA group and some query
  // blocks see nothing; block sizes equal to the kernels' tiles, larger, and dividing nothing.
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 320, s.Lk = 448, s.block_density = 0.12;
  const auto [d, bq, bk, causal] = GENERATE(table<std::int64_t, std::int64_t, std::int64_t, bool>(
      {{64, 64, 64, false}, {128, 128, 100, true}, {128, 48, 128, false}}));
  s.D = s.Dv = d, s.block_q = bq, s.block_k = bk;
  s.causal = causal ? causal_mode::bottom_right : causal_mode::none;
  const input_dtype dtype = input_dtype::bfloat16;
  problem_data base = flashref::test::build({"block-sparse backward", s, 70}, dtype);
  {
    // The golden gradients mark the empty rows and unseen keys; the case must have both (the
    // checks below require them exactly 0).
    problem_data d0 = base;
    flashref::test::add_upstream_gradient(d0, 70);
    const auto gold =
        flashref::reference::naive_attention_backward(d0.inputs(), d0.gradients().d_o);
    std::int64_t empty = 0, unseen = 0;
    for (char e : gold.row_empty)
      empty += e;
    for (char u : gold.key_unseen)
      unseen += u;
    CAPTURE(s.describe());
    REQUIRE(empty > 0);
    REQUIRE(unseen > 0);
  }
  std::vector<fc::kernel_choice> kernels = half_backward_kernels();
  kernels.push_back(fc::kernel_choice::simt);
  for (const fc::kernel_choice kernel : kernels) {
    CAPTURE(s.describe());
    problem_data dk = base;
    run_and_check(dk, dtype, kernel, 70);
  }
}

TEST_CASE("cuda backward: mask blocks as long as the rows or keys they cover, or longer",
          "[cuda][backward]") {
  // The hopper dK, dV kernel's walker forms the tiles' mask blocks in 32 bits with the block
  // sizes clamped to the lengths (common.cuh, kNarrow): a block exactly Lq or Lk long, longer,
  // and one that cuts the keys in two.
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 320, s.Lk = 448;
  const auto [bq, bk, density] = GENERATE(table<std::int64_t, std::int64_t, double>(
      {{320, 448, 1.0}, {400, 300, 0.5}, {1000, 1000, 1.0}, {64, 5000, 0.7}}));
  s.D = s.Dv = GENERATE(64, 128);
  s.causal = GENERATE(causal_mode::none, causal_mode::bottom_right);
  s.block_q = bq, s.block_k = bk, s.block_density = density;
  for (const fc::kernel_choice kernel : half_backward_kernels()) {
    CAPTURE(s.describe());
    problem_data d = flashref::test::build({"long mask blocks", s, 73}, input_dtype::bfloat16);
    run_and_check(d, input_dtype::bfloat16, kernel, 73);
  }
}

TEST_CASE("cuda backward is bitwise deterministic from run to run", "[cuda][backward][big]") {
  problem_shape s;
  s.B = 1, s.Hq = 8, s.Hk = 2, s.Lq = 500, s.Lk = 700, s.D = s.Dv = GENERATE(64, 128);
  s.block_q = 64, s.block_k = 128, s.block_density = 0.7, s.causal = causal_mode::bottom_right;
  std::vector<fc::kernel_choice> kernels = half_backward_kernels();
  kernels.push_back(fc::kernel_choice::simt);
  for (const fc::kernel_choice kernel : kernels) {
    CAPTURE(s.describe(), name_of(kernel));
    problem_data d = flashref::test::build({"determinism", s, 71}, input_dtype::bfloat16);
    fc::attention(d.problem());
    std::vector<float> dq, dk, dv;
    for (int run = 0; run < 3; ++run) {
      flashref::test::add_upstream_gradient(d, 71);
      fc::attention_backward(d.problem(), d.gradients(), kernel);
      if (run == 0) {
        FLASHREF_REQUIRE_GRADIENTS_CONFORM(
            flashref::test::check_backward_against_naive(d, input_dtype::bfloat16));
        dq = as_vector(d.dq), dk = as_vector(d.dk), dv = as_vector(d.dv);
      } else {
        REQUIRE(same_bits(as_vector(d.dq), dq));
        REQUIRE(same_bits(as_vector(d.dk), dk));
        REQUIRE(same_bits(as_vector(d.dv), dv));
      }
    }
  }
}

TEST_CASE("cuda backward: dQ over many key tiles is exact and repeatable",
          "[cuda][backward][big]") {
  // 15 key tiles of 128 (the Hopper kernels' tile): the first one a query tile sees moves with
  // the window, kv_len cuts a tile, the small mask blocks leave holes between the tiles a query
  // tile sees; dQ sums over all of them and must come out the same bits twice.
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 700, s.Lk = 1900, s.D = s.Dv = 128;
  const int shape = GENERATE(0, 1, 2);
  if (shape == 0) s.window_left = 300, s.window_right = 40, s.use_kv_len = true;
  if (shape == 1) s.block_q = 32, s.block_k = 48, s.block_density = 0.3;
  if (shape == 2) {
    s.causal = causal_mode::bottom_right, s.block_q = 128, s.block_k = 128, s.block_density = 0.5;
  }
  for (const fc::kernel_choice kernel : half_backward_kernels()) {
    CAPTURE(s.describe(), name_of(kernel));
    problem_data d = flashref::test::build({"many key tiles", s, 72}, input_dtype::bfloat16);
    fc::attention(d.problem());
    flashref::test::add_upstream_gradient(d, 72);
    fc::attention_backward(d.problem(), d.gradients(), kernel);
    FLASHREF_REQUIRE_GRADIENTS_CONFORM(
        flashref::test::check_backward_against_naive(d, input_dtype::bfloat16));
    const std::vector<float> dq = as_vector(d.dq);
    fc::attention_backward(d.problem(), d.gradients(), kernel);
    REQUIRE(same_bits(as_vector(d.dq), dq));
  }
}

TEST_CASE("cuda backward: dQ in fixed point on float16 and bfloat16, exact and repeatable",
          "[cuda][backward]") {
  // Long enough for the hopper kernel's fixed-point dQ (8192 keys a row can see, causal);
  // kv_len cuts a key tile, GQA, both input types through the host entry.
  if (!hopper_backward_device()) return;
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 150, s.Lk = 8300, s.D = s.Dv = GENERATE(64, 128);
  s.causal = causal_mode::bottom_right, s.use_kv_len = true;
  const input_dtype dtype = GENERATE(input_dtype::float16, input_dtype::bfloat16);
  CAPTURE(s.describe(), flashref::to_string(dtype));
  problem_data d = flashref::test::build({"fixed point dtypes", s, 75}, dtype);
  fc::attention(d.problem());
  flashref::test::add_upstream_gradient(d, 75);
  fc::attention_backward(d.problem(), d.gradients(), fc::kernel_choice::hopper);
  FLASHREF_REQUIRE_GRADIENTS_CONFORM(flashref::test::check_backward_against_naive(d, dtype));
  const std::vector<float> dq = as_vector(d.dq);
  fc::attention_backward(d.problem(), d.gradients(), fc::kernel_choice::hopper);
  REQUIRE(same_bits(as_vector(d.dq), dq));
}

namespace {

// Device memory freed at the end of a test.
struct device_memory {
  std::vector<void*> allocations;
  ~device_memory() {
    for (void* p : allocations)
      cudaFree(p);
  }
  void* alloc(std::size_t bytes) {
    void* d = nullptr;
    cuda_check(cudaMalloc(&d, bytes == 0 ? 1 : bytes));
    allocations.push_back(d);
    return d;
  }
  template <class T>
  void* upload(const std::vector<T>& host) {
    void* d = alloc(host.size() * sizeof(T));
    cuda_check(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  }
};

// A (B, L, H, X) bf16 copy of a (B, H, L, X) view: the [B, L, H, D] storage of FlashAttention.
template <class View>
std::vector<std::uint16_t> blhd_bits(const View& t) {
  const std::int64_t B = t.shape[0], H = t.shape[1], L = t.shape[2], X = t.shape[3];
  std::vector<std::uint16_t> out(std::size_t(B * L * H * X));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < L; ++i)
        for (std::int64_t x = 0; x < X; ++x)
          out[std::size_t(((b * L + i) * H + h) * X + x)] = bf16_bits(t(b, h, i, x));
  return out;
}

fc::device_tensor<4> blhd_tensor(void* data, input_dtype t, const std::array<std::int64_t, 4>& s) {
  // s = (B, H, L, X) stored as (B, L, H, X)
  return {data, t, s, {s[2] * s[1] * s[3], s[3], s[1] * s[3], 1}};
}

// The forward's tensors of `p` on the device: q, k, v, O as bf16 [B, L, H, X], LSE float32
// (B, Hq, Lq) contiguous; the mask's causal flag.
void upload_forward(device_memory& mem, fc::device_backward_problem& dp,
                    const flashref::attention_problem& p) {
  const input_dtype bf = input_dtype::bfloat16;
  dp.forward.q = blhd_tensor(mem.upload(blhd_bits(p.q)), bf, p.q.shape);
  dp.forward.k = blhd_tensor(mem.upload(blhd_bits(p.k)), bf, p.k.shape);
  dp.forward.v = blhd_tensor(mem.upload(blhd_bits(p.v)), bf, p.v.shape);
  dp.forward.o = blhd_tensor(mem.upload(blhd_bits(p.o)), bf, p.o.shape);
  const std::int64_t B = p.lse.shape[0], H = p.lse.shape[1], L = p.lse.shape[2];
  std::vector<float> lse(std::size_t(B * H * L));
  for (std::int64_t n = 0; n < std::int64_t(lse.size()); ++n)
    lse[std::size_t(n)] = p.lse(n / (H * L), n / L % H, n % L);
  dp.forward.lse = {mem.upload(lse), input_dtype::float32, p.lse.shape, {H * L, L, 1}};
  dp.forward.causal = p.causal;
}

}  // namespace

namespace {

// What check_device_entry saw: the workspace the entry needed and the gradients it wrote.
struct device_entry_result {
  std::size_t workspace = 0;
  std::vector<float> dq, dk, dv;
  std::vector<std::uint8_t> workspace_after;  // the caller's workspace as the call left it
};

// The device entry on d's problem, O, LSE and dO (bf16 in and out, [B, L, H, D], a stream; the
// caller's workspace or the entry's own); the gradients it wrote land in d (dO there rounded to
// bf16 as the device saw it).
device_entry_result run_device_entry(problem_data& d, fc::kernel_choice kernel,
                                     bool caller_workspace, bool deterministic) {
  CAPTURE(caller_workspace, name_of(kernel), deterministic);
  // The device copies: q, k, v, dO, O as bf16 [B, L, H, D]; LSE float32; dO rounded to bf16, so
  // the golden gradients are taken with the rounded dO.
  const flashref::attention_problem p = d.problem();
  const flashref::attention_gradients g = d.gradients();
  const auto& do_shape = g.d_o.shape;
  for (std::int64_t b = 0; b < do_shape[0]; ++b)
    for (std::int64_t h = 0; h < do_shape[1]; ++h)
      for (std::int64_t i = 0; i < do_shape[2]; ++i)
        for (std::int64_t x = 0; x < do_shape[3]; ++x)
          const_cast<float&>(g.d_o(b, h, i, x)) = from_bf16_bits(bf16_bits(g.d_o(b, h, i, x)));

  device_memory mem;
  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreate(&stream));
  fc::device_backward_problem dp;
  const input_dtype bf = input_dtype::bfloat16;
  upload_forward(mem, dp, p);
  if (p.kv_len != nullptr) {
    dp.forward.kv_len = static_cast<const std::int32_t*>(mem.upload(d.opt.kv_len));
  }
  dp.forward.window_left = p.window_left;
  dp.forward.window_right = p.window_right;
  if (p.has_block_mask()) {  // the problem's storage copied as it lies, with its strides
    const auto& mask = d.opt.block_mask;
    dp.forward.block_mask = {static_cast<const std::uint8_t*>(mem.upload(std::vector<std::uint8_t>(
                                 mask.data(), mask.data() + mask.size()))),
                             p.block_mask.shape, p.block_mask.stride};
    dp.forward.block_q = p.block_q;
    dp.forward.block_k = p.block_k;
  }
  dp.forward.kernel = kernel;
  dp.d_o = blhd_tensor(mem.upload(blhd_bits(g.d_o)), bf, g.d_o.shape);
  const auto out = [&](const std::array<std::int64_t, 4>& shape) {
    return blhd_tensor(mem.alloc(std::size_t(shape[0] * shape[1] * shape[2] * shape[3]) * 2), bf,
                       shape);
  };
  dp.d_q = out(g.dq.shape);
  dp.d_k = out(g.dk.shape);
  dp.d_v = out(g.dv.shape);
  dp.deterministic = deterministic;
  const std::size_t workspace = fc::backward_workspace_bytes(dp);
  if (caller_workspace) {
    dp.workspace_bytes = workspace;
    dp.workspace = mem.alloc(dp.workspace_bytes);
  }
  REQUIRE(std::string(fc::backward_kernel_for(dp)) == name_of(kernel));
  fc::attention_backward(dp, stream);
  cuda_check(cudaStreamSynchronize(stream));
  cuda_check(cudaStreamDestroy(stream));
  std::vector<std::uint8_t> workspace_after;
  if (caller_workspace) {
    workspace_after.resize(workspace);
    cuda_check(cudaMemcpy(workspace_after.data(), dp.workspace, workspace, cudaMemcpyDeviceToHost));
  }

  // Back to the host views, (B, L, H, X) bf16 -> (B, H, L, X) float32.
  const auto fetch = [&](const fc::device_tensor<4>& t, const flashref::strided<float, 4>& view) {
    const std::int64_t n = t.shape[0] * t.shape[1] * t.shape[2] * t.shape[3];
    std::vector<std::uint16_t> bits(static_cast<std::size_t>(n));
    cuda_check(cudaMemcpy(bits.data(), t.data, bits.size() * 2, cudaMemcpyDeviceToHost));
    for (std::int64_t b = 0; b < t.shape[0]; ++b)
      for (std::int64_t h = 0; h < t.shape[1]; ++h)
        for (std::int64_t i = 0; i < t.shape[2]; ++i)
          for (std::int64_t x = 0; x < t.shape[3]; ++x)
            view(b, h, i, x) = from_bf16_bits(
                bits[std::size_t(b * t.stride[0] + h * t.stride[1] + i * t.stride[2] + x)]);
  };
  fetch(dp.d_q, g.dq);
  fetch(dp.d_k, g.dk);
  fetch(dp.d_v, g.dv);
  return {workspace, as_vector(d.dq), as_vector(d.dk), as_vector(d.dv), std::move(workspace_after)};
}

// The device entry on d (run_device_entry), its gradients judged against the golden ones.
device_entry_result run_conforming(problem_data& d, fc::kernel_choice kernel, bool caller_workspace,
                                   bool deterministic) {
  const device_entry_result r = run_device_entry(d, kernel, caller_workspace, deterministic);
  FLASHREF_REQUIRE_GRADIENTS_CONFORM(
      flashref::test::check_backward_against_naive(d, input_dtype::bfloat16));
  return r;
}

// The device entry on the hopper kernel twice (the caller's workspace): the first run's
// gradients conform to the golden ones, the second gives dK and dV bit for bit again, and dQ too
// where `dq_repeats` (not float32 sums beside dK and dV). Returns the first run.
device_entry_result run_twice_on_hopper(problem_data& d, bool deterministic, bool dq_repeats) {
  const device_entry_result first =
      run_conforming(d, fc::kernel_choice::hopper, true, deterministic);
  const device_entry_result again =
      run_device_entry(d, fc::kernel_choice::hopper, true, deterministic);
  REQUIRE(same_bits(again.dk, first.dk));
  REQUIRE(same_bits(again.dv, first.dv));
  if (dq_repeats) REQUIRE(same_bits(again.dq, first.dq));
  return first;
}

// The device entry on `s` (run_device_entry), judged against the golden gradients.
device_entry_result check_device_entry(const problem_shape& s, fc::kernel_choice kernel,
                                       bool caller_workspace, bool deterministic) {
  CAPTURE(s.describe());
  problem_data d = flashref::test::build({"device entry", s, 72}, input_dtype::bfloat16);
  fc::attention(d.problem());  // O, LSE in float32 on the host
  flashref::test::add_upstream_gradient(d, 72);
  return run_conforming(d, kernel, caller_workspace, deterministic);
}

}  // namespace

TEST_CASE("cuda backward device entry: bf16 in and out, [B, L, H, D], a stream, a workspace",
          "[cuda][backward][race]") {
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 200, s.Lk = 333, s.D = s.Dv = GENERATE(64, 128);
  s.causal = causal_mode::bottom_right, s.use_kv_len = true;
  // The caller's workspace, or none: the entry then allocates it on the stream.
  const bool caller_workspace = GENERATE(true, false);
  const fc::kernel_choice kernel =
      GENERATE(fc::kernel_choice::tensor_core, fc::kernel_choice::hopper);
  if (kernel == fc::kernel_choice::hopper && !hopper_backward_device()) return;
  // Not deterministic: below the lengths where the hopper kernel forms dQ beside dK and dV,
  // the same kernels (and the same workspace) run.
  const bool deterministic = GENERATE(true, false);
  REQUIRE(check_device_entry(s, kernel, caller_workspace, deterministic).workspace > 0);
}

// x as the device sees it once uploaded in bf16, in float64.
double as_uploaded(float x) {
  return double(from_bf16_bits(bf16_bits(x)));
}

// max |K| and max_j ||V_j||^2 of each batch entry and key/value head (B, Hk) of d, a bhld
// problem, over the keys below kv_len, from the bf16 values the device entry uploads.
struct kv_maxima {
  double k_max = 0., v2_max = 0.;
};
std::vector<kv_maxima> fixed_point_kv_maxima(const problem_data& d) {
  const auto r = as_uploaded;
  const auto& ks = d.k.shape();
  const std::size_t B = ks[0], Hk = ks[1], Lk = ks[2], D = ks[3];
  std::vector<kv_maxima> out(B * Hk);
  for (std::size_t b = 0; b < B; ++b) {
    const std::size_t end =
        d.opt.kv_len.empty() ? Lk : std::min<std::size_t>(Lk, std::size_t(d.opt.kv_len[b]));
    for (std::size_t hk = 0; hk < Hk; ++hk) {
      kv_maxima& m = out[b * Hk + hk];
      for (std::size_t j = 0; j < end; ++j) {
        double v2 = 0.;
        for (std::size_t x = 0; x < D; ++x) {
          m.k_max = std::max(m.k_max, std::fabs(r(d.k(b, hk, j, x))));
          v2 += r(d.v(b, hk, j, x)) * r(d.v(b, hk, j, x));
        }
        m.v2_max = std::max(m.v2_max, v2);
      }
    }
  }
  return out;
}

// bound_i of backward.cuh ("dQ in fixed point") for each query row (B, Hq, Lq) of d, a bhld
// problem, from the bf16 values the device entry uploads: max|K| (|| dO_i || max_j ||V_j|| +
// |Delta_i|), the maxima over the batch's keys below kv_len, per key/value head.
std::vector<double> fixed_point_bounds(const problem_data& d) {
  const auto r = as_uploaded;
  const auto& qs = d.q.shape();
  const std::size_t B = qs[0], Hq = qs[1], Lq = qs[2], Hk = d.k.shape()[1], D = qs[3];
  const std::vector<kv_maxima> kv = fixed_point_kv_maxima(d);
  std::vector<double> bound(B * Hq * Lq);
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t h = 0; h < Hq; ++h) {
      const kv_maxima& m = kv[b * Hk + h / (Hq / Hk)];
      for (std::size_t i = 0; i < Lq; ++i) {
        double g2 = 0., delta = 0.;
        for (std::size_t x = 0; x < D; ++x) {
          g2 += r(d.d_o(b, h, i, x)) * r(d.d_o(b, h, i, x));
          delta += r(d.d_o(b, h, i, x)) * r(d.o(b, h, i, x));
        }
        bound[(b * Hq + h) * Lq + i] =
            m.k_max * (std::sqrt(g2) * std::sqrt(m.v2_max) + std::fabs(delta));
      }
    }
  return bound;
}

// One rounding step of bf16 at the magnitude of x (x finite, not 0).
float bf16_step(float x) {
  return std::ldexp(1.f, std::ilogb(x) - 7);
}

TEST_CASE("cuda backward: the hopper dQ beside dK and dV, in fixed point and in float32",
          "[cuda][backward][race]") {
  if (!hopper_backward_device()) return;
  // Long enough for the hopper kernel to form dQ beside dK and dV in either mode (2048 keys a
  // row on average; 8192 with a block mask); kv_len cuts a block's keys (its K rows past kv_len
  // zeroed), GQA, the window moving the first key tile each query tile sees. D = 128 splits dQ's
  // columns between the consumers, D = 64 its keys.
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 130, s.D = s.Dv = GENERATE(64, 128);
  const int shape = GENERATE(0, 1, 2);
  if (shape == 0) s.Lk = 8200, s.causal = causal_mode::bottom_right, s.use_kv_len = true;
  if (shape == 1) s.Lk = 9000, s.window_left = 8500, s.window_right = 100;
  if (shape == 2) s.B = 1, s.Lk = 16400, s.block_q = 64, s.block_k = 96, s.block_density = 0.3;
  const bool caller_workspace = shape != 1;  // the entry's own workspace once
  CAPTURE(s.describe());
  problem_data d = flashref::test::build({"device entry", s, 72}, input_dtype::bfloat16);
  fc::attention(d.problem());
  flashref::test::add_upstream_gradient(d, 72);
  const device_entry_result sums =
      run_conforming(d, fc::kernel_choice::hopper, caller_workspace, false);
  const device_entry_result fixed =
      run_conforming(d, fc::kernel_choice::hopper, caller_workspace, true);
  // Fixed point adds the rows' flags and scales (a word per query row each) and the bounds (two
  // words per batch and key/value head) to the float32 mode's workspace, in 256-byte pieces;
  // both hold the sums, B x Hq x 192 rows x D words (the float32 sums alone make 24 KiB or more).
  const auto pieces = [](std::int64_t bytes) { return std::size_t((bytes + 255) / 256 * 256); };
  REQUIRE(fixed.workspace ==
          sums.workspace + 2 * pieces(s.B * s.Hq * s.Lq * 4) + pieces(s.B * s.Hk * 8));
  REQUIRE(sums.workspace >= std::size_t(s.B * s.Hq * 192 * s.D) * 4);
  // dK and dV come from the same steps in the same order either way: the same bits.
  REQUIRE(same_bits(fixed.dk, sums.dk));
  REQUIRE(same_bits(fixed.dv, sums.dv));
  // dQ: fixed point rounds each of a row's n parts (n key tiles at most) to a unit below
  // 2^-28 bound_i (backward.cuh), so the two sums differ by under n 2^-29 bound_i, and float32's
  // own rounding by far less: each element within one bf16 step of the other's plus scale n
  // 2^-28 bound_i and n 2^-23 of the largest. And fixed point gives the same bits again.
  const std::vector<double> bound = fixed_point_bounds(d);
  const double n_parts = double((s.Lk + 127) / 128), scale = 1.0 / std::sqrt(double(s.D));
  float largest = 0.f;
  for (const float x : sums.dq)
    largest = std::max(largest, std::fabs(x));
  REQUIRE(largest > 0.f);
  for (std::size_t n = 0; n < sums.dq.size(); ++n) {
    const float a = fixed.dq[n], b = sums.dq[n];
    if (a == b) continue;
    const double row_bound = bound[n / std::size_t(s.D)];
    CAPTURE(n, a, b, largest, row_bound);
    REQUIRE(std::fabs(a - b) <= bf16_step(std::max(std::fabs(a), std::fabs(b))) +
                                    scale * n_parts * std::ldexp(row_bound, -28) +
                                    n_parts * std::ldexp(largest, -23));
  }
  const device_entry_result again =
      run_device_entry(d, fc::kernel_choice::hopper, !caller_workspace, true);
  REQUIRE(same_bits(again.dq, fixed.dq));
}

// The pair blocks (D = 64 where a dK, dV block's walk is short: a block mask, or at most 8192
// keys; one consumer warpgroup of 64 keys, two blocks per SM: hopper_backward.cu) at their edges:
// kv_len ending inside a block of 64 keys, whose K rows past it the single consumer zeroes before
// dQ = dS K reads them (dQ beside dK and dV: Lk >= 8192 under a block mask, 2048 without one), in
// fixed point and in float32; a last block holding fewer than 64 keys; mask blocks that do not
// divide the blocks; GQA; then the same edges with few keys (dK, dV by the pair blocks, dQ by its
// own pass), with and without a block mask. Golden gradients, and the bits again on a second run
// (dQ's float32 sums, in any order, only in fixed point).
TEST_CASE("cuda backward: the pair blocks at D = 64 with kv_len inside a block of 64 keys",
          "[cuda][backward][race]") {
  if (!hopper_backward_device()) return;
  problem_shape s;
  s.B = 3, s.Hq = 4, s.Hk = 2, s.D = s.Dv = 64, s.use_kv_len = true;
  const int shape = GENERATE(0, 1, 2, 3);
  if (shape == 0) s.Lq = 70, s.Lk = 8230, s.block_q = 64, s.block_k = 96, s.block_density = 0.4;
  if (shape == 1) s.Lq = 150, s.Lk = 1000, s.block_q = 48, s.block_k = 80, s.block_density = 0.5;
  if (shape == 2) s.Lq = 150, s.Lk = 2000, s.causal = causal_mode::bottom_right;
  if (shape == 3) s.Lq = 70, s.Lk = 4100;
  CAPTURE(s.describe());
  problem_data d = flashref::test::build({"pair blocks", s, 76}, input_dtype::bfloat16);
  // Batch entry 0 sees no key; the others' keys end inside a block of 64 keys (blocks [0, 64),
  // [64, 128), ...), one of them in the last block that holds a key (Lk = 64 n + r, r > 0).
  REQUIRE(d.opt.kv_len.size() == 3);
  d.opt.kv_len[1] = std::int32_t(s.Lk - 5);
  d.opt.kv_len[2] = std::int32_t(s.Lk / 2 + 7);
  for (const std::int32_t n : {d.opt.kv_len[1], d.opt.kv_len[2]})
    REQUIRE(n % 64 != 0);
  REQUIRE(s.Lk % 64 != 0);
  fc::attention(d.problem());
  flashref::test::add_upstream_gradient(d, 76);
  const bool deterministic = GENERATE(true, false);
  const bool dq_beside = shape == 0 || shape == 3;
  const device_entry_result first =
      run_twice_on_hopper(d, deterministic, deterministic || !dq_beside);
  // Shapes 0 and 3 form dQ beside dK and dV: its sums (B x Hq x Lq rounded up to 64 x D) in the
  // workspace.
  if (dq_beside) REQUIRE(first.workspace >= std::size_t(s.B * s.Hq * 128 * s.D) * 4);
}

// What the pre-passes leave in the workspace for fixed point (backward.cpp: Delta, the dQ sums,
// the rows' flags and scales, the bounds of each batch and key/value head, in 256-byte pieces),
// read back and held to the host's float64 from the same bf16 values: max |K| exactly (a maximum
// of representable values), max_j ||V_j||^2 and each Delta_i to float32's rounding of their
// sums, each row's scale the power of two that puts its bound in [2^28, 2^29), no row flagged.
// Key counts that end inside a tile of keys (kv_len cuts a batch short), GQA, D = 64 and 128
// (simt_backward.cu, kv_bounds_pipelined_kernel and delta_rows_pipelined_kernel).
TEST_CASE("cuda backward: fixed point's bounds, Delta and row scales in the workspace",
          "[cuda][backward]") {
  if (!hopper_backward_device()) return;
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 70, s.Lk = 8200 + GENERATE(0, 37), s.use_kv_len = true;
  s.D = s.Dv = GENERATE(64, 128);
  CAPTURE(s.describe());
  problem_data d = flashref::test::build({"fixed-point bounds", s, 76}, input_dtype::bfloat16);
  fc::attention(d.problem());
  flashref::test::add_upstream_gradient(d, 76);
  const device_entry_result r = run_conforming(d, fc::kernel_choice::hopper, true, true);
  const auto pieces = [](std::size_t bytes) { return (bytes + 255) / 256 * 256; };
  const std::size_t rows = std::size_t(s.B * s.Hq * s.Lq), pairs = std::size_t(s.B * s.Hk);
  const std::size_t row_piece = pieces(rows * 4), bounds_piece = pieces(pairs * 8);
  // Delta, the sums, flags, scales, bounds, and 256 bytes of alignment slack.
  REQUIRE(r.workspace_after.size() == r.workspace);
  REQUIRE(r.workspace > 3 * row_piece + bounds_piece + 256);
  const std::size_t sums = r.workspace - 3 * row_piece - bounds_piece - 256;
  REQUIRE(sums >= rows * std::size_t(s.D) * 4);
  const auto words = [&](std::size_t offset, std::size_t n) {
    std::vector<std::uint32_t> w(n);
    std::memcpy(w.data(), r.workspace_after.data() + offset, n * 4);
    return w;
  };
  const auto as_float = [](std::uint32_t w) {
    float f;
    std::memcpy(&f, &w, 4);
    return f;
  };
  const std::vector<std::uint32_t> delta = words(0, rows);
  const std::vector<std::uint32_t> flags = words(row_piece + sums, rows);
  const std::vector<std::uint32_t> scales = words(2 * row_piece + sums, rows);
  const std::vector<std::uint32_t> bounds = words(3 * row_piece + sums, 2 * pairs);

  // The host's side, from the bf16 values the device read.
  const auto bf = as_uploaded;
  const std::size_t Lq = std::size_t(s.Lq), D = std::size_t(s.D), Hq = std::size_t(s.Hq);
  const std::vector<kv_maxima> kv = fixed_point_kv_maxima(d);
  for (std::size_t pair = 0; pair < pairs; ++pair) {
    CAPTURE(pair, kv[pair].k_max, kv[pair].v2_max);
    REQUIRE(double(as_float(bounds[2 * pair])) == kv[pair].k_max);
    REQUIRE(std::fabs(double(as_float(bounds[2 * pair + 1])) - kv[pair].v2_max) <=
            1e-5 * kv[pair].v2_max);
  }
  const std::vector<double> bound = fixed_point_bounds(d);
  for (std::size_t n = 0; n < rows; ++n) {
    const std::size_t i = n % Lq, h = n / Lq % Hq, b = n / (Lq * Hq);
    double dot = 0., magnitude = 0.;
    for (std::size_t x = 0; x < D; ++x) {
      dot += bf(d.d_o(b, h, i, x)) * bf(d.o(b, h, i, x));
      magnitude += std::fabs(bf(d.d_o(b, h, i, x)) * bf(d.o(b, h, i, x)));
    }
    const double scaled = double(as_float(scales[n])) * bound[n];
    CAPTURE(n, b, h, i, dot, as_float(delta[n]), as_float(scales[n]), bound[n]);
    // Sums of D terms in float32: within D 2^-24 of the terms' magnitudes (under 1e-5).
    REQUIRE(std::fabs(double(as_float(delta[n])) - dot) <= 1e-5 * magnitude);
    REQUIRE(flags[n] == 0u);
    if (bound[n] == 0.) {  // a batch entry that sees no key (kv_len 0): every part is 0
      REQUIRE(as_float(scales[n]) == 1.f);
      continue;
    }
    // The device's bound is float32's rounding of the same expression: a relative 1e-4 either
    // side of the power-of-two window, far less than the factor of 2 a wrong scale would be off.
    REQUIRE(scaled >= std::ldexp(1.0 - 1e-4, 28));
    REQUIRE(scaled < std::ldexp(1.0 + 1e-4, 29));
  }
}

// The dK, dV kernel with dQ beside it issues a query tile's first products before the last
// tile's dQ is handed over (at D = 64; hopper_backward.cu, consume_pipelined), through a ring of
// three stages: key blocks that see 0 to 8 query tiles of a head (an empty key block, a single
// tile, as many tiles as stages and more), each count at several blocks, in both modes, against
// the float64 gradients and the same bits again.
TEST_CASE("cuda backward: the hopper dQ beside dK and dV over key blocks of 0 to 8 query tiles",
          "[cuda][backward][race]") {
  if (!hopper_backward_device()) return;
  problem_shape s;
  s.B = 1, s.Hq = 2, s.Hk = 2, s.Lq = 8 * 64, s.Lk = 16400, s.D = s.Dv = GENERATE(64, 128);
  s.block_q = 64, s.block_k = 128, s.block_density = 1.0;  // rewritten below
  CAPTURE(s.describe());
  problem_data d =
      flashref::test::build({"query tiles per key block", s, 75}, input_dtype::bfloat16);
  auto& mask = d.opt.block_mask;  // [B, H, 8 query blocks, 129 key blocks]
  REQUIRE(mask.shape()[2] == 8);
  for (std::size_t h = 0; h < mask.shape()[1]; ++h)
    for (std::size_t j = 0; j < mask.shape()[3]; ++j) {
      const std::size_t tiles = (j + 4 * h) % 9;  // query blocks 0 .. tiles - 1 see key block j
      for (std::size_t qb = 0; qb < mask.shape()[2]; ++qb)
        mask(0, h, qb, j) = qb < tiles ? 1 : 0;
    }
  fc::attention(d.problem());
  flashref::test::add_upstream_gradient(d, 75);
  const bool deterministic = GENERATE(true, false);
  const device_entry_result first = run_twice_on_hopper(d, deterministic, deterministic);
  // dQ was formed beside dK and dV: its sums (B x Hq x Lq x D words) in the workspace.
  REQUIRE(first.workspace >= std::size_t(s.B * s.Hq * s.Lq * s.D) * 4);
}

// What fixed point adds to the rows: a row whose dO is 0 gets dQ = 0 exactly (its bound is 0);
// an LSE far below its row's log-sum-exp breaks the bound (Σ_j P_ij > 1) and the row's dQ is
// NaN rather than a sum that wrapped; a NaN in a key reaches the rows whose parts include its key
// tile (the rows that see it, and those that mask it within its tile, whose product met 0 ·
// NaN), not the others: the bounds leave it out.
TEST_CASE(
    "cuda backward: the hopper dQ in fixed point for rows of zero dO or short LSE or NaN keys",
    "[cuda][backward]") {
  if (!hopper_backward_device()) return;
  // Row i sees keys up to 8000 + i (bottom-right causal): rows from 192 on see the key tile
  // [8192, 8320).
  problem_shape s;
  s.B = 1, s.Hq = 2, s.Hk = 1, s.Lq = 300, s.Lk = 8300, s.D = s.Dv = GENERATE(64, 128);
  s.causal = causal_mode::bottom_right;
  CAPTURE(s.describe());
  problem_data d = flashref::test::build({"fixed point", s, 74}, input_dtype::bfloat16);
  fc::attention(d.problem());
  flashref::test::add_upstream_gradient(d, 74);
  const auto row_is = [&](std::int64_t h, std::int64_t i, auto&& what) {
    for (std::int64_t x = 0; x < s.D; ++x)
      if (!what(d.dq(0, h, i, x))) return false;
    return true;
  };
  const auto finite = [](float x) { return std::isfinite(x); };
  const auto nan = [](float x) { return std::isnan(x); };
  SECTION("dO = 0 in a row") {
    for (std::int64_t x = 0; x < s.Dv; ++x)
      d.d_o(0, 1, 7, x) = 0.f;
    run_conforming(d, fc::kernel_choice::hopper, true, true);
    REQUIRE(row_is(1, 7, [](float x) { return x == 0.f && !std::signbit(x); }));
    REQUIRE_FALSE(row_is(1, 8, [](float x) { return x == 0.f; }));  // the next row is not
  }
  SECTION("an LSE 40 below its row's log-sum-exp") {
    // P e^40: the row's parts pass 2^30 however loose its bound (float32 sums would hold
    // e^40 times its dQ, finite and wrong).
    d.lse(0, 0, 150) -= 40.f;
    run_device_entry(d, fc::kernel_choice::hopper, true, true);
    for (std::int64_t h = 0; h < s.Hq; ++h)
      for (std::int64_t i = 0; i < s.Lq; ++i) {
        CAPTURE(h, i);
        REQUIRE((h == 0 && i == 150 ? row_is(h, i, nan) : row_is(h, i, finite)));
      }
  }
  SECTION("a NaN in key 8200 of the key tile [8192, 8320)") {
    d.k(0, 0, 8200, 5) = NAN;  // after the forward: O and LSE stay finite
    run_device_entry(d, fc::kernel_choice::hopper, true, true);
    for (std::int64_t h = 0; h < s.Hq; ++h)
      for (std::int64_t i = 0; i < s.Lq; ++i) {
        CAPTURE(h, i);
        if (i < 192) REQUIRE(row_is(h, i, finite));
        if (i >= 200) REQUIRE(row_is(h, i, nan));
      }
  }
}

// Where the hopper kernel forms dQ beside dK and dV (the dQ sums in the workspace), at D = 64 and
// 128 alike: in float32 where a row can see 2048 keys (a window bounding both sides counts its
// span, causal bounds the right side; 8192 with a block mask); in fixed point where the 64 rows
// see 2048 keys or more on average (bottom-right causal from Lk = 2080, top-left over 4096 keys
// 32.5 on average), with a block mask where a row can see 8192; elsewhere dQ has its own pass.
TEST_CASE("cuda backward: where the hopper dQ beside dK and dV applies", "[cuda][backward]") {
  if (!hopper_backward_device()) return;
  struct rule_case {
    std::int64_t lk;
    bool block_mask;
    causal_mode causal;
    std::int64_t left, right;
    bool applies;        // float32 sums (deterministic = false)
    bool fixed_applies;  // fixed-point sums (the default)
  };
  const causal_mode none = causal_mode::none, br = causal_mode::bottom_right,
                    tl = causal_mode::top_left;
  const rule_case c = GENERATE_COPY(values<rule_case>({
      {2048, false, none, -1, -1, true, true},      {2047, false, none, -1, -1, false, false},
      {2048, false, br, -1, -1, true, false},       {2080, false, br, -1, -1, true, true},
      {2079, false, br, -1, -1, true, false},       {4096, false, none, -1, -1, true, true},
      {4096, false, tl, -1, -1, true, false},       {4095, false, br, -1, -1, true, true},
      {8192, false, none, -1, -1, true, true},      {8191, false, br, -1, -1, true, true},
      {8192, false, none, 1000, 1047, true, false}, {8192, false, none, 1000, 1046, false, false},
      {8192, false, none, 2000, 2095, true, false}, {8192, false, none, 2000, 2094, true, false},
      {8192, false, none, 2016, -1, true, true},    {8192, false, none, 2015, -1, true, false},
      {8192, false, br, 2047, 5000, true, true},    {8192, false, br, 2046, -1, false, false},
      {8192, false, none, 3000, -1, true, true},    {9000, false, none, 4095, 4096, true, true},
      {9000, false, none, 4095, 4095, true, true},  {8192, true, none, -1, -1, true, true},
      {8191, true, none, -1, -1, false, false},     {16384, true, none, -1, -1, true, true},
      {16383, true, br, -1, -1, true, true},        {16384, true, none, 4000, 4000, false, false},
  }));
  const std::int64_t D = GENERATE(64, 128);
  CAPTURE(c.lk, c.block_mask, c.left, c.right, static_cast<int>(c.causal), D);
  const std::int64_t B = 1, H = 1, Lq = 64;
  device_memory mem;
  const input_dtype bf = input_dtype::bfloat16;
  const auto tensor = [&](std::int64_t L) {
    return blhd_tensor(mem.alloc(std::size_t(B * H * L * D) * 2), bf, {B, H, L, D});
  };
  fc::device_backward_problem dp;
  dp.forward.q = tensor(Lq);
  dp.forward.k = tensor(c.lk);
  dp.forward.v = tensor(c.lk);
  dp.forward.o = tensor(Lq);
  dp.forward.lse = {
      mem.alloc(std::size_t(B * H * Lq) * 4), input_dtype::float32, {B, H, Lq}, {H * Lq, Lq, 1}};
  dp.forward.causal = c.causal;
  dp.forward.window_left = c.left;
  dp.forward.window_right = c.right;
  if (c.block_mask) {
    const std::int64_t nq = 1, nk = (c.lk + 127) / 128;
    dp.forward.block_mask = {static_cast<const std::uint8_t*>(mem.alloc(std::size_t(nk))),
                             {1, 1, nq, nk},
                             {nq * nk, nq * nk, nk, 1}};
    dp.forward.block_q = 128;
    dp.forward.block_k = 128;
  }
  dp.forward.kernel = fc::kernel_choice::hopper;
  dp.d_o = tensor(Lq);
  dp.d_q = tensor(Lq);
  dp.d_k = tensor(c.lk);
  dp.d_v = tensor(c.lk);
  const std::size_t fixed = fc::backward_workspace_bytes(dp);
  dp.deterministic = false;
  const std::size_t float32 = fc::backward_workspace_bytes(dp);
  // Delta's 256 bytes and a spare 256 always; where the sums apply, 64 rows x D words for the
  // one query tile, and in fixed point the rows' flags and scales and the bounds, 256 each.
  REQUIRE(float32 == 512 + (c.applies ? std::size_t(64 * D * 4) : 0));
  REQUIRE(fixed == 512 + (c.fixed_applies ? std::size_t(64 * D * 4 + 3 * 256) : 0));
}

// The gradients' layout decides how they are stored (16-byte pieces of whole columns where
// the rows allow, 8-byte float pairs, else element by element), never what: bf16 gradients in
// packed and padded rows give the same bits, float32 in aligned and misaligned rows the same
// values, and the bf16 bits are the float32 values rounded to nearest.
TEST_CASE("cuda backward: the gradients' layout and dtype change no bit", "[cuda][backward]") {
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 200, s.D = s.Dv = GENERATE(64, 128);
  // 150 keys: dQ from the hopper's dQ pass; 8200: from the fixed-point sums of the dK, dV
  // kernel with dQ, written out by dq_from_sums in each of its three ways (16-byte pieces, float
  // pairs, element by element). Lq = 200 ends in a cut query tile.
  s.Lk = GENERATE(150, 8200);
  s.causal = causal_mode::bottom_right;
  const fc::kernel_choice kernel =
      GENERATE(fc::kernel_choice::tensor_core, fc::kernel_choice::hopper);
  if (kernel == fc::kernel_choice::hopper && !hopper_backward_device()) return;
  CAPTURE(s.describe(), name_of(kernel));
  problem_data d = flashref::test::build({"gradient layouts", s, 73}, input_dtype::bfloat16);
  fc::attention(d.problem());
  flashref::test::add_upstream_gradient(d, 73);
  const flashref::attention_problem p = d.problem();
  const flashref::attention_gradients g = d.gradients();
  const input_dtype bf = input_dtype::bfloat16, f32 = input_dtype::float32;
  // One run with every gradient as (B, H, L, X) of row pitch X + pad, `offset` elements into
  // its allocation; the three gradients returned row-major as float, one after the other.
  const auto run = [&](input_dtype out, std::int64_t pad, std::int64_t offset) {
    device_memory mem;
    fc::device_backward_problem dp;
    upload_forward(mem, dp, p);
    dp.forward.kernel = kernel;
    dp.d_o = blhd_tensor(mem.upload(blhd_bits(g.d_o)), bf, g.d_o.shape);
    const std::int64_t elem = out == f32 ? 4 : 2;
    std::vector<std::pair<unsigned char*, std::int64_t>> bases;
    const auto grad = [&](const std::array<std::int64_t, 4>& sh) {
      const std::int64_t pitch = sh[3] + pad, count = sh[0] * sh[1] * sh[2] * pitch + offset;
      auto* base = static_cast<unsigned char*>(mem.alloc(std::size_t(count * elem)));
      bases.emplace_back(base, count);
      return fc::device_tensor<4>{
          base + offset * elem, out, sh, {sh[1] * sh[2] * pitch, sh[2] * pitch, pitch, 1}};
    };
    dp.d_q = grad(g.dq.shape);
    dp.d_k = grad(g.dk.shape);
    dp.d_v = grad(g.dv.shape);
    REQUIRE(std::string(fc::backward_kernel_for(dp)) == name_of(kernel));
    if (kernel == fc::kernel_choice::hopper && s.Lk > 8192) {  // the workspace holds the sums
      REQUIRE(fc::backward_workspace_bytes(dp) >= std::size_t(s.B * s.Hq * 256 * s.D * 4));
    }
    fc::attention_backward(dp, nullptr);
    cuda_check(cudaDeviceSynchronize());
    std::vector<float> all;
    const fc::device_tensor<4>* tensors[3] = {&dp.d_q, &dp.d_k, &dp.d_v};
    for (int t = 0; t < 3; ++t) {
      const fc::device_tensor<4>& x = *tensors[t];
      std::vector<unsigned char> raw(std::size_t(bases[std::size_t(t)].second * elem));
      cuda_check(
          cudaMemcpy(raw.data(), bases[std::size_t(t)].first, raw.size(), cudaMemcpyDeviceToHost));
      const std::vector<float> one =
          flashref::test::strided_floats(raw, elem == 4, offset, x.shape, x.stride);
      all.insert(all.end(), one.begin(), one.end());
    }
    return all;
  };
  const std::vector<float> packed = run(bf, 0, 0), padded = run(bf, 4, 0);
  const std::vector<float> pairs = run(f32, 0, 0), single = run(f32, 0, 1);
  REQUIRE(packed.size() == pairs.size());
  std::size_t differ = 0;
  for (std::size_t n = 0; n < packed.size(); ++n) {
    if (bf16_bits(packed[n]) != bf16_bits(padded[n]) ||
        std::memcmp(&pairs[n], &single[n], 4) != 0 || bf16_bits(packed[n]) != bf16_bits(pairs[n]))
      ++differ;
  }
  CHECK(differ == 0);
}

TEST_CASE("cuda backward: a NaN in an input reaches only what it feeds", "[cuda][backward]") {
  // bf16 data with a NaN in one key: the host entry runs the float32 kernel, which never reads a
  // masked pair (a tensor-core product would add 0 · NaN into the rows that mask the key). Under
  // a causal mask the rows that see the key get a NaN score, hence a NaN LSE and dQ; the rows
  // before it keep finite gradients.
  problem_shape s;
  s.Lq = 96, s.Lk = 96, s.D = s.Dv = 64, s.causal = causal_mode::bottom_right;
  problem_data d = flashref::test::build({"nan", s, 73}, input_dtype::bfloat16);
  const std::size_t key = 40;
  d.k(0, 0, key, 7) = NAN;
  fc::attention(d.problem());
  flashref::test::add_upstream_gradient(d, 73);
  fc::attention_backward(d.problem(), d.gradients(), fc::kernel_choice::tensor_core);
  for (std::size_t i = 0; i < std::size_t(s.Lq); ++i) {
    CAPTURE(i);
    for (std::size_t x = 0; x < std::size_t(s.D); ++x)
      REQUIRE(std::isnan(d.dq(0, 0, i, x)) == (i >= key));
  }
}

TEST_CASE("cuda backward: kernel choice and errors name the field", "[cuda][backward]") {
  problem_shape s;
  s.Lq = 16, s.Lk = 16, s.D = s.Dv = 32;
  problem_data d = flashref::test::build({"errors", s, 74}, input_dtype::bfloat16);
  fc::attention(d.problem());
  flashref::test::add_upstream_gradient(d, 74);
  // D = 32: no tensor-core backward takes it, forced or not.
  REQUIRE_THROWS_WITH(fc::attention_backward(d.problem(), d.gradients(), fc::kernel_choice::hopper),
                      Catch::StartsWith("kernel: expected a problem the hopper backward takes"));
  REQUIRE_THROWS_WITH(
      fc::attention_backward(d.problem(), d.gradients(), fc::kernel_choice::tensor_core),
      Catch::StartsWith("kernel: expected a problem the tensor_core backward takes"));
  flashref::attention_gradients g = d.gradients();
  g.dk.shape[3] = 5;
  REQUIRE_THROWS_WITH(fc::attention_backward(d.problem(), g),
                      "dk: expected shape [1, 1, 16, 32], got [1, 1, 16, 5]");

  fc::device_backward_problem dp = choice_probe();
  REQUIRE(std::string(fc::backward_kernel_for(dp)) ==
          (hopper_backward_device() ? "hopper" : "tensor_core"));  // automatic
  dp.forward.kernel = fc::kernel_choice::simt;
  REQUIRE(std::string(fc::backward_kernel_for(dp)) == "simt");
  dp.forward.kernel = fc::kernel_choice::automatic;
  dp.d_o.dtype = input_dtype::float32;  // the tensor-core kernel takes dO in q's dtype
  REQUIRE(std::string(fc::backward_kernel_for(dp)) == "simt");
  dp.d_o.dtype = input_dtype::float16;
  REQUIRE_THROWS_WITH(fc::backward_kernel_for(dp),
                      "d_o: expected dtype float32 or the input dtype bfloat16, got float16");
  dp.d_o.dtype = input_dtype::bfloat16;
  dp.d_v.dtype = input_dtype::bfloat16;
  REQUIRE_THROWS_WITH(fc::backward_kernel_for(dp),
                      "d_v: expected dtype float32 (d_q's), got bfloat16");
  dp.d_v.dtype = input_dtype::float32;
  dp.forward.lse.data = nullptr;
  REQUIRE_THROWS_WITH(fc::backward_kernel_for(dp), Catch::StartsWith("lse:"));
}

TEST_CASE("the API runs the backward on the CUDA backend", "[cuda][backward]") {
  bool listed = false;
  for (const flashref::backend_info& info : flashref::backends())
    listed = listed || (info.id == flashref::backend::cuda && info.backward);
  REQUIRE(listed);
  problem_shape s;
  s.Lq = 40, s.Lk = 50, s.D = s.Dv = 16;
  problem_data d = flashref::test::random_problem(s, 75);
  fc::attention(d.problem());
  flashref::test::add_upstream_gradient(d, 75);
  REQUIRE(flashref::attention_backward(d.problem(), d.gradients(), flashref::backend::automatic) ==
          flashref::backend::cuda);
  FLASHREF_REQUIRE_GRADIENTS_CONFORM(flashref::test::check_backward_against_naive(d));
}
