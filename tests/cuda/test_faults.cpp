// The CUDA entries under faults: pointers the device cannot read, views larger than their
// allocation, out of memory in the host entry, a long run of failing and succeeding calls that
// must leave device memory as it was, and SPEC §2's rule for NaN and inf in V through the
// device entry on every kernel.
#include <catch2/catch.hpp>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../common/check.hpp"
#include "cuda_test.hpp"
#include "flashref/cuda/attention.hpp"
#include "flashref/cuda/backward.hpp"
#include "flashref/flashref.hpp"

using flashref::causal_mode;
using flashref::input_dtype;
using flashref::problem_error;
using flashref::test::problem_shape;
namespace fc = flashref::cuda;

namespace {

using flashref::test::bf16_bits;
using flashref::test::cuda_check;
using flashref::test::from_bf16_bits;

enum class memory { device, managed, pinned, pool };

// Owns one allocation of the given kind.
class buffer {
 public:
  buffer() = default;
  buffer(std::size_t bytes, memory kind) : kind_(kind) {
    bytes = bytes == 0 ? 1 : bytes;
    switch (kind) {
      case memory::device:
        cuda_check(cudaMalloc(&ptr_, bytes));
        break;
      case memory::managed:
        cuda_check(cudaMallocManaged(&ptr_, bytes));
        break;
      case memory::pinned:
        cuda_check(cudaMallocHost(&ptr_, bytes));
        break;
      case memory::pool:  // the device's default stream-ordered pool
        cuda_check(cudaMallocAsync(&ptr_, bytes, nullptr));
        cuda_check(cudaStreamSynchronize(nullptr));
        break;
    }
  }
  // Takes over memory from cudaMalloc.
  static buffer adopt(void* device_ptr) {
    buffer b;
    b.ptr_ = device_ptr;
    return b;
  }
  ~buffer() { reset(); }
  buffer(buffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), kind_(o.kind_) {}
  buffer& operator=(buffer&& o) noexcept {
    reset();
    ptr_ = std::exchange(o.ptr_, nullptr);
    kind_ = o.kind_;
    return *this;
  }
  void reset() {
    if (ptr_ == nullptr) return;
    if (kind_ == memory::pinned) {
      cudaFreeHost(ptr_);
    } else if (kind_ == memory::pool) {
      cudaFreeAsync(ptr_, nullptr);
      cudaStreamSynchronize(nullptr);
    } else {
      cudaFree(ptr_);
    }
    ptr_ = nullptr;
  }
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  memory kind_ = memory::device;
};

// A bf16 problem_data uploaded for the device entry: q, k, v as stored (either layout), O in
// float32 (B, Hq, Lq, Dv) and LSE (B, Hq, Lq) row-major, the masks in device memory.
struct device_copy {
  std::vector<buffer> keep;
  fc::device_problem dp;
  std::size_t o_count = 0, rows = 0;

  void* upload(const void* host, std::size_t bytes, memory kind) {
    keep.emplace_back(bytes, kind);
    cuda_check(cudaMemcpy(keep.back().get(), host, bytes, cudaMemcpyDefault));
    return keep.back().get();
  }

  device_copy(const flashref::problem_data& op, memory kind = memory::device) {
    const flashref::attention_problem p = op.inputs();
    const auto bf16 = input_dtype::bfloat16;
    auto tensor = [&](const xt::xtensor<float, 4>& x, const flashref::strided<const float, 4>& v) {
      std::vector<std::uint16_t> bits(x.size());
      for (std::size_t n = 0; n < x.size(); ++n)
        bits[n] = bf16_bits(x.data()[n]);
      return fc::device_tensor<4>{upload(bits.data(), bits.size() * 2, kind), bf16, v.shape,
                                  v.stride};
    };
    dp.q = tensor(op.q, p.q);
    dp.k = tensor(op.k, p.k);
    dp.v = tensor(op.v, p.v);
    const std::int64_t B = p.batch(), Hq = p.heads_q(), Lq = p.len_q(), Dv = p.head_dim_v();
    o_count = std::size_t(B * Hq * Lq * Dv);
    rows = std::size_t(B * Hq * Lq);
    keep.emplace_back(o_count * 4, kind);
    dp.o = {
        keep.back().get(), input_dtype::float32, {B, Hq, Lq, Dv}, {Hq * Lq * Dv, Lq * Dv, Dv, 1}};
    keep.emplace_back(rows * 4, kind);
    dp.lse = {keep.back().get(), input_dtype::float32, {B, Hq, Lq}, {Hq * Lq, Lq, 1}};
    dp.scale = p.scale;
    dp.causal = p.causal;
    dp.window_left = p.window_left;
    dp.window_right = p.window_right;
    if (p.has_block_mask()) {
      const auto& mask = op.opt.block_mask;
      dp.block_mask = {static_cast<const std::uint8_t*>(upload(mask.data(), mask.size(), kind)),
                       p.block_mask.shape, p.block_mask.stride};
      dp.block_q = p.block_q;
      dp.block_k = p.block_k;
    }
    if (p.kv_len != nullptr) {
      const auto& kv = op.opt.kv_len;
      dp.kv_len = static_cast<const std::int32_t*>(upload(kv.data(), kv.size() * 4, kind));
    }
  }

