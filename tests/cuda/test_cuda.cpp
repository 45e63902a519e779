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
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../common/catalogue.hpp"
#include "../common/check.hpp"
#include "cuda_test.hpp"
#include "flashref/cuda/attention.hpp"
#include "flashref/flashref.hpp"
#include "flashref/testdata/cases.hpp"
#include "flashref/testdata/fixture.hpp"
#include "flashref/testdata/random.hpp"
#include "kernel_names.hpp"

using flashref::causal_mode;
using flashref::input_dtype;
using flashref::problem_error;
using flashref::test::catalogue_case;
using flashref::test::check_against_naive;
using flashref::test::problem_shape;
namespace fc = flashref::cuda;
using flashref::test::name_of;

namespace {

using flashref::test::bf16_bits;
using flashref::test::cuda_check;
using flashref::test::from_bf16_bits;

// Can the Hopper kernel run here (a build with it, compute capability 9.0)? Asked of the
// library itself: forcing it on a problem it takes throws exactly when it cannot run.
bool hopper_device() {
  fc::device_problem dp;
  const std::array<std::int64_t, 4> shape{1, 1, 16, 64};
  const std::array<std::int64_t, 4> stride{1024, 1024, 64, 1};
  alignas(16) static std::uint16_t dummy[8] = {};  // never read: only shapes are checked
  const auto bf16 = input_dtype::bfloat16;
  dp.q = {dummy, bf16, shape, stride};
  dp.k = {dummy, bf16, shape, stride};
  dp.v = {dummy, bf16, shape, stride};
  dp.o = {dummy, input_dtype::float32, shape, stride};
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

// The host entry on one kernel (automatic: float32 the SIMT kernel; bfloat16 / float16 the
// tensor-core kernel where the head dims allow).
flashref::test::runner host_entry(fc::kernel_choice kernel = fc::kernel_choice::automatic) {
  return [kernel](const flashref::attention_problem& p) { fc::attention(p, kernel); };
}

// The kernels to run a dtype on: automatic, and each half-precision kernel forced.
std::vector<fc::kernel_choice> kernels_for(input_dtype dtype) {
  std::vector<fc::kernel_choice> k{fc::kernel_choice::automatic};
  if (dtype != input_dtype::float32) {
    for (const fc::kernel_choice h : half_kernels())
      k.push_back(h);
  }
  return k;
}

// Can the half-precision `kernel` take head dims (d, dv)? D = Dv in {64, 128}, and 256 on the
// Hopper kernel.
bool half_takes(fc::kernel_choice kernel, std::int64_t d, std::int64_t dv) {
  return d == dv && (d == 64 || d == 128 || (d == 256 && kernel == fc::kernel_choice::hopper));
}

// Runs op's problem again on `kernel` over poisoned outputs: O and LSE must come back with the
// bits of the run before.
void require_same_bits_again(flashref::problem_data& op, fc::kernel_choice kernel) {
  const flashref::attention_outputs first = op;
  flashref::test::poison_outputs(op);
  fc::attention(op.problem(), kernel);
  REQUIRE(std::memcmp(first.o.data(), op.o.data(), op.o.size() * sizeof(float)) == 0);
  REQUIRE(std::memcmp(first.lse.data(), op.lse.data(), op.lse.size() * sizeof(float)) == 0);
}

// Can `kernel`, forced, take the case?
bool takes(fc::kernel_choice kernel, const catalogue_case& c) {
  if (kernel == fc::kernel_choice::automatic || kernel == fc::kernel_choice::simt) return true;
  return half_takes(kernel, c.shape.D, c.shape.Dv);
}

}  // namespace

// The conformance suite (tests/conformance) runs the catalogue through backend::cuda; here it
// runs on every kernel, each forced (a half-precision kernel declines nothing of its head dims:
// problems it cannot take fall back only under automatic), and in this binary so that the GPU
// round's memcheck covers it.
TEST_CASE("cuda: the catalogue on every kernel", "[cuda][catalogue]") {
  const input_dtype dtype =
      GENERATE(input_dtype::float32, input_dtype::bfloat16, input_dtype::float16);
  for (const fc::kernel_choice kernel : kernels_for(dtype)) {
    CAPTURE(name_of(kernel));
    for (const catalogue_case& c : flashref::test::edge_cases()) {
      if (!takes(kernel, c)) continue;
      flashref::test::check_case(c, dtype, host_entry(kernel));
    }
    for (const catalogue_case& c : flashref::test::combined_masks())
      flashref::test::check_case(c, dtype, host_entry(kernel));
  }
}

TEST_CASE("cuda: random problems on every kernel", "[cuda][random]") {
  const input_dtype dtype =
      GENERATE(input_dtype::float32, input_dtype::bfloat16, input_dtype::float16);
  for (const catalogue_case& c : flashref::test::random_cases(1, 120))
    flashref::test::check_case(c, dtype, host_entry());
  // Several tiles of the tensor-core kernels at their head dims.
  for (const fc::kernel_choice kernel : kernels_for(dtype)) {
    CAPTURE(name_of(kernel));
    for (catalogue_case c : flashref::test::random_cases(1, 50)) {
      c.shape.D = c.shape.Dv = c.seed % 2 == 0 ? 64 : 128;
      c.shape.Lq *= 2, c.shape.Lk *= 2;
      flashref::test::check_case(c, dtype, host_entry(kernel));
    }
  }
}

// At D = 64 without a block mask the Hopper kernel's blocks take 192 query rows (three
// consumer warpgroups; two, 128 rows, for a causal mask over at most 1024 queries): the
// catalogue's shapes are mostly shorter, so these cases are long enough for that block, with
// query lengths no multiple of 192, every mask it takes, GQA and both output dtypes.
TEST_CASE("cuda: the Hopper kernel's 192-row blocks at D = 64", "[cuda][race]") {
  if (!hopper_device()) return;
  const input_dtype dtype = GENERATE(input_dtype::bfloat16, input_dtype::float16);
  std::vector<catalogue_case> cases;
  const auto add = [&](const char* name, std::int64_t lq, std::int64_t lk, causal_mode causal,
                       std::int64_t wl, std::int64_t wr, bool kv_len) {
    catalogue_case c;
    c.name = name;
    c.shape.B = 2, c.shape.Hq = 2, c.shape.Hk = 1, c.shape.D = c.shape.Dv = 64;
    c.shape.Lq = lq, c.shape.Lk = lk, c.shape.causal = causal;
    c.shape.window_left = wl, c.shape.window_right = wr, c.shape.use_kv_len = kv_len;
    c.seed = static_cast<std::uint64_t>(lq * 7 + lk);
    cases.push_back(c);
  };
  add("dense, the last block of 80 rows", 1040, 1300, causal_mode::none, -1, -1, false);
  add("causal bottom-right, more keys", 2000, 2100, causal_mode::bottom_right, -1, -1, false);
  add("causal top-left with kv_len", 1500, 1100, causal_mode::top_left, -1, -1, true);
  add("window (200, 50) with kv_len", 1000, 1000, causal_mode::none, 200, 50, true);
  add("one-sided window, fewer keys", 700, 450, causal_mode::none, 0, 130, false);
  for (const catalogue_case& c : cases)
    flashref::test::check_case(c, dtype, host_entry(fc::kernel_choice::hopper));
}

// At D = 128 with 4096 keys or more (8192 under a causal mask) and without a window or a block
// mask the Hopper kernel walks key tiles of 176 (tiles.cuh's tile_keys), K and V of a stage
// released apart: key lengths that end the last tile in either of its two mask words (128 and
// 48 keys: 4096 leaves 48 keys in the last tile, 4198 leaves 150), whole tiles (4224), kv_len
// cutting tiles (zero-filled V past it; batch 0 sees no key), GQA, query lengths no multiple
// of 128, and both causal alignments, whose diagonal crosses the 176-key tiles at every offset.
TEST_CASE("cuda: the Hopper kernel's 176-key tiles at D = 128", "[cuda][race]") {
  if (!hopper_device()) return;
  const input_dtype dtype = GENERATE(input_dtype::bfloat16, input_dtype::float16);
  std::vector<catalogue_case> cases;
  const auto add = [&](const char* name, std::int64_t lq, std::int64_t lk, bool kv_len,
                       causal_mode causal = causal_mode::none) {
    catalogue_case c;
    c.name = name;
    c.shape.B = kv_len ? 3 : 2, c.shape.Hq = 4, c.shape.Hk = 2, c.shape.D = c.shape.Dv = 128;
    c.shape.Lq = lq, c.shape.Lk = lk, c.shape.use_kv_len = kv_len, c.shape.causal = causal;
    c.seed = static_cast<std::uint64_t>(lq * 5 + lk);
    cases.push_back(c);
  };
  add("the last tile ends in its first word", 200, 4096, false);
  add("the last tile ends in its second word", 333, 4198, false);
  add("whole tiles", 256, 4224, false);
  add("kv_len cutting tiles", 300, 5000, true);
  add("few queries, kv_len", 130, 4100, true);
  add("causal bottom-right, few queries", 300, 8270, false, causal_mode::bottom_right);
  add("causal top-left, the diagonal through every tile", 500, 8192, false, causal_mode::top_left);
  add("causal bottom-right with kv_len", 300, 8500, true, causal_mode::bottom_right);
  for (const catalogue_case& c : cases)
    flashref::test::check_case(c, dtype, host_entry(fc::kernel_choice::hopper));
}

// At D = 256 without a block mask the Hopper kernel walks key tiles of 80 (tiles.cuh's
// tile_keys; 64 under a block mask, which the device-entry test takes): key lengths that end
// the last tile short, kv_len cutting tiles (batch 0 sees no key, a zero-filled V past it),
// windows on one or both sides, both causal alignments, GQA, query lengths no multiple of 128.
// (It also ran on h19's overlapped loop at D = 256, cuda/NOTES.md.)
TEST_CASE("cuda: the Hopper kernel's 80-key tiles at D = 256", "[cuda][race]") {
  if (!hopper_device()) return;
  const input_dtype dtype = GENERATE(input_dtype::bfloat16, input_dtype::float16);
  std::vector<catalogue_case> cases;
  const auto add = [&](const char* name, std::int64_t lq, std::int64_t lk, bool kv_len,
                       causal_mode causal, std::int64_t wl, std::int64_t wr) {
    catalogue_case c;
    c.name = name;
    c.shape.B = kv_len ? 3 : 2, c.shape.Hq = 4, c.shape.Hk = 2, c.shape.D = c.shape.Dv = 256;
    c.shape.Lq = lq, c.shape.Lk = lk, c.shape.use_kv_len = kv_len, c.shape.causal = causal;
    c.shape.window_left = wl, c.shape.window_right = wr;
    c.seed = static_cast<std::uint64_t>(lq * 3 + lk);
    cases.push_back(c);
  };
  const causal_mode none = causal_mode::none;
  add("dense, the last tile of 40 keys", 200, 1000, false, none, -1, -1);
  add("dense, whole tiles", 130, 1120, false, none, -1, -1);
  add("kv_len cutting tiles", 300, 1500, true, none, -1, -1);
  add("window (200, 50) with kv_len", 700, 900, true, none, 200, 50);
  add("one-sided window, fewer keys", 500, 333, false, none, 0, 130);
  add("causal bottom-right, more keys", 400, 1050, false, causal_mode::bottom_right, -1, -1);
  add("causal top-left with kv_len", 600, 500, true, causal_mode::top_left, -1, -1);
  for (const catalogue_case& c : cases)
    flashref::test::check_case(c, dtype, host_entry(fc::kernel_choice::hopper));
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

// The bf16 bits of every element of x, in x's order.
std::vector<std::uint16_t> to_bits(const xt::xtensor<float, 4>& x) {
  std::vector<std::uint16_t> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i)
    out[i] = bf16_bits(x.data()[i]);
  return out;
}

// The device entry on bf16 data stored [B, L, H, D] with bf16 output [B, L, H, Dv].
std::vector<float> run_device_entry(const problem_shape& s, const flashref::problem_data& op,
                                    fc::kernel_choice kernel, cudaStream_t stream,
                                    std::vector<float>* lse_out) {
  const flashref::attention_problem p = op.inputs();
  device_copy dc;
  const auto q = to_bits(op.q), k = to_bits(op.k), v = to_bits(op.v);
  fc::device_problem dp;
  const auto bf16 = input_dtype::bfloat16;
  auto blhd = [](std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t D) {
    return std::pair{std::array<std::int64_t, 4>{B, H, L, D},
                     std::array<std::int64_t, 4>{L * H * D, D, H * D, 1}};
  };
  auto [qs, qst] = blhd(s.B, s.Lq, s.Hq, s.D);
  auto [ks, kst] = blhd(s.B, s.Lk, s.Hk, s.D);
  auto [vs, vst] = blhd(s.B, s.Lk, s.Hk, s.Dv);
  auto [os, ost] = blhd(s.B, s.Lq, s.Hq, s.Dv);
  dp.q = {dc.upload(q.data(), q.size() * 2), bf16, qs, qst};
  dp.k = {dc.upload(k.data(), k.size() * 2), bf16, ks, kst};
  dp.v = {dc.upload(v.data(), v.size() * 2), bf16, vs, vst};
  const std::size_t o_count = std::size_t(s.B * s.Lq * s.Hq * s.Dv);
  dp.o = {dc.alloc(o_count * 2), bf16, os, ost};
  const std::size_t rows = std::size_t(s.B * s.Hq * s.Lq);
  dp.lse = {dc.alloc(rows * 4), input_dtype::float32, {s.B, s.Hq, s.Lq}, {s.Hq * s.Lq, s.Lq, 1}};
  dp.causal = p.causal;
  dp.window_left = p.window_left;
  dp.window_right = p.window_right;
  if (p.has_block_mask()) {
    const auto& mask = op.opt.block_mask;
    dp.block_mask = {static_cast<const std::uint8_t*>(dc.upload(mask.data(), mask.size())),
                     p.block_mask.shape, p.block_mask.stride};
    dp.block_q = p.block_q;
    dp.block_k = p.block_k;
  }
  if (p.kv_len != nullptr) {
    const auto& kv = op.opt.kv_len;
    dp.kv_len =
        static_cast<const std::int32_t*>(dc.upload(kv.data(), kv.size() * sizeof(std::int32_t)));
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
  s.B = 2, s.Hq = 8, s.Hk = 2, s.Lq = 300, s.Lk = 257, s.D = s.Dv = GENERATE(64, 128, 256);
  s.causal = causal_mode::bottom_right;
  s.block_q = 40, s.block_k = 72, s.block_density = 0.5, s.use_kv_len = true;
  s.blhd = true;  // the host copies are stored [B, L, H, D], as the device ones
  const std::vector<fc::kernel_choice> kernels = half_kernels();
  const fc::kernel_choice kernel = GENERATE_COPY(from_range(kernels));
  if (!half_takes(kernel, s.D, s.Dv)) return;  // D = 256: the Hopper kernel alone
  CAPTURE(s.describe(), name_of(kernel));
  flashref::problem_data op = flashref::test::random_problem(s, 21);
  flashref::test::round_inputs(op, input_dtype::bfloat16);
  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreate(&stream));
  std::vector<float> lse;
  const std::vector<float> o = run_device_entry(s, op, kernel, stream, &lse);
  cuda_check(cudaStreamDestroy(stream));
  const flashref::reference::golden g = flashref::reference::naive_attention(op.inputs());
  const double max_v = flashref::test::max_abs(op.v);
  FLASHREF_REQUIRE_CONFORMS(
      compare(g, o.data(), lse.data(), default_tolerance(input_dtype::bfloat16, max_v)));
}

namespace {

// The device entry on `op` (bf16 inputs, no block mask) with O as (B, H, L, Dv) of dtype `out`,
// row pitch `pitch` and column stride `col`, `offset` elements into its allocation; O returned
// row-major as float (LSE into `lse` when given).
std::vector<float> run_o_layout(const flashref::problem_data& op, const problem_shape& s,
                                fc::kernel_choice kernel, input_dtype out, std::int64_t pitch,
                                std::int64_t col, std::int64_t offset,
                                std::vector<float>* lse = nullptr) {
  const flashref::attention_problem p = op.inputs();
  const auto q = to_bits(op.q), k = to_bits(op.k), v = to_bits(op.v);
  const std::int64_t B = s.B, H = s.Hq, L = s.Lq, Dv = s.Dv;
  const auto bf16 = input_dtype::bfloat16, f32 = input_dtype::float32;
  device_copy dc;
  fc::device_problem dp;
  const std::array<std::int64_t, 4> qs{B, s.Hq, s.Lq, s.D}, ks{B, s.Hk, s.Lk, s.D};
  dp.q = {dc.upload(q.data(), q.size() * 2), bf16, qs, p.q.stride};
  dp.k = {dc.upload(k.data(), k.size() * 2), bf16, ks, p.k.stride};
  dp.v = {dc.upload(v.data(), v.size() * 2), bf16, ks, p.v.stride};
  const std::int64_t elem = out == input_dtype::float32 ? 4 : 2;
  const std::int64_t count = B * H * L * pitch + offset;
  auto* base = static_cast<unsigned char*>(dc.alloc(std::size_t(count * elem)));
  const std::array<std::int64_t, 4> ost{H * L * pitch, L * pitch, pitch, col};
  dp.o = {base + offset * elem, out, {B, H, L, Dv}, ost};
  if (lse != nullptr) {
    lse->resize(std::size_t(B * H * L));
    dp.lse = {dc.alloc(lse->size() * 4), f32, {B, H, L}, {H * L, L, 1}};
  }
  dp.causal = p.causal;
  dp.kernel = kernel;
  REQUIRE(std::string(fc::kernel_for(dp)) == name_of(kernel));
  fc::attention(dp, nullptr);
  cuda_check(cudaDeviceSynchronize());
  std::vector<unsigned char> raw(std::size_t(count * elem));
  cuda_check(cudaMemcpy(raw.data(), base, raw.size(), cudaMemcpyDeviceToHost));
  if (lse != nullptr) {
    cuda_check(cudaMemcpy(lse->data(), dp.lse.data, lse->size() * 4, cudaMemcpyDeviceToHost));
  }
  return flashref::test::strided_floats(raw, elem == 4, offset, {B, H, L, Dv}, ost);
}

}  // namespace

// O's layout decides how the epilogue stores (a TMA store from shared memory or 16-byte pieces of
// whole columns when its rows allow, 8-byte float pairs, else element by element), never what it
// stores: bf16 output in three layouts gives the same bits, float32 output in two the same values,
// and the bf16 bits are the float32 values rounded to nearest. Rows past Lq in the last tile and
// empty rows (bottom-right causal with Lq > Lk) included.
TEST_CASE("cuda device entry: O's layout and dtype change no bit of the result", "[cuda]") {
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 200, s.Lk = 150, s.D = s.Dv = GENERATE(64, 128, 256);
  s.causal = causal_mode::bottom_right;
  const std::vector<fc::kernel_choice> kernels = half_kernels();
  const fc::kernel_choice kernel = GENERATE_COPY(from_range(kernels));
  if (!half_takes(kernel, s.D, s.Dv)) return;
  CAPTURE(s.describe(), name_of(kernel));
  flashref::problem_data op = flashref::test::random_problem(s, 33);
  flashref::test::round_inputs(op, input_dtype::bfloat16);
  const std::int64_t Dv = s.Dv;
  const auto bf16 = input_dtype::bfloat16, f32 = input_dtype::float32;
  const auto run = [&](input_dtype out, std::int64_t pitch, std::int64_t col, std::int64_t offset,
                       std::vector<float>* lse = nullptr) {
    return run_o_layout(op, s, kernel, out, pitch, col, offset, lse);
  };
  const std::vector<float> packed = run(bf16, Dv, 1, 0);      // 16-byte pieces (or TMA)
  const std::vector<float> padded = run(bf16, Dv + 4, 1, 0);  // rows 8-byte aligned only
  const std::vector<float> spread = run(bf16, 2 * Dv, 2, 0);  // column stride 2
  std::vector<float> lse;
  const std::vector<float> pairs = run(f32, Dv, 1, 0, &lse);  // 8-byte float pairs
  const std::vector<float> single = run(f32, Dv, 1, 1);       // rows 4-byte aligned only
  REQUIRE(packed.size() == pairs.size());
  std::size_t differ = 0;
  for (std::size_t n = 0; n < packed.size(); ++n) {
    const bool same = bf16_bits(packed[n]) == bf16_bits(padded[n]) &&
                      bf16_bits(packed[n]) == bf16_bits(spread[n]) &&
                      std::memcmp(&pairs[n], &single[n], 4) == 0 &&
                      bf16_bits(packed[n]) == bf16_bits(pairs[n]);
    if (!same) ++differ;
  }
  CHECK(differ == 0);
  const flashref::reference::golden g = flashref::reference::naive_attention(op.inputs());
  const double max_v = flashref::test::max_abs(op.v);
  FLASHREF_REQUIRE_CONFORMS(
      compare(g, pairs.data(), lse.data(), default_tolerance(input_dtype::bfloat16, max_v)));
}

// The blocks that stage O for a TMA store and hold two Q buffers (D = 64 with 128 query rows,
// D = 128 with 128-key tiles: cuda/src/hopper/tiles.cuh), each block taking several work items,
// the last query tile cut short, GQA: bf16 O in whole 16-byte rows (the TMA store) has the bits
// of the float32 output rounded, and conforms to the float64 reference.
TEST_CASE("cuda: the Hopper kernel's staged O and two Q buffers over many work items",
          "[cuda][race]") {
  if (!hopper_device()) return;
  problem_shape s;
  s.B = 1, s.Hq = 40, s.Hk = 8, s.Lq = 400, s.Lk = 500;
  const int variant = GENERATE(0, 1, 2);
  s.D = s.Dv = variant == 0 ? 64 : 128;
  s.causal = variant == 1 ? causal_mode::none : causal_mode::bottom_right;
  CAPTURE(s.describe());
  flashref::problem_data op = flashref::test::random_problem(s, 71 + variant);
  flashref::test::round_inputs(op, input_dtype::bfloat16);
  const fc::kernel_choice hopper = fc::kernel_choice::hopper;
  const std::vector<float> staged = run_o_layout(op, s, hopper, input_dtype::bfloat16, s.Dv, 1, 0);
  std::vector<float> lse;
  const std::vector<float> pairs =
      run_o_layout(op, s, hopper, input_dtype::float32, s.Dv, 1, 0, &lse);
  REQUIRE(staged.size() == pairs.size());
  std::size_t differ = 0;
  for (std::size_t n = 0; n < staged.size(); ++n)
    differ += bf16_bits(staged[n]) == bf16_bits(pairs[n]) ? 0 : 1;
  CHECK(differ == 0);
  const flashref::reference::golden g = flashref::reference::naive_attention(op.inputs());
  const double max_v = flashref::test::max_abs(op.v);
  FLASHREF_REQUIRE_CONFORMS(
      compare(g, staged.data(), lse.data(), default_tolerance(input_dtype::bfloat16, max_v)));
}

TEST_CASE("cuda: the Hopper kernel's work items end to end, empty query tiles between them",
          "[cuda][race]") {
  // D = 128 with 128-key tiles (a block mask, or causal rows shorter than the wide tiles' 8192
  // keys), the block with two Q buffers and O staged for a TMA store, D = 64's block for block
  // masks (two consumers, the serial loop) and D = 256's block of 80-key tiles: 384 items on 132
  // blocks, so each block takes two or three, the next item's Q and first tiles loading while the
  // last one's are read and its O stored. With the block mask every third query block sees no
  // key (an item that closes at once between two that compute), and the last query tile is cut
  // short. At D = 128, and at D = 64 with the block mask, each item's last tile is marked and no
  // stage closes it (only the empty items have one); at D = 256 a stage closes each item; causal
  // rows give items of one tile too. D = 64 without a block mask takes the three-consumer block
  // (192 rows, 288 items: its producer waits for each Q by the state of its own arrival, two or
  // three times a block), dense and causal over 1100 queries. Run twice: the bits must not move.
  if (!hopper_device()) return;
  problem_shape s;
  s.B = 2, s.Hq = 24, s.Hk = 6, s.Lq = 1000, s.Lk = 1100;
  // 0: block mask, D = 128; 1: causal, D = 128; 2, 3: causal and dense at D = 256 (80-key
  // tiles, the last one cut short); 4: block mask, D = 64; 5, 6: dense and causal at D = 64.
  const int variant = GENERATE(0, 1, 2, 3, 4, 5, 6);
  const bool block_mask = variant == 0 || variant == 4;
  s.D = s.Dv = variant >= 4 ? 64 : variant < 2 ? 128 : 256;
  if (variant >= 5) s.Lq = 1100;  // causal over more than 1024 queries: three consumers too
  if (block_mask) {
    s.block_q = 128, s.block_k = 128, s.block_density = 0.4;
  } else if (variant != 3 && variant != 5) {
    s.causal = causal_mode::bottom_right;
  }
  CAPTURE(s.describe());
  flashref::problem_data op = flashref::test::random_problem(s, 83);
  flashref::test::round_inputs(op, input_dtype::bfloat16);
  std::int64_t empty_rows = 0;
  if (block_mask) {
    const auto bm = op.problem().block_mask;
    auto* mask = op.opt.block_mask.data();
    for (std::int64_t b = 0; b < bm.shape[0]; ++b)
      for (std::int64_t h = 0; h < bm.shape[1]; ++h)
        for (std::int64_t qb = 0; qb < bm.shape[2]; ++qb)
          for (std::int64_t kb = 0; kb < bm.shape[3]; ++kb) {
            std::uint8_t& m =
                mask[b * bm.stride[0] + h * bm.stride[1] + qb * bm.stride[2] + kb * bm.stride[3]];
            if (qb % 3 == 1) m = 0;
            if (qb % 3 != 1 && kb == (qb + h) % bm.shape[3]) m = 1;  // the others see a key
          }
    for (std::int64_t qb = 1; qb < bm.shape[2]; qb += 3)
      empty_rows += std::min<std::int64_t>(128, s.Lq - qb * 128);
    empty_rows *= s.B * s.Hq;
  }
  fc::attention(op.problem(), fc::kernel_choice::hopper);
  const flashref::conformance_report r = check_against_naive(op, input_dtype::bfloat16);
  CHECK(r.empty_rows == empty_rows);
  FLASHREF_REQUIRE_CONFORMS(r);
  require_same_bits_again(op, fc::kernel_choice::hopper);
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
  flashref::problem_data op = flashref::test::random_problem(s, 31);
  flashref::test::round_inputs(op, dtype);
  fc::attention(op.problem(), kernel);
  require_same_bits_again(op, kernel);
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
  flashref::problem_data op = flashref::test::random_problem(s, 41);
  flashref::test::round_inputs(op, dtype);
  const auto bm = op.problem().block_mask;
  auto* mask = op.opt.block_mask.data();
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
      op.k(0, 0, std::size_t(j), std::size_t(d)) = NAN;
    for (std::int64_t d = 0; d < s.Dv; ++d)
      op.v(0, 0, std::size_t(j), std::size_t(d)) = NAN;
  }
  fc::attention(op.problem(), kernel);
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
  flashref::problem_data op = flashref::test::random_problem(s, 43);
  flashref::test::round_inputs(op, dtype);
  op.v(0, 0, 70, 5) = bad;
  fc::attention(op.problem());
  for (std::size_t i = 0; i < std::size_t(s.Lq); ++i) {
    CAPTURE(i);
    bool finite = std::isfinite(op.lse(0, 0, i));
    for (std::size_t d = 0; d < std::size_t(s.Dv); ++d)
      finite = finite && std::isfinite(op.o(0, 0, i, d));
    REQUIRE(finite == (i < 70));
  }
  // A finite V still takes the tensor-core kernel, and meets the contract.
  op.v(0, 0, 70, 5) = 0.5f;
  flashref::test::poison_outputs(op);
  fc::attention(op.problem());
  FLASHREF_REQUIRE_CONFORMS(check_against_naive(op, dtype));
}

