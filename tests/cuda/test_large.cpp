// 64-bit offsets on every CUDA kernel, in real device memory: K and V of more than 2^32
// elements each (bf16: 8 GiB each; float32: 16 GiB each), zero everywhere but a few keys whose
// element offsets lie just past 2^31 and past 2^32 (and, for bf16, past 2^31 bytes). The
// answer has a closed form in float64. A 32-bit offset anywhere — a key row times its stride,
// a head's base, a tile's base, the scan of V, a row of dK or dV — reads or writes the wrong
// row (or faults) and misses it. Plus decoding (Lq = 1 and a few rows) over L = 1,048,576 keys
// against the naive reference.
//
// Hidden ([.large]): they need up to 33 GiB of device memory and some seconds each;
// scripts/gpu-round runs them in its tests stage with the filter [large]. A device without the
// memory skips them with a warning.
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../common/check.hpp"
#include "cuda_test.hpp"
#include "flashref/cuda/attention.hpp"
#include "flashref/cuda/backward.hpp"
#include "flashref/reference/backward.hpp"
#include "flashref/reference/conformance.hpp"
#include "flashref/reference/naive.hpp"
#include "kernel_names.hpp"

using flashref::input_dtype;
using flashref::problem_error;
namespace fc = flashref::cuda;
using flashref::test::name_of;