  // Runs the device entry on `stream` and returns O and LSE.
  std::pair<std::vector<float>, std::vector<float>> run(cudaStream_t stream = nullptr) {
    fc::attention(dp, stream);
    cuda_check(cudaStreamSynchronize(stream));
    std::pair<std::vector<float>, std::vector<float>> out{std::vector<float>(o_count),
                                                          std::vector<float>(rows)};
    cuda_check(cudaMemcpy(out.first.data(), dp.o.data, o_count * 4, cudaMemcpyDefault));
    cuda_check(cudaMemcpy(out.second.data(), dp.lse.data, rows * 4, cudaMemcpyDefault));
    return out;
  }
};

// A bf16 problem with every mask: causal, a block mask, kv_len.
flashref::problem_data masked_problem(std::int64_t L, std::int64_t D, std::uint64_t seed) {
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = s.Lk = L, s.D = s.Dv = D;
  s.causal = causal_mode::bottom_right;
  s.block_q = 48, s.block_k = 40, s.block_density = 0.6, s.use_kv_len = true;
  flashref::problem_data op = flashref::test::random_problem(s, seed);
  flashref::test::round_inputs(op, input_dtype::bfloat16);
  return op;
}

void require_conforms(const flashref::problem_data& op, const std::vector<float>& o,
                      const std::vector<float>& lse) {
  const flashref::reference::golden g = flashref::reference::naive_attention(op.inputs());
  FLASHREF_REQUIRE_CONFORMS(
      compare(g, o.data(), lse.data(),
              default_tolerance(input_dtype::bfloat16, flashref::test::max_abs(op.v))));
}

// Can the Hopper kernel run here? Asked of the library (kernel_for throws where it cannot).
bool hopper_device(const fc::device_problem& dp) {
  fc::device_problem h = dp;
  h.kernel = fc::kernel_choice::hopper;
  try {
    return std::string(fc::kernel_for(h)) == "hopper";
  } catch (const problem_error&) {
    return false;
  }
}

std::vector<fc::kernel_choice> kernels_of(const fc::device_problem& dp) {
  std::vector<fc::kernel_choice> k{fc::kernel_choice::automatic, fc::kernel_choice::tensor_core,
                                   fc::kernel_choice::simt};
  if (hopper_device(dp)) k.push_back(fc::kernel_choice::hopper);
  return k;
}

std::size_t free_device_memory() {
  std::size_t free = 0, total = 0;
  cuda_check(cudaDeviceSynchronize());
  cuda_check(cudaMemGetInfo(&free, &total));
  return free;
}

// Takes all free device memory but `leave` bytes (the driver may refuse the last few MiB).
buffer reserve_all_but(std::size_t leave) {
  const std::size_t free = free_device_memory();
  REQUIRE(free > leave);
  for (std::size_t give = leave; give < free; give += std::size_t(64) << 20) {
    void* p = nullptr;
    if (cudaMalloc(&p, free - give) == cudaSuccess) return buffer::adopt(p);
    (void)cudaGetLastError();
  }
  FAIL("could not reserve device memory");
  return {};
}

// The host entry's problem that needs `bytes` of device memory for O alone and little else:
// one key, D = 1, Dv = 256, rows = bytes / 1 KiB. O = V's one row in every row.
flashref::problem_data one_key_problem(std::size_t bytes) {
  problem_shape s;
  s.Lq = std::int64_t(bytes / 1024), s.Lk = 1, s.D = 1, s.Dv = 256;
  return flashref::test::random_problem(s, 7);
}

bool every_row_is_v0(const flashref::problem_data& op) {
  for (std::size_t i = 0; i < op.o.shape()[2]; ++i)
    for (std::size_t d = 0; d < 256; ++d)
      if (op.o(0, 0, i, d) != op.v(0, 0, 0, d)) return false;
  return true;
}

}  // namespace