TEST_CASE("cuda device entry: kernel choice and errors name the field", "[cuda]") {
  fc::device_problem dp;
  const std::array<std::int64_t, 4> shape{1, 2, 16, 64};
  const std::array<std::int64_t, 4> stride{2048, 1024, 64, 1};
  static float dummy[4] = {};  // never read: only shapes are checked before a launch
  const auto bf16 = input_dtype::bfloat16;
  dp.q = {dummy, bf16, shape, stride};
  dp.k = {dummy, bf16, shape, stride};
  dp.v = {dummy, bf16, shape, stride};
  dp.o = {dummy, input_dtype::float32, shape, stride};
  const auto set_input = [&](input_dtype t) { dp.q.dtype = dp.k.dtype = dp.v.dtype = t; };
  CHECK(std::string(fc::kernel_for(dp)) == (hopper_device() ? "hopper" : "tensor_core"));
  dp.kernel = fc::kernel_choice::tensor_core;
  CHECK(std::string(fc::kernel_for(dp)) == "tensor_core");
  dp.kernel = fc::kernel_choice::simt;
  CHECK(std::string(fc::kernel_for(dp)) == "simt");
  dp.kernel = fc::kernel_choice::automatic;
  set_input(input_dtype::float32);
  CHECK(std::string(fc::kernel_for(dp)) == "simt");
  dp.kernel = fc::kernel_choice::hopper;  // float32 input: no tensor-core kernel takes it
  REQUIRE_THROWS_WITH(fc::kernel_for(dp), Catch::Contains("kernel: expected a problem the hopper"));
  dp.kernel = fc::kernel_choice::automatic;

  set_input(bf16);
  dp.q.stride = {2048, 1024, 1, 16};  // not unit stride along D: the SIMT kernel
  CHECK(std::string(fc::kernel_for(dp)) == "simt");
  dp.q.stride = stride;

  // D = 256: the Hopper kernel where it runs, else SIMT; tensor_core, forced, declines it.
  {
    fc::device_problem d256 = dp;
    const std::array<std::int64_t, 4> s256{1, 2, 16, 256}, t256{8192, 4096, 256, 1};
    d256.q = {dummy, bf16, s256, t256};
    d256.k = {dummy, bf16, s256, t256};
    d256.v = {dummy, bf16, s256, t256};
    d256.o = {dummy, input_dtype::float32, s256, t256};
    CHECK(std::string(fc::kernel_for(d256)) == (hopper_device() ? "hopper" : "simt"));
    d256.kernel = fc::kernel_choice::tensor_core;
    REQUIRE_THROWS_WITH(fc::kernel_for(d256),
                        Catch::StartsWith("kernel: expected a problem the tensor_core kernel"));
  }

  dp.o.dtype = input_dtype::float16;
  REQUIRE_THROWS_WITH(fc::kernel_for(dp),
                      Catch::Contains("o: expected dtype float32 or the input dtype bfloat16, got "
                                      "float16"));
  dp.o.dtype = input_dtype::float32;
  dp.v.dtype = input_dtype::float16;
  REQUIRE_THROWS_WITH(fc::kernel_for(dp),
                      Catch::Contains("v: expected dtype bfloat16 (q's), got float16"));
  dp.v.dtype = bf16;
  dp.lse = {dummy, bf16, {1, 2, 16}, {32, 16, 1}};
  REQUIRE_THROWS_WITH(fc::kernel_for(dp),
                      Catch::Contains("lse: expected dtype float32, got bfloat16"));
  dp.lse = {};

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
      const std::size_t d = fx.in.q.shape()[3], dv = fx.in.v.shape()[3];
      for (const fc::kernel_choice k : half_kernels()) {
        if (half_takes(k, std::int64_t(d), std::int64_t(dv))) runs.emplace_back(fx.in.opt.dtype, k);
      }
    }
    for (const auto& [dtype, kernel] : runs) {
      CAPTURE(c.name, flashref::to_string(dtype), name_of(kernel));
      flashref::problem_data d = fx.in;
      flashref::attention_problem p = d.problem();
      auto& o = d.o;
      auto& lse = d.lse;
      p.dtype = dtype;
      std::fill(o.begin(), o.end(), NAN);
      std::fill(lse.begin(), lse.end(), NAN);
      fc::attention(p, kernel);
      FLASHREF_REQUIRE_CONFORMS(flashref::compare(fx.golden, o.data(), lse.data(), fx.tol));
    }
  }
}