namespace {

using flashref::test::bf16_bits;
using flashref::test::cuda_check;
using flashref::test::from_bf16_bits;

constexpr std::size_t kGiB = std::size_t(1) << 30;

// Device memory owned by the test, freed at scope exit.
class device_buffer {
 public:
  explicit device_buffer(std::size_t bytes) : bytes_(bytes) {
    cuda_check(cudaMalloc(&data_, bytes == 0 ? 1 : bytes));
  }
  ~device_buffer() { cudaFree(data_); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_;
};

// Free device memory now, after everything earlier has finished.
std::size_t free_device_memory() {
  std::size_t free = 0, total = 0;
  cuda_check(cudaDeviceSynchronize());
  cuda_check(cudaMemGetInfo(&free, &total));
  return free;
}

// false (and a warning naming the sizes) when the device has less than `bytes` free.
bool device_has(std::size_t bytes, const char* what) {
  const std::size_t free = free_device_memory();
  if (free >= bytes) return true;
  WARN(what << ": skipped: needs " << bytes / kGiB << " GiB of device memory, " << free / kGiB
            << " GiB free");
  return false;
}

std::size_t elem_bytes(input_dtype t) {
  return t == input_dtype::float32 ? 4 : 2;
}

// values[n] (exactly representable in `t`) into device memory at element `offset` of `base`.
void write_values(void* base, input_dtype t, std::int64_t offset,
                  const std::vector<float>& values) {
  char* at = static_cast<char*>(base) + std::size_t(offset) * elem_bytes(t);
  if (t == input_dtype::float32) {
    cuda_check(cudaMemcpy(at, values.data(), values.size() * 4, cudaMemcpyHostToDevice));
    return;
  }
  std::vector<std::uint16_t> bits(values.size());
  for (std::size_t n = 0; n < values.size(); ++n) {
    bits[n] = bf16_bits(values[n]);
    REQUIRE(from_bf16_bits(bits[n]) == values[n]);
  }
  cuda_check(cudaMemcpy(at, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
}

// A contiguous (B, H, L, X) device view.
fc::device_tensor<4> bhlx(void* data, input_dtype t, std::int64_t B, std::int64_t H, std::int64_t L,
                          std::int64_t X) {
  return {data, t, {B, H, L, X}, {H * L * X, L * X, X, 1}};
}

// Is `kernel`, forced on dp, available here? Only the Hopper kernel may be absent (a device
// other than compute capability 9.0, or a build without it); any other refusal fails.
bool runs_here(fc::device_problem dp, fc::kernel_choice kernel) {
  dp.kernel = kernel;
  if (kernel == fc::kernel_choice::hopper) {
    try {
      return std::string(fc::kernel_for(dp)) == "hopper";
    } catch (const problem_error&) {
      return false;
    }
  }
  REQUIRE(std::string(fc::kernel_for(dp)) == name_of(kernel));
  return true;
}

std::vector<fc::kernel_choice> kernels_for(input_dtype t) {
  if (t == input_dtype::float32) return {fc::kernel_choice::simt};
  return {fc::kernel_choice::hopper, fc::kernel_choice::tensor_core, fc::kernel_choice::simt};
}

// O (float32) and LSE of a device problem with contiguous float32 outputs, poisoned with NaN
// first so that an unwritten element shows.
void run_forward(const fc::device_problem& dp, cudaStream_t stream, std::vector<float>& o,
                 std::vector<float>& lse) {
  const std::size_t o_bytes = o.size() * 4, lse_bytes = lse.size() * 4;
  cuda_check(cudaMemset(dp.o.data, 0xff, o_bytes));
  cuda_check(cudaMemset(dp.lse.data, 0xff, lse_bytes));
  fc::attention(dp, stream);
  cuda_check(cudaStreamSynchronize(stream));
  cuda_check(cudaMemcpy(o.data(), dp.o.data, o_bytes, cudaMemcpyDeviceToHost));
  cuda_check(cudaMemcpy(lse.data(), dp.lse.data, lse_bytes, cudaMemcpyDeviceToHost));
}

// --- K and V of more than 2^32 elements

// (B = 1, Hk = 2, Lk = 2^24 + 256, D = Dv = 128): 2^32 + 65536 elements each. Head 1 starts at
// element 2^31 + 32768; its keys from 2^24 - 256 on lie past element 2^32. In head 0 the keys
// from 2^24 on lie past element 2^31, and (bf16) the keys from 2^23 on past byte 2^31.
constexpr std::int64_t kB = 1, kHk = 2, kGroup = 2, kHq = kHk * kGroup, kLq = 4, kD = 128;
constexpr std::int64_t kLk = (std::int64_t(1) << 24) + 256;
constexpr std::int64_t kBlockK = 4096;                           // the sparse case's mask blocks
constexpr std::int64_t kBlocks = (kLk + kBlockK - 1) / kBlockK;  // 4097, the last of 256 keys
constexpr std::int64_t kKvLen = kLk - 1;                         // the sparse case's kv_len

// The non-zero keys, the same in both heads: the first two; 2^23 + 3 (past byte 2^31 in bf16);
// 2^24 - 129 (head 0: just below element 2^31); 2^24, 2^24 + 1 and 2^24 + 77 (head 0: past
// element 2^31); Lk - 130 and the last two (the last one past kv_len in the sparse case). In
// head 1 every key from 2^24 - 256 on lies past element 2^32.
constexpr std::array<std::int64_t, 10> kSpecial = {0,
                                                   1,
                                                   (std::int64_t(1) << 23) + 3,
                                                   (std::int64_t(1) << 24) - 129,
                                                   std::int64_t(1) << 24,
                                                   (std::int64_t(1) << 24) + 1,
                                                   (std::int64_t(1) << 24) + 77,
                                                   kLk - 130,
                                                   kLk - 2,
                                                   kLk - 1};

// Inputs, all exactly representable in bf16. Query row (h, i) = (256, (i + h % 2) / 4, 0, ...);
// a special key j of head hk = (1.5 + ((j + hk) % 3) / 32, 4 ((j / 3 + hk) % 3 - 1), 0, ...):
// scores of 33.6 to 35.7, the zero keys' 0. So the special keys carry all but about 1e-7 of
// each row's weight (LSE about 37), each at least 2 % of it: one of them read as a zero key
// moves the LSE by 0.02 or more (the bf16 tolerance is 3.7e-3 here, float32's 3.7e-4). The large
// first column sits in Q rather than K: dQ's first column is a sum of dS times nearly equal K
// values that cancels, and a small K keeps its rounding (dS in bf16) within the gradient tolerance.
float q_value(std::int64_t h, std::int64_t i, std::int64_t d) {
  return d == 0 ? 256.0f : d == 1 ? 0.25f * float(i + h % 2) : 0.0f;
}
float k_value(std::int64_t hk, std::int64_t j, std::int64_t d) {
  if (d == 0) return 1.5f + float((j + hk) % 3) / 32.0f;
  return d == 1 ? 4.0f * float((j / 3 + hk) % 3 - 1) : 0.0f;
}
float v_value(std::int64_t hk, std::int64_t j, std::int64_t d) {
  return float((j * 31 + d * 17 + hk * 7) % 13) / 8.0f - 0.75f;
}
constexpr double kMaxV = 0.75;
// dO of the backward, exactly representable: multiples of 1/4 in [-1, 1].
float do_value(std::int64_t h, std::int64_t i, std::int64_t d) {
  return float((h * 5 + i * 3 + d) % 9) / 4.0f - 1.0f;
}

bool is_special(std::int64_t j) {
  return std::find(kSpecial.begin(), kSpecial.end(), j) != kSpecial.end();
}

// Which keys a row sees: every key (dense), or the mask blocks holding a special key and the
// keys below kv_len (sparse). Every row of a head sees the same keys.
struct visibility {
  bool sparse = false;
  std::vector<std::uint8_t> mask;  // (kBlocks) in the sparse case

  explicit visibility(bool s) : sparse(s) {
    if (!sparse) return;
    mask.assign(std::size_t(kBlocks), 0);
    for (const std::int64_t j : kSpecial)
      mask[std::size_t(j / kBlockK)] = 1;
  }
  bool sees(std::int64_t j) const {
    return !sparse || (mask[std::size_t(j / kBlockK)] != 0 && j < kKvLen);
  }
  // Visible keys that are zero (score 0, value 0).
  std::int64_t zero_keys() const {
    std::int64_t n = 0;
    if (!sparse) {
      n = kLk;
    } else {
      for (std::int64_t blk = 0; blk < kBlocks; ++blk)
        if (mask[std::size_t(blk)] != 0)
          n += std::min({(blk + 1) * kBlockK, kLk, kKvLen}) - blk * kBlockK;
    }
    for (const std::int64_t j : kSpecial)
      n -= sees(j) ? 1 : 0;
    return n;
  }
};

double score(std::int64_t h, std::int64_t i, std::int64_t j) {
  const std::int64_t hk = h / kGroup;
  const double scale = 1.0 / std::sqrt(double(kD));
  return scale * (double(q_value(h, i, 0)) * double(k_value(hk, j, 0)) +
                  double(q_value(h, i, 1)) * double(k_value(hk, j, 1)));
}

// The closed form in float64: the special keys j score score(h, i, j); each visible zero key
// scores 0 and adds exp(0) to the sum and nothing to O.
flashref::reference::golden closed_form(const visibility& vis) {
  flashref::reference::golden g;
  g.o_shape = {kB, kHq, kLq, kD};
  const double zeros = double(vis.zero_keys());
  for (std::int64_t h = 0; h < kHq; ++h) {
    for (std::int64_t i = 0; i < kLq; ++i) {
      double m = 0;  // the zero keys' score
      for (const std::int64_t j : kSpecial)
        if (vis.sees(j)) m = std::max(m, score(h, i, j));
      double sum = zeros * std::exp(-m);
      std::vector<double> acc(std::size_t(kD), 0.0);
      for (const std::int64_t j : kSpecial) {
        if (!vis.sees(j)) continue;
        const double w = std::exp(score(h, i, j) - m);
        sum += w;
        for (std::int64_t d = 0; d < kD; ++d)
          acc[std::size_t(d)] += w * double(v_value(h / kGroup, j, d));
      }
      for (std::int64_t d = 0; d < kD; ++d)
        g.o.push_back(acc[std::size_t(d)] / sum);
      g.lse.push_back(m + std::log(sum));
    }
  }
  return g;
}

// The large K and V on the device: zeros, and the special keys' rows.
struct large_kv {
  input_dtype dtype;
  std::size_t bytes;  // of K, and of V
  device_buffer k, v;

  explicit large_kv(input_dtype t)
      : dtype(t), bytes(std::size_t(kB * kHk * kLk * kD) * elem_bytes(t)), k(bytes), v(bytes) {
    cuda_check(cudaMemset(k.data(), 0, bytes));
    cuda_check(cudaMemset(v.data(), 0, bytes));
    std::vector<float> krow(static_cast<std::size_t>(kD)), vrow(static_cast<std::size_t>(kD));
    for (std::int64_t hk = 0; hk < kHk; ++hk) {
      for (const std::int64_t j : kSpecial) {
        for (std::int64_t d = 0; d < kD; ++d) {
          krow[std::size_t(d)] = k_value(hk, j, d);
          vrow[std::size_t(d)] = v_value(hk, j, d);
        }
        write_values(k.data(), t, (hk * kLk + j) * kD, krow);
        write_values(v.data(), t, (hk * kLk + j) * kD, vrow);
      }
    }
  }
};

// The backward of the sparse case on `kernel` (tensor_core or simt), bf16 in and out: dK and dV
// span K and V (8 GiB each), poisoned with NaN first, then read back in chunks and judged row
// by row: a special key against its closed form, a visible zero key against its own (about
// 1e-15, within atol), every other key exactly 0 (SPEC §9: a key no row sees). dQ against its
// closed form too. A row written at a truncated offset leaves NaN in its own place.
void check_backward(const large_kv& kv, const fc::device_problem& fwd, const visibility& vis,
                    const flashref::reference::golden& g, fc::kernel_choice kernel,
                    cudaStream_t stream) {
  CAPTURE(name_of(kernel));
  const input_dtype bf = input_dtype::bfloat16;
  const std::int64_t rows_q = kB * kHq * kLq;
  device_buffer d_o(std::size_t(rows_q * kD) * 2), d_q(std::size_t(rows_q * kD) * 2);
  device_buffer d_k(kv.bytes), d_v(kv.bytes);
  std::vector<float> do_host(std::size_t(rows_q * kD));
  for (std::int64_t h = 0; h < kHq; ++h)
    for (std::int64_t i = 0; i < kLq; ++i)
      for (std::int64_t d = 0; d < kD; ++d)
        do_host[std::size_t((h * kLq + i) * kD + d)] = do_value(h, i, d);
  write_values(d_o.data(), bf, 0, do_host);
  for (const device_buffer* b : {&d_q, &d_k, &d_v})
    cuda_check(cudaMemset(b->data(), 0xff, b->bytes()));  // bf16 NaN

  fc::device_backward_problem bp;
  bp.forward = fwd;
  bp.forward.kernel = kernel;
  bp.d_o = bhlx(d_o.data(), bf, kB, kHq, kLq, kD);
  bp.d_q = bhlx(d_q.data(), bf, kB, kHq, kLq, kD);
  bp.d_k = bhlx(d_k.data(), bf, kB, kHk, kLk, kD);
  bp.d_v = bhlx(d_v.data(), bf, kB, kHk, kLk, kD);
  REQUIRE(std::string(fc::backward_kernel_for(bp)) == name_of(kernel));
  fc::attention_backward(bp, stream);
  cuda_check(cudaStreamSynchronize(stream));

  // The closed form, from the golden O and LSE: P_ij = exp(s_ij - LSE_i), Delta_i = dO_i . O_i,
  // dV_j = sum_i P_ij dO_i, dK_j = scale sum_i P_ij (dO_i . V_j - Delta_i) q_i,
  // dQ_i = scale sum_j P_ij (dO_i . V_j - Delta_i) k_j over the query rows of j's head group.
  const double scale = 1.0 / std::sqrt(double(kD));
  std::vector<double> delta(std::size_t(rows_q), 0.0);
  for (std::int64_t r = 0; r < rows_q; ++r)
    for (std::int64_t d = 0; d < kD; ++d)
      delta[std::size_t(r)] +=
          double(do_host[std::size_t(r * kD + d)]) * g.o[std::size_t(r * kD + d)];
  // Row (hk, j) of dK and dV for key j of head hk with value row v (zero for a zero key) and
  // score function s(h, i).
  const auto key_grads = [&](std::int64_t hk, const auto& s, const auto& v, std::vector<double>& dk,
                             std::vector<double>& dv) {
    dk.assign(std::size_t(kD), 0.0);
    dv.assign(std::size_t(kD), 0.0);
    for (std::int64_t h = hk * kGroup; h < (hk + 1) * kGroup; ++h) {
      for (std::int64_t i = 0; i < kLq; ++i) {
        const std::int64_t r = h * kLq + i;
        const double p = std::exp(s(h, i) - g.lse[std::size_t(r)]);
        double dp = 0;
        for (std::int64_t d = 0; d < kD; ++d)
          dp += double(do_host[std::size_t(r * kD + d)]) * v(d);
        for (std::int64_t d = 0; d < kD; ++d) {
          dv[std::size_t(d)] += p * double(do_host[std::size_t(r * kD + d)]);
          dk[std::size_t(d)] += scale * p * (dp - delta[std::size_t(r)]) * double(q_value(h, i, d));
        }
      }
    }
  };
  std::vector<double> dq_ref(std::size_t(rows_q * kD), 0.0);
  for (std::int64_t h = 0; h < kHq; ++h) {
    for (std::int64_t i = 0; i < kLq; ++i) {
      const std::int64_t r = h * kLq + i;
      for (const std::int64_t j : kSpecial) {
        if (!vis.sees(j)) continue;
        const double p = std::exp(score(h, i, j) - g.lse[std::size_t(r)]);
        double dp = 0;
        for (std::int64_t d = 0; d < kD; ++d)
          dp += double(do_host[std::size_t(r * kD + d)]) * double(v_value(h / kGroup, j, d));
        for (std::int64_t d = 0; d < kD; ++d)
          dq_ref[std::size_t(r * kD + d)] +=
              scale * p * (dp - delta[std::size_t(r)]) * double(k_value(h / kGroup, j, d));
      }
    }
  }
  std::vector<std::uint16_t> dq_bits(std::size_t(rows_q * kD));
  cuda_check(cudaMemcpy(dq_bits.data(), d_q.data(), d_q.bytes(), cudaMemcpyDeviceToHost));
  std::vector<float> dq(dq_bits.size());
  std::transform(dq_bits.begin(), dq_bits.end(), dq.begin(), from_bf16_bits);
  const flashref::gradient_report rq = flashref::compare_gradient(dq_ref, dq.data(), kD, {}, bf);
  CAPTURE(rq.bad_elements, rq.nonfinite, rq.max_abs_err, rq.max_ref);
  REQUIRE(rq.pass());

  // Golden rows of dK and dV: each special key, and the zero key of each head.
  struct key_rows {
    std::vector<double> dk, dv;
  };
  std::vector<std::vector<key_rows>> special(static_cast<std::size_t>(kHk));
  std::vector<key_rows> zero(static_cast<std::size_t>(kHk));
  double max_dk = 0, max_dv = 0;
  for (std::int64_t hk = 0; hk < kHk; ++hk) {
    for (const std::int64_t j : kSpecial) {
      key_rows kr;
      if (vis.sees(j)) {
        key_grads(
            hk, [&](std::int64_t h, std::int64_t i) { return score(h, i, j); },
            [&](std::int64_t d) { return double(v_value(hk, j, d)); }, kr.dk, kr.dv);
      } else {
        kr.dk.assign(std::size_t(kD), 0.0), kr.dv.assign(std::size_t(kD), 0.0);
      }
      for (std::int64_t d = 0; d < kD; ++d) {
        max_dk = std::max(max_dk, std::abs(kr.dk[std::size_t(d)]));
        max_dv = std::max(max_dv, std::abs(kr.dv[std::size_t(d)]));
      }
      special[std::size_t(hk)].push_back(kr);
    }
    key_grads(
        hk, [](std::int64_t, std::int64_t) { return 0.0; }, [](std::int64_t) { return 0.0; },
        zero[std::size_t(hk)].dk, zero[std::size_t(hk)].dv);
  }
  REQUIRE(max_dk > 1e-3);  // the check below has something to see
  REQUIRE(max_dv > 1e-3);
  const flashref::gradient_tolerance tk = flashref::default_gradient_tolerance(bf, max_dk);
  const flashref::gradient_tolerance tv = flashref::default_gradient_tolerance(bf, max_dv);

  // dK and dV back in chunks of 2^20 rows (256 MiB), every row judged.
  constexpr std::int64_t kChunkRows = std::int64_t(1) << 20;
  // Page-locked, for the copy's speed (16 GiB come back per kernel).
  void* pinned = nullptr;
  cuda_check(cudaMallocHost(&pinned, std::size_t(kChunkRows * kD) * 2));
  struct pinned_free {
    void* p;
    ~pinned_free() { cudaFreeHost(p); }
  } free_pinned{pinned};
  const auto* bits = static_cast<const std::uint16_t*>(pinned);
  for (const bool is_dk : {true, false}) {
    const device_buffer& dst = is_dk ? d_k : d_v;
    const flashref::gradient_tolerance tol = is_dk ? tk : tv;
    std::int64_t bad_rows = 0, first_bad = -1;
    for (std::int64_t row0 = 0; row0 < kHk * kLk; row0 += kChunkRows) {
      const std::int64_t rows = std::min(kChunkRows, kHk * kLk - row0);
      cuda_check(cudaMemcpy(pinned, static_cast<const char*>(dst.data()) + row0 * kD * 2,
                            std::size_t(rows * kD) * 2, cudaMemcpyDeviceToHost));
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t hk = (row0 + r) / kLk, j = (row0 + r) % kLk;
        const std::uint16_t* x = bits + r * kD;
        bool ok = true;
        if (!vis.sees(j)) {  // exactly 0, either sign
          std::uint16_t any = 0;
          for (std::int64_t d = 0; d < kD; ++d)
            any = std::uint16_t(any | x[d]);
          ok = (any & 0x7fffu) == 0;
        } else {
          const key_rows& kr =
              is_special(j)
                  ? special[std::size_t(hk)][std::size_t(
                        std::find(kSpecial.begin(), kSpecial.end(), j) - kSpecial.begin())]
                  : zero[std::size_t(hk)];
          const std::vector<double>& ref = is_dk ? kr.dk : kr.dv;
          for (std::int64_t d = 0; d < kD; ++d) {
            const double got = double(from_bf16_bits(x[d])), want = ref[std::size_t(d)];
            ok = ok && std::isfinite(got) &&
                 std::abs(got - want) <= tol.atol + tol.rtol * std::abs(want);
          }
        }
        if (!ok && first_bad < 0) first_bad = row0 + r;
        bad_rows += ok ? 0 : 1;
      }
    }
    CAPTURE(is_dk ? "dk" : "dv", first_bad);
    REQUIRE(bad_rows == 0);
  }
}

}  // namespace

TEST_CASE("cuda: K and V of more than 2^32 elements are indexed with 64-bit offsets",
          "[cuda][.large]") {
  const input_dtype dtype = GENERATE(input_dtype::bfloat16, input_dtype::float32);
  CAPTURE(flashref::to_string(dtype));
  const std::size_t kv_bytes = std::size_t(kB * kHk * kLk * kD) * elem_bytes(dtype);
  // K and V, and a GiB for everything else (outputs, the scan's flags, the kernels' own).
  if (!device_has(2 * kv_bytes + kGiB, "K and V of 2^32 elements")) return;
  const large_kv kv(dtype);
  REQUIRE(kB * kHk * kLk * kD > (std::int64_t(1) << 32));

  std::vector<float> q_host(std::size_t(kB * kHq * kLq * kD));
  for (std::int64_t h = 0; h < kHq; ++h)
    for (std::int64_t i = 0; i < kLq; ++i)
      for (std::int64_t d = 0; d < kD; ++d)
        q_host[std::size_t((h * kLq + i) * kD + d)] = q_value(h, i, d);
  const std::size_t o_count = std::size_t(kB * kHq * kLq * kD), rows = std::size_t(kHq * kLq);
  device_buffer q(q_host.size() * elem_bytes(dtype)), o(o_count * 4), lse(rows * 4);
  write_values(q.data(), dtype, 0, q_host);
  const visibility sparse_vis(true);
  device_buffer mask(sparse_vis.mask.size()), kv_len(sizeof(std::int32_t));
  cuda_check(cudaMemcpy(mask.data(), sparse_vis.mask.data(), sparse_vis.mask.size(),
                        cudaMemcpyHostToDevice));
  const std::int32_t kv_len_host = std::int32_t(kKvLen);
  cuda_check(cudaMemcpy(kv_len.data(), &kv_len_host, sizeof kv_len_host, cudaMemcpyHostToDevice));
  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreate(&stream));