TEST_CASE("cuda device entry: a pointer the device cannot read is refused, naming the field",
          "[cuda][faults]") {
  const flashref::problem_data op = masked_problem(96, 64, 61);
  device_copy dc(op);
  std::vector<std::uint8_t> host(std::size_t(1) << 20);  // plain host memory, large enough
  const auto expect_host = [](const char* field) {
    return std::string(field) + ": expected a pointer to device memory, got a host pointer";
  };
  SECTION("host pointers, each field") {
    const fc::device_problem good = dc.dp;
    const std::vector<std::pair<const char*, void (*)(fc::device_problem&, void*)>> fields{
        {"q", [](fc::device_problem& p, void* x) { p.q.data = x; }},
        {"k", [](fc::device_problem& p, void* x) { p.k.data = x; }},
        {"v", [](fc::device_problem& p, void* x) { p.v.data = x; }},
        {"o", [](fc::device_problem& p, void* x) { p.o.data = x; }},
        {"lse", [](fc::device_problem& p, void* x) { p.lse.data = x; }},
        {"block_mask",
         [](fc::device_problem& p, void* x) { p.block_mask.data = static_cast<std::uint8_t*>(x); }},
        {"kv_len",
         [](fc::device_problem& p, void* x) { p.kv_len = static_cast<std::int32_t*>(x); }}};
    for (const auto& [name, set] : fields) {
      CAPTURE(name);
      dc.dp = good;
      set(dc.dp, host.data());
      REQUIRE_THROWS_WITH(fc::attention(dc.dp, nullptr), expect_host(name));
      REQUIRE_THROWS_WITH(fc::check_device_memory(dc.dp), expect_host(name));
    }
    dc.dp = good;
  }
  SECTION("a wild pointer, a freed one, a null one") {
    const fc::device_problem good = dc.dp;
    dc.dp.k.data = reinterpret_cast<void*>(std::uintptr_t(0x1000));
    REQUIRE_THROWS_WITH(fc::attention(dc.dp, nullptr), expect_host("k"));
    buffer freed(std::size_t(1) << 20, memory::device);
    dc.dp.k.data = freed.get();
    freed.reset();
    // The checks alone from here on: should one let a pointer through, nothing is launched.
    REQUIRE_THROWS_WITH(fc::check_device_memory(dc.dp), expect_host("k"));
    dc.dp.k.data = nullptr;  // validation refuses it first; the checks alone too
    REQUIRE_THROWS_WITH(fc::attention(dc.dp, nullptr), Catch::StartsWith("k: expected a data "
                                                                         "pointer"));
    REQUIRE_THROWS_WITH(fc::check_device_memory(dc.dp),
                        "k: expected a pointer to device memory, got a null pointer");
    dc.dp = good;
  }
  SECTION("a view larger than its allocation") {
    const fc::device_problem good = dc.dp;
    const std::size_t v_bytes = std::size_t(op.v.size()) * 2;
    const std::string refused = "v: expected the view's " + std::to_string(v_bytes) +
                                " bytes from the pointer inside its device allocation, got an "
                                "allocation that ends ";
    buffer half(v_bytes / 2, memory::device);
    dc.dp.v.data = half.get();
    REQUIRE_THROWS_WITH(fc::check_device_memory(dc.dp), Catch::StartsWith(refused));
    // The right size, but the pointer half-way into it.
    buffer exact(v_bytes, memory::device);
    dc.dp.v.data = static_cast<char*>(exact.get()) + v_bytes / 2;
    REQUIRE_THROWS_WITH(fc::check_device_memory(dc.dp), Catch::StartsWith(refused));
    // kv_len (B = 2 entries) and the block mask in the last 4 bytes of an allocation.
    constexpr std::size_t kMiB = std::size_t(1) << 20;
    buffer mib(kMiB, memory::device);
    const auto* last4 = static_cast<const std::uint8_t*>(mib.get()) + kMiB - 4;
    dc.dp = good;
    dc.dp.kv_len = reinterpret_cast<const std::int32_t*>(last4);
    REQUIRE_THROWS_WITH(fc::check_device_memory(dc.dp),
                        "kv_len: expected the view's 8 bytes from the pointer inside its device "
                        "allocation, got an allocation that ends 4 bytes past it");
    dc.dp = good;
    dc.dp.block_mask.data = last4;
    REQUIRE_THROWS_WITH(fc::check_device_memory(dc.dp),
                        Catch::StartsWith("block_mask: expected the view's"));
    dc.dp = good;
  }
  // Nothing was launched and no error is pending: the same problem now runs, and is right.
  cuda_check(cudaGetLastError());
  const auto [o, lse] = dc.run();
  require_conforms(op, o, lse);
}

