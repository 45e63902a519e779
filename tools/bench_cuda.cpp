// `flashref bench-gpu`: the GPU grid of SPEC §8 on the CUDA backend's device entry.
#include "bench_cuda.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>

#include "flashref/cuda/attention.hpp"
#include "flashref/testdata/random.hpp"
#include "io.hpp"

namespace flashref::cli {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw problem_error(std::string("bench-gpu: ") + what + " failed: " + cudaGetErrorString(e));
  }
}

struct device_free {
  void operator()(void* p) const { cudaFree(p); }
};
using device_ptr = std::unique_ptr<void, device_free>;

device_ptr device_alloc(std::size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  return device_ptr(p);
}

// Bits of a value k * 2^-6, |k| < 128: exact in both bfloat16 and float16.
std::uint16_t half_bits(float x, input_dtype t) {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  if (t == input_dtype::bfloat16) return std::uint16_t(u >> 16);
  if (x == 0.0f) return 0;
  const std::uint32_t sign = u >> 31;
  const std::uint32_t exp = ((u >> 23) & 0xffu) - 127u + 15u;
  const std::uint32_t mant = (u >> 13) & 0x3ffu;
  return std::uint16_t((sign << 15) | (exp << 10) | mant);
}

bool half_not_finite(std::uint16_t bits, input_dtype t) {
  return t == input_dtype::bfloat16 ? (bits & 0x7f80u) == 0x7f80u : (bits & 0x7c00u) == 0x7c00u;
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

struct point_result {
  bench_record rec;
  double visible_fraction = 1;
  std::uint64_t hash = 0;
  std::int64_t nan_count = 0;
  std::int64_t empty_rows = 0;
  std::int64_t empty_rows_bad = 0;
  std::string kernel;
};

std::string to_json(const std::vector<point_result>& results) {
  std::ostringstream os;
  os.precision(9);
  os << "[\n";
  for (std::size_t n = 0; n < results.size(); ++n) {
    const point_result& r = results[n];
    const bench_point& p = r.rec.point;
    os << "  {\"backend\": \"" << r.rec.backend << "\", \"kernel\": \"" << r.kernel
       << "\", \"mask\": \"" << p.mask << "\", \"dtype\": \"" << p.dtype << "\", \"B\": " << p.B
       << ", \"Hq\": " << p.Hq << ", \"Hk\": " << p.Hk << ", \"Lq\": " << p.Lq
       << ", \"Lk\": " << p.Lk << ", \"D\": " << p.D << ", \"Dv\": " << p.Dv
       << ", \"density\": " << p.density << ", \"block\": " << p.block
       << ", \"visible_fraction\": " << r.visible_fraction << ", \"mask_hash\": \"" << r.hash
       << "\", \"median_s\": " << r.rec.median_s << ", \"flops\": " << r.rec.flops
       << ", \"tflops\": " << r.rec.gflops * 1e-3 << ", \"nan_count\": " << r.nan_count
       << ", \"empty_rows\": " << r.empty_rows << ", \"empty_rows_bad\": " << r.empty_rows_bad
       << ", \"note\": \"" << json_escape(r.rec.note) << "\"}"
       << (n + 1 < results.size() ? ",\n" : "\n");
  }
  os << "]\n";
  return os.str();
}

std::vector<point_result> run_grid(const gpu_bench_options& opt, std::FILE* table) {
  std::string why;
  if (!cuda::device_available(&why))
    throw problem_error("backend: expected a CUDA device, got " + why);
  const input_dtype dt = opt.dtype == "float16" ? input_dtype::float16 : input_dtype::bfloat16;
  if (opt.dtype != "bfloat16" && opt.dtype != "float16") {
    throw problem_error("dtype: expected bfloat16 or float16, got '" + opt.dtype + "'");
  }
  if (opt.tokens <= 0 || opt.model <= 0 || opt.block <= 0) {
    throw problem_error("tokens/model/block: expected positive values");
  }
  for (std::int64_t L : opt.lengths) {
    if (L <= 0 || opt.tokens % L != 0) {
      throw problem_error("lengths: expected divisors of tokens = " + std::to_string(opt.tokens) +
                          ", got " + std::to_string(L));
    }
  }
  for (std::int64_t D : opt.head_dims) {
    if (D <= 0 || opt.model % D != 0) {
      throw problem_error("head-dims: expected divisors of model = " + std::to_string(opt.model) +
                          ", got " + std::to_string(D));
    }
  }
  for (double d : opt.densities) {
    if (!(d >= 0 && d <= 1))
      throw problem_error("densities: expected values in [0, 1], got " + std::to_string(d));
  }
  for (const std::string& m : opt.masks) {
    if (m != "dense" && m != "causal" && m != "block_sparse") {
      throw problem_error("masks: expected dense, causal or block_sparse, got '" + m + "'");
    }
  }

  // Every grid point has tokens * model elements per tensor: one set of buffers serves all.
  const std::size_t n = std::size_t(opt.tokens * opt.model);
  std::vector<std::uint16_t> host(n);
  device_ptr q = device_alloc(n * 2), k = device_alloc(n * 2), v = device_alloc(n * 2);
  device_ptr o = device_alloc(n * 2);
  for (int t = 0; t < 3; ++t) {  // random values k * 2^-6, |k| < 128: never all zero
    const testdata::counter_rng rng(opt.seed, std::uint64_t(10 + t));
    for (std::size_t i = 0; i < n; ++i) {
      const auto kq = std::int64_t(rng.bits(i) >> 56) - 128;  // [-128, 127]
      host[i] = half_bits(float(kq) * 0x1p-6f, dt);
    }
    check(cudaMemcpy(t == 0   ? q.get()
                     : t == 1 ? k.get()
                              : v.get(),
                     host.data(), n * 2, cudaMemcpyHostToDevice),
          "cudaMemcpy");
  }
  cudaEvent_t start = nullptr, stop = nullptr;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");

  if (table != nullptr) {
    std::fprintf(table, "%-13s %6s %4s %4s %4s %8s %10s %9s %8s %5s\n", "mask", "L", "D", "B", "Hq",
                 "density", "time_ms", "TFLOP/s", "vs_dense", "NaN");
  }
  std::vector<point_result> results;
  for (std::int64_t D : opt.head_dims) {
    for (std::int64_t L : opt.lengths) {
      const std::int64_t B = opt.tokens / L, Hq = opt.model / D;
      const std::size_t rows = std::size_t(B * Hq * L);
      device_ptr lse = device_alloc(rows * sizeof(float));
      double dense_time = 0;
      struct variant {
        std::string mask;
        double density;
      };
      std::vector<variant> variants;
      for (const std::string& m : opt.masks) {
        if (m == "block_sparse") {
          for (double d : opt.densities)
            variants.push_back({m, d});
        } else {
          variants.push_back({m, 1.0});
        }
      }
      for (const variant& var : variants) {
        point_result r;
        r.rec.backend = "cuda";
        r.rec.threads = 0;
        bench_point& pt = r.rec.point;
        pt.mask = var.mask, pt.B = B, pt.Hq = Hq, pt.Hk = Hq, pt.Lq = L, pt.Lk = L, pt.D = D;
        pt.Dv = D, pt.density = var.density, pt.block = opt.block, pt.dtype = opt.dtype;

        cuda::device_problem dp;
        dp.input = dt;
        dp.output = dt;
        const std::array<std::int64_t, 4> shape{B, Hq, L, D};
        const std::array<std::int64_t, 4> stride{Hq * L * D, L * D, D, 1};
        dp.q = {q.get(), shape, stride};
        dp.k = {k.get(), shape, stride};
        dp.v = {v.get(), shape, stride};
        dp.o = {o.get(), shape, stride};
        dp.lse = {lse.get(), {B, Hq, L}, {Hq * L, L, 1}};
        double fraction = 1.0;
        device_ptr mask_dev;
        std::vector<std::uint8_t> mask;
        if (var.mask == "causal") {
          dp.causal = causal_mode::bottom_right;
          fraction = 0.5;  // SPEC §8: exactly 1/2 for square causal
        } else if (var.mask == "block_sparse") {
          mask = gpu_bench_block_mask(Hq, L, opt.block, var.density, opt.seed);
          const std::int64_t nb = (L + opt.block - 1) / opt.block;
          // The fraction of (query, key) pairs in visible blocks (the last blocks may be short).
          double pairs = 0;
          for (std::int64_t h = 0; h < Hq; ++h)
            for (std::int64_t qb = 0; qb < nb; ++qb)
              for (std::int64_t kb = 0; kb < nb; ++kb)
                if (mask[std::size_t((h * nb + qb) * nb + kb)] != 0) {
                  pairs += double(std::min(opt.block, L - qb * opt.block)) *
                           double(std::min(opt.block, L - kb * opt.block));
                }
          fraction = pairs / (double(Hq) * double(L) * double(L));
          r.hash = mask_hash(mask);
          mask_dev = device_alloc(mask.size());
          check(cudaMemcpy(mask_dev.get(), mask.data(), mask.size(), cudaMemcpyHostToDevice),
                "cudaMemcpy");
          dp.block_mask = {mask_dev.get(), {1, Hq, nb, nb}, {Hq * nb * nb, nb * nb, nb, 1}};
          dp.block_q = opt.block;
          dp.block_k = opt.block;
        }
        r.visible_fraction = fraction;
        r.kernel = cuda::kernel_for(dp);

        auto run_once = [&]() {
          check(cudaEventRecord(start, nullptr), "cudaEventRecord");
          cuda::attention(dp, nullptr);
          check(cudaEventRecord(stop, nullptr), "cudaEventRecord");
          check(cudaEventSynchronize(stop), "attention kernel");
          float ms = 0;
          check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
          return double(ms) * 1e-3;
        };
        check(cudaMemset(o.get(), 0xff, n * 2), "cudaMemset");  // NaN: unwritten rows show
        double first = run_once();
        first = std::min(first, run_once());
        const int reps = int(std::clamp(opt.seconds_per_point / std::max(first, 1e-7), 5.0, 200.0));
        std::vector<double> times;
        for (int i = 0; i < reps; ++i)
          times.push_back(run_once());
        std::nth_element(times.begin(), times.begin() + reps / 2, times.end());
        r.rec.median_s = times[std::size_t(reps / 2)];
        r.rec.flops = 4.0 * double(B) * double(Hq) * double(L) * double(L) * double(D) * fraction;
        r.rec.gflops = r.rec.flops / r.rec.median_s * 1e-9;
        if (var.mask == "dense") dense_time = r.rec.median_s;

        // The contract on the output: no NaN, and rows with LSE = -inf exactly 0.
        std::vector<std::uint16_t> o_host(n);
        std::vector<float> lse_host(rows);
        check(cudaMemcpy(o_host.data(), o.get(), n * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
        check(cudaMemcpy(lse_host.data(), lse.get(), rows * 4, cudaMemcpyDeviceToHost),
              "cudaMemcpy");
        for (std::size_t row = 0; row < rows; ++row) {
          bool bad_row = std::isnan(lse_host[row]) || lse_host[row] == INFINITY;
          const bool empty = lse_host[row] == -INFINITY;
          bool nonzero = false;
          for (std::int64_t d = 0; d < D; ++d) {
            const std::uint16_t bits = o_host[row * std::size_t(D) + std::size_t(d)];
            bad_row = bad_row || half_not_finite(bits, dt);
            nonzero = nonzero || (bits & 0x7fffu) != 0;
          }
          r.nan_count += bad_row ? 1 : 0;
          r.empty_rows += empty ? 1 : 0;
          r.empty_rows_bad += (empty && nonzero) ? 1 : 0;
        }
        std::ostringstream note;
        note << "reps=" << reps << " kernel=" << r.kernel;
        r.rec.note = note.str();
        if (table != nullptr) {
          std::fprintf(table, "%-13s %6lld %4lld %4lld %4lld %8.3f %10.4f %9.1f %8.3f %5lld\n",
                       var.mask.c_str(), (long long)L, (long long)D, (long long)B, (long long)Hq,
                       fraction, r.rec.median_s * 1e3, r.rec.gflops * 1e-3,
                       dense_time > 0 ? r.rec.median_s / dense_time : 0.0, (long long)r.nan_count);
          std::fflush(table);
        }
        results.push_back(std::move(r));
      }
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return results;
}

}  // namespace

std::vector<std::uint8_t> gpu_bench_block_mask(std::int64_t Hq, std::int64_t L, std::int64_t block,
                                               double density, std::uint64_t seed) {
  constexpr std::int64_t kEmptyRowEvery = 8;  // query-block rows 7, 15, ... see nothing
  const std::int64_t nb = (L + block - 1) / block;
  const testdata::counter_rng rng(seed, std::uint64_t(L));
  std::vector<std::uint8_t> mask(std::size_t(Hq * nb * nb));
  for (std::int64_t h = 0; h < Hq; ++h)
    for (std::int64_t qb = 0; qb < nb; ++qb)
      for (std::int64_t kb = 0; kb < nb; ++kb) {
        const std::size_t idx = std::size_t((h * nb + qb) * nb + kb);
        mask[idx] = qb % kEmptyRowEvery != kEmptyRowEvery - 1 && rng.uniform(idx) < density;
      }
  return mask;
}

std::uint64_t mask_hash(const std::vector<std::uint8_t>& mask) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (std::uint8_t b : mask) {
    h ^= b;
    h *= 0x100000001b3ULL;
  }
  return h;
}

std::vector<bench_record> run_gpu_bench(const gpu_bench_options& opt, std::FILE* table) {
  std::vector<bench_record> out;
  for (point_result& r : run_grid(opt, table))
    out.push_back(std::move(r.rec));
  return out;
}

void add_bench_gpu(CLI::App& app, exit_slot status) {
  auto opt = std::make_shared<gpu_bench_options>();
  auto json = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand(
      "bench-gpu", "GPU benchmark grid (SPEC §8): dense, causal and block-sparse attention");
  cmd->add_option("--lengths", opt->lengths, "sequence lengths L (B = tokens / L)")->delimiter(',');
  cmd->add_option("--head-dims", opt->head_dims, "head dims D (Hq = model / D)")->delimiter(',');
  cmd->add_option("--masks", opt->masks, "dense, causal, block_sparse")->delimiter(',');
  cmd->add_option("--densities", opt->densities, "block-sparse densities")->delimiter(',');
  cmd->add_option("--tokens", opt->tokens, "B * L");
  cmd->add_option("--model", opt->model, "Hq * D");
  cmd->add_option("--dtype", opt->dtype, "bfloat16 or float16");
  cmd->add_option("--seconds", opt->seconds_per_point, "timed seconds per grid point");
  cmd->add_option("--seed", opt->seed, "seed of the inputs and block masks");
  cmd->add_option("--json", *json, "write the records as JSON to this file");
  cmd->callback([opt, json, status]() {
    const std::vector<point_result> results = run_grid(*opt, stdout);
    bool ok = true;
    for (const point_result& r : results)
      ok = ok && r.nan_count == 0 && r.empty_rows_bad == 0;
    if (!json->empty()) write_text_atomically(*json, to_json(results));
    if (!ok)
      std::fprintf(stderr, "flashref bench-gpu: NaN or a non-zero empty row in the output\n");
    *status = ok ? 0 : 1;
  });
}

}  // namespace flashref::cli