  for (const bool sparse : {false, true}) {
    // Dense: every key visible, each kernel walks all 2^24 + 256 keys of its head. Sparse: a
    // block mask (blocks of 4096 keys) lets through only the four blocks holding a special key,
    // and kv_len = Lk - 1 cuts the last key: the kernels jump straight to far tiles, and the
    // tile straddling kv_len takes the partial-tile paths (the Hopper kernel's plain loads of V).
    const visibility vis(sparse);
    const flashref::reference::golden g = closed_form(vis);
    fc::device_problem dp;
    dp.q = bhlx(q.data(), dtype, kB, kHq, kLq, kD);
    dp.k = bhlx(kv.k.data(), dtype, kB, kHk, kLk, kD);
    dp.v = bhlx(kv.v.data(), dtype, kB, kHk, kLk, kD);
    dp.o = bhlx(o.data(), input_dtype::float32, kB, kHq, kLq, kD);
    dp.lse = {lse.data(), input_dtype::float32, {kB, kHq, kLq}, {kHq * kLq, kLq, 1}};
    if (sparse) {
      dp.block_mask = {static_cast<const std::uint8_t*>(mask.data()),
                       {1, 1, 1, kBlocks},
                       {kBlocks, kBlocks, kBlocks, 1}};
      dp.block_q = kLq;
      dp.block_k = kBlockK;
      dp.kv_len = static_cast<const std::int32_t*>(kv_len.data());
    }
    for (const fc::kernel_choice kernel : kernels_for(dtype)) {
      CAPTURE(sparse, name_of(kernel));
      if (!runs_here(dp, kernel)) continue;
      dp.kernel = kernel;
      std::vector<float> o_host(o_count), lse_host(rows);
      run_forward(dp, stream, o_host, lse_host);
      const flashref::conformance_report rep = flashref::compare(
          g, o_host.data(), lse_host.data(), flashref::default_tolerance(dtype, kMaxV));
      FLASHREF_REQUIRE_CONFORMS(rep);
      CHECK(rep.lse_judged);
    }
    // The backward over the same K and V (sparse: dK, dV of the keys no row sees must be
    // exactly 0, those of the visible zero keys near 0), bf16 only: dK and dV take another
    // 16 GiB (33 GiB in all) and each kernel a few seconds, most of them the host's reading of
    // dK and dV. The float32 case would need 64 GiB; its kernel is the same code as the bf16
    // simt backward but for the element type, so it is left out.
    if (sparse && dtype == input_dtype::bfloat16) {
      if (!device_has(2 * kv_bytes + kGiB, "the backward over K and V of 2^32 elements")) continue;
      dp.kernel = fc::kernel_choice::automatic;
      std::vector<float> o_host(o_count), lse_host(rows);
      run_forward(dp, stream, o_host, lse_host);  // O, LSE as the backward reads them
      for (const fc::kernel_choice kernel :
           {fc::kernel_choice::tensor_core, fc::kernel_choice::simt}) {
        check_backward(kv, dp, vis, g, kernel, stream);
      }
    }
  }
  cuda_check(cudaStreamDestroy(stream));
}

// Decoding: one query row (and four, causal) per head over L = 1,048,576 keys, on every kernel,
// against the naive float64 reference. The inputs come from a counter hash on a grid that bf16
// holds exactly (multiples of 1/16 in [-1, 1], Q twice that: scores of spread about 0.7), which
// is faster to make than random_problem's normal draws (half a minute at this size).
namespace {

float grid_value(std::uint64_t stream, std::uint64_t n, float step) {
  std::uint64_t z = stream * 0x9e3779b97f4a7c15ull + n + 1;  // splitmix64
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return float(std::int64_t(z % 33) - 16) * step;
}

std::vector<float> grid_tensor(std::uint64_t stream, std::size_t count, float step) {
  std::vector<float> x(count);
  for (std::size_t n = 0; n < count; ++n)
    x[n] = grid_value(stream, n, step);
  return x;
}

}  // namespace

TEST_CASE("cuda: decoding over L = 1,048,576 keys equals the naive reference", "[cuda][.large]") {
  constexpr std::int64_t Hq = 2, Hk = 1, Lk = std::int64_t(1) << 20, D = 128;
  const std::int64_t Lq = GENERATE(1, 4);
  const flashref::causal_mode causal =
      Lq > 1 ? flashref::causal_mode::bottom_right : flashref::causal_mode::none;
  CAPTURE(Lq);
  // K and V in bf16 (0.5 GiB) or float32 (1 GiB), and a GiB for the rest.
  if (!device_has(2 * kGiB, "decoding over 2^20 keys")) return;
  const std::vector<float> q = grid_tensor(1, std::size_t(Hq * Lq * D), 0.125f);
  const std::vector<float> k = grid_tensor(2, std::size_t(Hk * Lk * D), 0.0625f);
  const std::vector<float> v = grid_tensor(3, std::size_t(Hk * Lk * D), 0.0625f);
  flashref::attention_problem p;
  p.q = flashref::contiguous<const float, 4>(q.data(), {1, Hq, Lq, D});
  p.k = flashref::contiguous<const float, 4>(k.data(), {1, Hk, Lk, D});
  p.v = flashref::contiguous<const float, 4>(v.data(), {1, Hk, Lk, D});
  p.causal = causal;
  const flashref::reference::golden g = flashref::reference::naive_attention(p);
  double max_v = 0;
  for (const float x : v)
    max_v = std::max(max_v, double(std::abs(x)));

  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreate(&stream));
  const std::size_t o_count = std::size_t(Hq * Lq * D), rows = std::size_t(Hq * Lq);
  device_buffer o(o_count * 4), lse(rows * 4);
  for (const input_dtype dtype : {input_dtype::bfloat16, input_dtype::float32}) {
    const auto upload = [&](const std::vector<float>& x) {
      auto buf = std::make_unique<device_buffer>(x.size() * elem_bytes(dtype));
      write_values(buf->data(), dtype, 0, x);
      return buf;
    };
    const auto dq = upload(q), dk = upload(k), dv = upload(v);
    fc::device_problem dp;
    dp.q = bhlx(dq->data(), dtype, 1, Hq, Lq, D);
    dp.k = bhlx(dk->data(), dtype, 1, Hk, Lk, D);
    dp.v = bhlx(dv->data(), dtype, 1, Hk, Lk, D);
    dp.o = bhlx(o.data(), input_dtype::float32, 1, Hq, Lq, D);
    dp.lse = {lse.data(), input_dtype::float32, {1, Hq, Lq}, {Hq * Lq, Lq, 1}};
    dp.causal = causal;
    for (const fc::kernel_choice kernel : kernels_for(dtype)) {
      CAPTURE(flashref::to_string(dtype), name_of(kernel));
      if (!runs_here(dp, kernel)) continue;
      dp.kernel = kernel;
      std::vector<float> o_host(o_count), lse_host(rows);
      run_forward(dp, stream, o_host, lse_host);
      FLASHREF_REQUIRE_CONFORMS(flashref::compare(g, o_host.data(), lse_host.data(),
                                                  flashref::default_tolerance(dtype, max_v)));
    }
  }
  cuda_check(cudaStreamDestroy(stream));
}