TEST_CASE(
    "cuda backward device entry: a pointer the device cannot read is refused, naming the "
    "field",
    "[cuda][faults][backward]") {
  const flashref::problem_data op = masked_problem(96, 64, 63);
  device_copy dc(op);
  dc.run();  // O and LSE for the backward
  fc::device_backward_problem bp;
  bp.forward = dc.dp;
  // dO in bf16, the gradients in float32, each in its own device allocation.
  // Filled with the byte 0x3f: every bf16 dO element is 0x3f3f (about 0.746).
  const auto tensor_like = [&](const std::array<std::int64_t, 4>& shape, input_dtype t) {
    const std::int64_t n = shape[0] * shape[1] * shape[2] * shape[3];
    const std::size_t bytes = std::size_t(n) * (t == input_dtype::float32 ? 4 : 2);
    dc.keep.emplace_back(bytes, memory::device);
    cuda_check(cudaMemset(dc.keep.back().get(), 0x3f, bytes));
    return fc::device_tensor<4>{dc.keep.back().get(),
                                t,
                                shape,
                                {shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1}};
  };
  bp.d_o = tensor_like(dc.dp.o.shape, input_dtype::bfloat16);
  bp.d_q = tensor_like(dc.dp.q.shape, input_dtype::float32);
  bp.d_k = tensor_like(dc.dp.k.shape, input_dtype::float32);
  bp.d_v = tensor_like(dc.dp.v.shape, input_dtype::float32);
  bp.workspace_bytes = fc::backward_workspace_bytes(bp);
  buffer workspace(bp.workspace_bytes, memory::device);
  bp.workspace = workspace.get();
  const fc::device_backward_problem good = bp;

  std::vector<std::uint8_t> host(std::size_t(1) << 20);
  using setter = void (*)(fc::device_backward_problem&, void*);
  const std::vector<std::pair<const char*, setter>> fields{
      {"q", [](fc::device_backward_problem& p, void* x) { p.forward.q.data = x; }},
      {"o", [](fc::device_backward_problem& p, void* x) { p.forward.o.data = x; }},
      {"lse", [](fc::device_backward_problem& p, void* x) { p.forward.lse.data = x; }},
      {"kv_len", [](fc::device_backward_problem& p,
                    void* x) { p.forward.kv_len = static_cast<std::int32_t*>(x); }},
      {"d_o", [](fc::device_backward_problem& p, void* x) { p.d_o.data = x; }},
      {"d_q", [](fc::device_backward_problem& p, void* x) { p.d_q.data = x; }},
      {"d_k", [](fc::device_backward_problem& p, void* x) { p.d_k.data = x; }},
      {"d_v", [](fc::device_backward_problem& p, void* x) { p.d_v.data = x; }},
      {"workspace", [](fc::device_backward_problem& p, void* x) { p.workspace = x; }}};
  for (const auto& [name, set] : fields) {
    CAPTURE(name);
    bp = good;
    set(bp, host.data());
    const std::string expected =
        std::string(name) + ": expected a pointer to device memory, got a host pointer";
    REQUIRE_THROWS_WITH(fc::attention_backward(bp, nullptr), expected);
    REQUIRE_THROWS_WITH(fc::check_device_memory(bp), expected);
  }
  // A gradient view larger than its allocation, and a workspace smaller than it claims.
  bp = good;
  buffer half(std::size_t(bp.d_k.shape[0] * bp.d_k.shape[1] * bp.d_k.shape[2]) * 64 * 2,
              memory::device);
  bp.d_k.data = half.get();
  REQUIRE_THROWS_WITH(fc::check_device_memory(bp), Catch::StartsWith("d_k: expected the view's"));
  bp = good;
  buffer small(16, memory::device);
  bp.workspace = small.get();
  REQUIRE_THROWS_WITH(fc::attention_backward(bp, nullptr),
                      Catch::StartsWith("workspace: expected the view's"));

  // Nothing was launched and no error is pending: the backward now runs, with finite gradients.
  cuda_check(cudaGetLastError());
  bp = good;
  fc::attention_backward(bp, nullptr);
  cuda_check(cudaDeviceSynchronize());
  std::vector<float> dq(
      std::size_t(bp.d_q.shape[0] * bp.d_q.shape[1] * bp.d_q.shape[2] * bp.d_q.shape[3]));
  cuda_check(cudaMemcpy(dq.data(), bp.d_q.data, dq.size() * 4, cudaMemcpyDeviceToHost));
  REQUIRE(std::all_of(dq.begin(), dq.end(), [](float x) { return std::isfinite(x); }));
  REQUIRE(std::any_of(dq.begin(), dq.end(), [](float x) { return x != 0.0f; }));
}

TEST_CASE("cuda device entry: managed, pool and page-locked host memory are read in place",
          "[cuda][faults][host-memory]") {
  const flashref::problem_data op = masked_problem(160, 128, 62);
  const memory kind = GENERATE(memory::pool, memory::managed, memory::pinned);
  device_copy dc(op, kind);
  for (const fc::kernel_choice k : kernels_of(dc.dp)) {
    CAPTURE(int(kind), int(k));
    dc.dp.kernel = k;
    const auto [o, lse] = dc.run();
    require_conforms(op, o, lse);
  }
}

namespace {

// The virtual memory management API from the driver, through the runtime.
template <class F>
F driver_function(const char* name, unsigned version) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult found{};
  cuda_check(cudaGetDriverEntryPointByVersion(name, &ptr, version, cudaEnableDefault, &found));
  REQUIRE(found == cudaDriverEntryPointSuccess);
  return reinterpret_cast<F>(ptr);
}

}  // namespace

TEST_CASE("cuda device entry: chunks mapped side by side count as one allocation",
          "[cuda][faults]") {
  const auto granularity = driver_function<PFN_cuMemGetAllocationGranularity_v10020>(
      "cuMemGetAllocationGranularity", 10020);
  const auto create = driver_function<PFN_cuMemCreate_v10020>("cuMemCreate", 10020);
  const auto reserve =
      driver_function<PFN_cuMemAddressReserve_v10020>("cuMemAddressReserve", 10020);
  const auto map = driver_function<PFN_cuMemMap_v10020>("cuMemMap", 10020);
  const auto set_access = driver_function<PFN_cuMemSetAccess_v10020>("cuMemSetAccess", 10020);
  const auto unmap = driver_function<PFN_cuMemUnmap_v10020>("cuMemUnmap", 10020);
  const auto release = driver_function<PFN_cuMemRelease_v10020>("cuMemRelease", 10020);
  const auto address_free = driver_function<PFN_cuMemAddressFree_v10020>("cuMemAddressFree", 10020);
  int device = 0;
  cuda_check(cudaGetDevice(&device));
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  std::size_t chunk = 0;
  REQUIRE(granularity(&chunk, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) == CUDA_SUCCESS);

  // V of (1, 2, Lk, 128) bf16 spanning three chunks; the view starts in the first one. A few
  // query rows keep the reference cheap.
  problem_shape s;
  s.Hq = s.Hk = 2, s.D = s.Dv = 128, s.causal = causal_mode::bottom_right;
  s.Lq = 64, s.Lk = std::int64_t(chunk * 5 / 2 / (2 * 128 * 2));
  flashref::problem_data op = flashref::test::random_problem(s, 63);
  flashref::test::round_inputs(op, input_dtype::bfloat16);
  device_copy dc(op);
  constexpr int kChunks = 3;
  CUdeviceptr base = 0;
  REQUIRE(reserve(&base, kChunks * chunk, 0, 0, 0) == CUDA_SUCCESS);
  std::vector<CUmemGenericAllocationHandle> handles(kChunks);
  for (int c = 0; c < kChunks; ++c) {
    REQUIRE(create(&handles[std::size_t(c)], chunk, &prop, 0) == CUDA_SUCCESS);
    REQUIRE(map(base + c * chunk, chunk, 0, handles[std::size_t(c)], 0) == CUDA_SUCCESS);
  }
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  REQUIRE(set_access(base, kChunks * chunk, &access, 1) == CUDA_SUCCESS);
  const std::size_t v_bytes = op.v.size() * 2;
  void* v = reinterpret_cast<void*>(base + 256);
  cuda_check(cudaMemcpy(v, dc.dp.v.data, v_bytes, cudaMemcpyDeviceToDevice));
  dc.dp.v.data = v;
  {
    const auto [o, lse] = dc.run();
    require_conforms(op, o, lse);
  }
  // With the last chunk unmapped the view runs into a hole: refused (the checks alone, so that
  // nothing is launched should they let it through).
  REQUIRE(unmap(base + 2 * chunk, chunk) == CUDA_SUCCESS);
  REQUIRE_THROWS_WITH(fc::check_device_memory(dc.dp),
                      "v: expected the view's " + std::to_string(v_bytes) +
                          " bytes from the pointer inside its device allocation, got an "
                          "allocation that ends " +
                          std::to_string(2 * chunk - 256) + " bytes past it");
  REQUIRE(unmap(base, chunk) == CUDA_SUCCESS);
  REQUIRE(unmap(base + chunk, chunk) == CUDA_SUCCESS);
  for (const CUmemGenericAllocationHandle h : handles)
    REQUIRE(release(h) == CUDA_SUCCESS);
  REQUIRE(address_free(base, kChunks * chunk) == CUDA_SUCCESS);
}