namespace {

// Throws (rather than REQUIRE, which is not thread-safe) on a CUDA error.
void cuda_or_throw(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

struct stream_result {
  std::vector<float> o, lse;  // (B, Hq, Lq, Dv), (B, Hq, Lq) row-major
};

// The device entry on one stream, callable from any thread: q, k, v uploaded in `input`
// (float32, or bfloat16 when every value is representable), O and LSE in float32. Row-major
// [B, H, L, D] problems only (random_problem without blhd).
stream_result run_on_stream(const flashref::problem_data& op, input_dtype input,
                            cudaStream_t stream) {
  const flashref::attention_problem p = op.inputs();
  std::vector<void*> allocations;
  struct freer {
    std::vector<void*>& a;
    ~freer() {
      for (void* x : a)
        cudaFree(x);
    }
  } release{allocations};
  auto upload = [&](const void* host, std::size_t bytes) {
    void* d = nullptr;
    cuda_or_throw(cudaMalloc(&d, bytes == 0 ? 1 : bytes), "cudaMalloc");
    allocations.push_back(d);
    cuda_or_throw(cudaMemcpyAsync(d, host, bytes, cudaMemcpyHostToDevice, stream), "upload");
    return d;
  };
  std::vector<std::vector<std::uint16_t>> bits;  // kept alive until the stream is synchronized
  auto tensor = [&](const xt::xtensor<float, 4>& x) -> void* {
    if (input == input_dtype::float32) return upload(x.data(), x.size() * sizeof(float));
    bits.emplace_back(x.size());
    for (std::size_t i = 0; i < x.size(); ++i)
      bits.back()[i] = bf16_bits(x.data()[i]);
    return upload(bits.back().data(), x.size() * 2);
  };
  fc::device_problem dp;
  dp.q = {tensor(op.q), input, p.q.shape, p.q.stride};
  dp.k = {tensor(op.k), input, p.k.shape, p.k.stride};
  dp.v = {tensor(op.v), input, p.v.shape, p.v.stride};
  const std::int64_t B = p.batch(), Hq = p.heads_q(), Lq = p.len_q(), Dv = p.head_dim_v();
  stream_result r;
  r.o.resize(std::size_t(B * Hq * Lq * Dv));
  r.lse.resize(std::size_t(B * Hq * Lq));
  dp.o = {upload(r.o.data(), r.o.size() * 4),
          input_dtype::float32,
          {B, Hq, Lq, Dv},
          {Hq * Lq * Dv, Lq * Dv, Dv, 1}};
  dp.lse = {
      upload(r.lse.data(), r.lse.size() * 4), input_dtype::float32, {B, Hq, Lq}, {Hq * Lq, Lq, 1}};
  dp.scale = p.scale;
  dp.causal = p.causal;
  dp.window_left = p.window_left;
  dp.window_right = p.window_right;
  if (p.has_block_mask()) {
    const auto& mask = op.opt.block_mask;
    dp.block_mask = {static_cast<const std::uint8_t*>(upload(mask.data(), mask.size())),
                     p.block_mask.shape, p.block_mask.stride};
    dp.block_q = p.block_q;
    dp.block_k = p.block_k;
  }
  if (p.kv_len != nullptr) {
    const auto& kv = op.opt.kv_len;
    dp.kv_len = static_cast<const std::int32_t*>(upload(kv.data(), kv.size() * 4));
  }
  fc::attention(dp, stream);
  cuda_or_throw(
      cudaMemcpyAsync(r.o.data(), dp.o.data, r.o.size() * 4, cudaMemcpyDeviceToHost, stream),
      "download O");
  cuda_or_throw(
      cudaMemcpyAsync(r.lse.data(), dp.lse.data, r.lse.size() * 4, cudaMemcpyDeviceToHost, stream),
      "download LSE");
  cuda_or_throw(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return r;
}

}  // namespace

// 8 host threads, each on its own stream with its own problem (float32 on the SIMT kernel,
// bfloat16 on the tensor-core kernels), all at once: each result is bit for bit the one the
// same call gives alone (the forward pass is deterministic run to run).
TEST_CASE("cuda: 8 threads on 8 streams at once give the serial results", "[cuda][concurrency]") {
  constexpr int kThreads = 8;
  std::vector<flashref::problem_data> problems;
  std::vector<input_dtype> dtypes;
  for (int t = 0; t < kThreads; ++t) {
    problem_shape s;
    s.B = 1 + t % 2, s.Hk = 1 + t % 2, s.Hq = 2 * s.Hk, s.Lq = 100 + 61 * t, s.Lk = 300 + 53 * t;
    s.D = s.Dv = t % 4 < 2 ? 64 : 128;
    s.causal = t % 3 == 0 ? causal_mode::bottom_right : causal_mode::none;
    if (t % 2 == 1) s.block_q = 64, s.block_k = 96, s.block_density = 0.5;
    s.use_kv_len = t % 4 == 3;
    problems.push_back(flashref::test::random_problem(s, 300 + std::uint64_t(t)));
    dtypes.push_back(t % 2 == 0 ? input_dtype::float32 : input_dtype::bfloat16);
    if (dtypes.back() == input_dtype::bfloat16)
      flashref::test::round_inputs(problems.back(), input_dtype::bfloat16);
  }
  std::vector<cudaStream_t> streams(kThreads);
  for (cudaStream_t& s : streams)
    cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<stream_result> serial;
  for (int t = 0; t < kThreads; ++t)
    serial.push_back(
        run_on_stream(problems[std::size_t(t)], dtypes[std::size_t(t)], streams[std::size_t(t)]));
  std::vector<stream_result> parallel(kThreads);
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::size_t i = std::size_t(t);
      try {
        parallel[i] = run_on_stream(problems[i], dtypes[i], streams[i]);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  for (std::thread& th : threads)
    th.join();
  for (cudaStream_t s : streams)
    cuda_check(cudaStreamDestroy(s));
  for (int t = 0; t < kThreads; ++t) {
    const std::size_t i = std::size_t(t);
    CAPTURE(t, flashref::to_string(dtypes[i]));
    CHECK(errors[i].empty());
    CHECK(parallel[i].o == serial[i].o);
    CHECK(std::memcmp(parallel[i].lse.data(), serial[i].lse.data(), serial[i].lse.size() * 4) == 0);
    // And the serial result itself is right.
    const flashref::reference::golden g =
        flashref::reference::naive_attention(problems[i].inputs());
    FLASHREF_REQUIRE_CONFORMS(
        compare(g, serial[i].o.data(), serial[i].lse.data(),
                default_tolerance(dtypes[i], flashref::test::max_abs(problems[i].v))));
  }
}