TEST_CASE("cuda host entry: out of device memory is a problem_error and leaks nothing",
          "[cuda][faults]") {
  constexpr std::size_t kLeave = std::size_t(256) << 20;
  flashref::problem_data big = one_key_problem(2 * kLeave);
  flashref::problem_data small = masked_problem(64, 64, 64);
  // Warm-up: every kernel used below is loaded (lazy loading takes device memory).
  flashref::problem_data small32 = small;
  small32.opt.dtype = input_dtype::float32;
  fc::attention(small32.problem());
  fc::attention(small.problem());
  {
    buffer hog = reserve_all_but(kLeave);
    // An allocation that fails makes the driver give back what memory pools hold unused (the
    // device entry's pool among them): one refused call first, so that both measurements see
    // the pools as an out-of-memory leaves them.
    REQUIRE_THROWS_AS(fc::attention(big.problem()), problem_error);
    const std::size_t before = free_device_memory();
    REQUIRE_THROWS_WITH(fc::attention(big.problem()),
                        Catch::StartsWith("o: expected " + std::to_string(2 * kLeave) +
                                          " bytes of device memory, got "
                                          "cudaErrorMemoryAllocation"));
    cuda_check(cudaGetLastError());
    flashref::test::poison_outputs(small);
    fc::attention(small.problem());  // what fits still runs
    FLASHREF_REQUIRE_CONFORMS(flashref::test::check_against_naive(small, input_dtype::bfloat16));
    const std::size_t after = free_device_memory();
    std::printf(
        "faults: out of memory in the host entry: free device memory %zu bytes before, "
        "%zu after\n",
        before, after);
    REQUIRE(after == before);
  }
  fc::attention(big.problem());  // with the memory back, the large problem runs
  REQUIRE(every_row_is_v0(big));
}

TEST_CASE("cuda: 1000 failing and succeeding calls leave device memory where it was",
          "[cuda][faults]") {
  constexpr std::size_t kLeave = std::size_t(256) << 20;
  // Device entry: a bf16 problem with every mask; host entry: the same in float32; OOM: the
  // host entry's one-key problem, twice what is left.
  const flashref::problem_data op = masked_problem(200, 64, 65);
  device_copy dc(op);
  flashref::problem_data host_op = op;
  host_op.opt.dtype = input_dtype::float32;
  flashref::problem_data big = one_key_problem(2 * kLeave);
  std::vector<std::uint8_t> host(std::size_t(1) << 20);

  // Warm-up and the expected results: every kernel and the scan are loaded.
  const auto expected = dc.run();
  require_conforms(op, expected.first, expected.second);
  fc::attention(host_op.problem());
  FLASHREF_REQUIRE_CONFORMS(flashref::test::check_against_naive(host_op));
  const flashref::attention_outputs host_expected = host_op;

  int ok = 0, refused = 0;
  std::size_t before = 0, after = 0;
  {
    buffer hog = reserve_all_but(kLeave);
    // A failed allocation empties the memory pools (see the test above): both measurements are
    // taken right after one, the last call of the loop being an out-of-memory too.
    REQUIRE_THROWS_AS(fc::attention(big.problem()), problem_error);
    before = free_device_memory();
    for (int n = 0; n < 1000; ++n) {
      CAPTURE(n);
      switch (n % 5) {
        case 0: {  // device entry, right
          const auto got = dc.run();
          REQUIRE(got.first == expected.first);
          REQUIRE(std::memcmp(got.second.data(), expected.second.data(), got.second.size() * 4) ==
                  0);
          ++ok;
          break;
        }
        case 1: {  // device entry, V in host memory
          fc::device_problem bad = dc.dp;
          bad.v.data = host.data();
          REQUIRE_THROWS_WITH(fc::attention(bad, nullptr), Catch::StartsWith("v: expected"));
          ++refused;
          break;
        }
        case 2: {  // device entry, K of the wrong length
          fc::device_problem bad = dc.dp;
          bad.k.shape[2] -= 1;
          REQUIRE_THROWS_AS(fc::attention(bad, nullptr), problem_error);
          ++refused;
          break;
        }
        case 4:  // host entry, out of memory
          REQUIRE_THROWS_WITH(fc::attention(big.problem()), Catch::StartsWith("o: expected"));
          ++refused;
          break;
        default: {  // host entry, right
          flashref::test::poison_outputs(host_op);
          fc::attention(host_op.problem());
          REQUIRE(std::memcmp(host_op.o.data(), host_expected.o.data(), host_op.o.size() * 4) == 0);
          REQUIRE(std::memcmp(host_op.lse.data(), host_expected.lse.data(),
                              host_op.lse.size() * 4) == 0);
          ++ok;
          break;
        }
      }
    }
    cuda_check(cudaGetLastError());
    after = free_device_memory();
  }
  std::printf(
      "faults: 1000 calls (%d right, %d refused): free device memory %zu bytes before, %zu "
      "after\n",
      ok, refused, before, after);
  REQUIRE(ok == 400);
  REQUIRE(refused == 600);
  REQUIRE(after == before);
}

namespace {

// O and LSE against the float64 reference where V holds NaN or inf: an element the reference
// makes NaN or ±inf must be exactly that; every other element finite and within the bf16
// tolerance (scaled by the largest finite |V|).
void require_nan_rule(const flashref::problem_data& op, const std::vector<float>& o,
                      const std::vector<float>& lse, int* nonfinite_rows) {
  const flashref::reference::golden g = flashref::reference::naive_attention(op.inputs());
  double max_v = 0;
  for (const float x : op.v)
    if (std::isfinite(x)) max_v = std::max(max_v, double(std::abs(x)));
  const flashref::tolerance tol = default_tolerance(input_dtype::bfloat16, max_v);
  const std::size_t Dv = std::size_t(g.o_shape[3]);
  *nonfinite_rows = 0;
  for (std::size_t r = 0; r < g.lse.size(); ++r) {
    CAPTURE(r);
    bool row_nonfinite = false;
    for (std::size_t d = 0; d < Dv; ++d) {
      const double want = g.o[r * Dv + d];
      const float got = o[r * Dv + d];
      CAPTURE(d, want, got);
      if (std::isnan(want)) {
        REQUIRE(std::isnan(got));
        row_nonfinite = true;
      } else if (std::isinf(want)) {
        REQUIRE(double(got) == want);
        row_nonfinite = true;
      } else {
        REQUIRE(std::isfinite(got));
        REQUIRE(std::abs(double(got) - want) <= tol.atol + tol.rtol * std::abs(want));
      }
    }
    *nonfinite_rows += row_nonfinite ? 1 : 0;
    if (std::isinf(g.lse[r])) {
      REQUIRE(double(lse[r]) == g.lse[r]);
    } else {
      REQUIRE(std::abs(double(lse[r]) - g.lse[r]) <=
              tol.atol_lse * std::max(1.0, std::abs(g.lse[r])));
    }
  }
}

}  // namespace

TEST_CASE("cuda device entry: a NaN or inf in V reaches only the rows that see its key",
          "[cuda][faults][nan][race]") {
  // Causal with a block mask and kv_len: each bad key is hidden from some rows of its own query
  // and key tiles (the rows just before it under the causal mask) and seen by later ones.
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = s.Lk = 300, s.D = s.Dv = GENERATE(64, 128);
  s.causal = causal_mode::bottom_right;
  s.block_q = 48, s.block_k = 40, s.block_density = 0.7, s.use_kv_len = false;
  s.blhd = GENERATE(false, true);
  CAPTURE(s.describe());
  flashref::problem_data op = flashref::test::random_problem(s, 66);
  flashref::test::round_inputs(op, input_dtype::bfloat16);
  const auto set_v = [&](std::size_t b, std::size_t h, std::size_t j, std::size_t d, float x) {
    if (s.blhd) {
      op.v(b, j, h, d) = x;
    } else {
      op.v(b, h, j, d) = x;
    }
  };
  set_v(0, 0, 70, 5, NAN);
  set_v(0, 1, 71, 0, INFINITY);
  set_v(1, 1, 130, 9, -INFINITY);
  set_v(1, 0, 299, 63, NAN);
  device_copy dc(op);
  for (const fc::kernel_choice k : kernels_of(dc.dp)) {
    CAPTURE(int(k));
    dc.dp.kernel = k;
    const auto [o, lse] = dc.run();
    int nonfinite_rows = 0;
    require_nan_rule(op, o, lse, &nonfinite_rows);
    CHECK(nonfinite_rows > 0);
  }
}

TEST_CASE("cuda device entry: with a NaN in V, many query tiles per block of the SIMT kernel",
          "[cuda][faults][nan]") {
  // 1024 query tiles against a one-wave grid: every block of the gated SIMT kernel walks several
  // tiles. Its result must be the host entry's (the SIMT kernel ungated, one tile per block),
  // NaN for NaN, bit for bit elsewhere.
  problem_shape s;
  s.B = 4, s.Hq = 32, s.Hk = 8, s.Lq = s.Lk = 256, s.D = s.Dv = 128;
  s.causal = causal_mode::bottom_right;
  s.block_q = 64, s.block_k = 64, s.block_density = 0.6;
  flashref::problem_data op = flashref::test::random_problem(s, 69);
  flashref::test::round_inputs(op, input_dtype::bfloat16);
  for (std::size_t b = 0; b < 4; ++b)
    op.v(b, b, 37 + 50 * b, b) = NAN;
  device_copy dc(op);
  const std::vector<fc::kernel_choice> kernels = kernels_of(dc.dp);
  fc::attention(op.problem());  // the host entry: a non-finite V goes to the SIMT kernel
  const std::size_t Dv = std::size_t(s.Dv);
  int nan_rows = 0;
  for (const fc::kernel_choice k : kernels) {
    CAPTURE(int(k));
    dc.dp.kernel = k;
    const auto [o, lse] = dc.run();
    // Counted rather than asserted one by one: 4M elements per kernel.
    nan_rows = 0;
    std::size_t r = 0, mismatches = 0, first_mismatch = 0;
    for (std::size_t b = 0; b < 4; ++b)
      for (std::size_t h = 0; h < 32; ++h)
        for (std::size_t i = 0; i < 256; ++i, ++r) {
          bool nan_row = false, same = true;
          for (std::size_t d = 0; d < Dv; ++d) {
            const float want = op.o(b, h, i, d), got = o[r * Dv + d];
            nan_row = nan_row || std::isnan(want);
            same = same && (std::isnan(want) ? std::isnan(got) : std::memcmp(&want, &got, 4) == 0);
          }
          const float want_lse = op.lse(b, h, i);
          same = same && std::memcmp(&want_lse, &lse[r], 4) == 0;
          if (!same && mismatches++ == 0) first_mismatch = r;
          nan_rows += nan_row ? 1 : 0;
        }
    CAPTURE(first_mismatch);
    REQUIRE(mismatches == 0);
    CHECK(nan_rows > 0);
  }
}

TEST_CASE("cuda device entry: with V finite the scan leaves the tensor-core result alone",
          "[cuda][faults][nan]") {
  // The scan finds nothing: the result is the fast kernel's bit for bit, as with v_finite.
  const flashref::problem_data op = masked_problem(257, 128, 67);
  device_copy dc(op);
  for (const fc::kernel_choice k : kernels_of(dc.dp)) {
    if (k == fc::kernel_choice::simt) continue;
    CAPTURE(int(k));
    dc.dp.kernel = k;
    dc.dp.v_finite = true;
    const auto promised = dc.run();
    dc.dp.v_finite = false;
    const auto scanned = dc.run();
    REQUIRE(promised.first == scanned.first);
    REQUIRE(std::memcmp(promised.second.data(), scanned.second.data(), scanned.second.size() * 4) ==
            0);
    require_conforms(op, scanned.first, scanned.second);
  }
}

TEST_CASE("cuda device entry: the scan of V runs where the mask hides a key, and only there",
          "[cuda][faults][nan]") {
  // Without a mask every row sees every key, and the reference takes a NaN or inf of V into
  // every row: the scan has nothing to protect, the device entry leaves it out and returns the
  // fast kernel's result bit for bit (a rerun by the SIMT kernel would change the bits). A
  // window alone, or kv_len alone, hides keys: the scan runs, and no row that does not see a
  // bad key gets its NaN.
  enum class mask_kind { none, window, kv_len };
  const mask_kind m = GENERATE(mask_kind::none, mask_kind::window, mask_kind::kv_len);
  problem_shape s;
  s.B = 2, s.Hq = 2, s.Hk = 1, s.Lq = s.Lk = 200, s.D = s.Dv = GENERATE(64, 128);
  if (m == mask_kind::window) s.window_left = 16, s.window_right = 0;
  s.use_kv_len = m == mask_kind::kv_len;  // batch entry 0 sees no key
  CAPTURE(int(m), s.D);
  flashref::problem_data op = flashref::test::random_problem(s, 68);
  flashref::test::round_inputs(op, input_dtype::bfloat16);
  op.v(0, 0, 70, 5) = NAN;
  op.v(1, 0, 150, 9) = INFINITY;
  device_copy dc(op);
  for (const fc::kernel_choice k : kernels_of(dc.dp)) {
    if (k == fc::kernel_choice::simt) continue;
    CAPTURE(int(k));
    dc.dp.kernel = k;
    dc.dp.v_finite = false;
    const auto [o, lse] = dc.run();
    int nonfinite_rows = 0;
    require_nan_rule(op, o, lse, &nonfinite_rows);
    if (m != mask_kind::none) continue;
    CHECK(nonfinite_rows == 2 * 2 * 200);  // every row of both batch entries
    dc.dp.v_finite = true;
    const auto [o_fast, lse_fast] = dc.run();
    REQUIRE(std::memcmp(o.data(), o_fast.data(), o.size() * 4) == 0);
    REQUIRE(std::memcmp(lse.data(), lse_fast.data(), lse.size() * 4) == 0);
  }
}

// Figures for cuda/NOTES.md and docs/reliability.md (hidden: run with "[timing]").
TEST_CASE("cuda device entry: the cost of the pointer checks and of the scan of V", "[.][timing]") {
  // Pointer checks: 7 pointers (q, k, v, o, lse, block_mask, kv_len), on the host.
  {
    const flashref::problem_data op = masked_problem(96, 64, 68);
    device_copy dc(op);
    constexpr int kCalls = 20000;
    const auto t0 = std::chrono::steady_clock::now();
    for (int n = 0; n < kCalls; ++n)
      fc::check_device_memory(dc.dp);
    const auto t1 = std::chrono::steady_clock::now();
    for (int n = 0; n < kCalls; ++n)
      (void)fc::kernel_for(dc.dp);
    const auto t2 = std::chrono::steady_clock::now();
    const auto us = [](auto a, auto b) {
      return std::chrono::duration<double, std::micro>(b - a).count() / kCalls;
    };
    std::printf(
        "timing: pointer checks, 7 pointers: %.2f us per call; validation and kernel "
        "choice (kernel_for): %.2f us per call\n",
        us(t0, t1), us(t1, t2));
  }
  // The scan: B = 1, Hq = Hk = 16, L = 16384, D = 128, bf16, dense; the device entry with the
  // scan against the same entry with v_finite (no scan), alternating, medians of CUDA events.
  constexpr std::int64_t L = 16384, H = 16, D = 128;
  const std::size_t n = std::size_t(L * H * D);
  std::vector<std::uint16_t> bits(n);
  for (std::size_t e = 0; e < n; ++e)
    bits[e] = bf16_bits(float(int((e * 2654435761u) % 2001) - 1000) / 1000.f);
  buffer q(n * 2, memory::device), k(n * 2, memory::device), v(n * 2, memory::device),
      o(n * 2, memory::device), lse(std::size_t(H * L) * 4, memory::device);
  for (const buffer* b : {&q, &k, &v})
    cuda_check(cudaMemcpy(b->get(), bits.data(), n * 2, cudaMemcpyHostToDevice));
  fc::device_problem dp;
  const std::array<std::int64_t, 4> shape{1, H, L, D}, stride{H * L * D, L * D, D, 1};
  const auto bf16 = input_dtype::bfloat16;
  dp.q = {q.get(), bf16, shape, stride};
  dp.k = {k.get(), bf16, shape, stride};
  dp.v = {v.get(), bf16, shape, stride};
  dp.o = {o.get(), bf16, shape, stride};
  dp.lse = {lse.get(), input_dtype::float32, {1, H, L}, {H * L, L, 1}};
  cudaEvent_t start = nullptr, stop = nullptr;
  cuda_check(cudaEventCreate(&start));
  cuda_check(cudaEventCreate(&stop));
  // kCalls calls back to back between two events: the host enqueues ahead of the device, as in
  // a model's forward pass, so the figure is the device's time per call.
  constexpr int kCalls = 8;
  double host_us = 0;  // the host's time per call (validation, checks, launches)
  const auto time_ms = [&](bool v_finite) {
    dp.v_finite = v_finite;
    cuda_check(cudaEventRecord(start, nullptr));
    const auto t0 = std::chrono::steady_clock::now();
    for (int c = 0; c < kCalls; ++c)
      fc::attention(dp, nullptr);
    host_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        kCalls;
    cuda_check(cudaEventRecord(stop, nullptr));
    cuda_check(cudaEventSynchronize(stop));
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, start, stop));
    return double(ms) / kCalls;
  };
  const auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  for (const fc::kernel_choice kernel : kernels_of(dp)) {
    if (kernel == fc::kernel_choice::simt || kernel == fc::kernel_choice::automatic) continue;
    dp.kernel = kernel;
    for (int w = 0; w < 2; ++w) {
      (void)time_ms(false);
      (void)time_ms(true);
    }
    std::vector<double> scanned, promised, host_scanned, host_promised;
    for (int r = 0; r < 9; ++r) {
      scanned.push_back(time_ms(false));
      host_scanned.push_back(host_us);
      promised.push_back(time_ms(true));
      host_promised.push_back(host_us);
    }
    const double a = median(scanned), b = median(promised);
    std::printf(
        "timing: %s kernel, dense D=128 L=16384 B=1 Hq=16 bf16: %.3f ms without the scan, "
        "%.3f ms with it (+%.1f us, %.2f %%); host time of the call %.1f us without, "
        "%.1f us with\n",
        fc::kernel_for(dp), b, a, (a - b) * 1e3, (a - b) / b * 100, median(host_promised),
        median(host_scanned));
  }
  // A NaN in V: the SIMT kernel recomputes the problem.
  dp.kernel = fc::kernel_choice::automatic;
  const std::uint16_t nan_bits = bf16_bits(NAN);
  cuda_check(cudaMemcpy(static_cast<std::uint16_t*>(v.get()) + n / 2, &nan_bits, 2,
                        cudaMemcpyHostToDevice));
  dp.v_finite = false;
  cuda_check(cudaEventRecord(start, nullptr));
  fc::attention(dp, nullptr);
  cuda_check(cudaEventRecord(stop, nullptr));
  cuda_check(cudaEventSynchronize(stop));
  float nan_ms = 0;
  cuda_check(cudaEventElapsedTime(&nan_ms, start, stop));
  std::printf("timing: the same with a NaN in V (the SIMT kernel recomputes): %.3f ms\n",
              double(nan_ms));
  cuda_check(cudaEventDestroy(start));
  cuda_check(cudaEventDestroy(stop));
}
