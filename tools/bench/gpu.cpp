// `flashref bench-gpu`: the GPU grid of SPEC §8 (bf16/fp16, B·L = tokens, Hq·D = model width;
// dense, causal and block-sparse with empty query-block rows) on the CUDA backend's device
// entry. Built only with the CUDA backend.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <iomanip>
#include <memory>
#include <sstream>

#include "../commands.hpp"
#include "flashref/cuda/attention.hpp"
#include "flashref/cuda/backward.hpp"
#include "flashref/testdata/random.hpp"
#include "grid.hpp"
#include "record.hpp"

namespace flashref::cli {

namespace {

struct gpu_bench_options {
  bench_grid grid{.lengths = {512, 1024, 2048, 4096, 8192, 16384}};
  std::string dtype = "bfloat16";
  double seconds_per_point = 0.25;  // timed repetitions per point fill about this long
  std::uint64_t seed = 2024;
  bool backward = false;          // also time the backward at every point
  bool nondeterministic = false;  // the backward's device_backward_problem::deterministic = false
  bool back_to_back = false;      // time streams of calls instead of one call per event pair
};

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

void print_row(std::FILE* table, const bench_record& r, const char* pass) {
  if (table == nullptr) return;
  const bench_point& pt = r.point;
  std::fprintf(table, "%-13s %-18s %6lld %4lld %4lld %4lld %8.3f %10.4f %9.1f %8.3f %5lld\n",
               pt.mask.c_str(), pass, (long long)pt.Lq, (long long)pt.D, (long long)pt.B,
               (long long)pt.Hq, r.visible_fraction, r.median_s * 1e3, r.gflops * 1e-3, r.vs_dense,
               (long long)r.nan_rows);
  std::fflush(table);
}

std::vector<bench_record> run_grid(const gpu_bench_options& opt, std::FILE* table) {
  std::string why;
  if (!cuda::device_available(&why))
    throw problem_error("backend: expected a CUDA device, got " + why);
  const input_dtype dt = opt.dtype == "float16" ? input_dtype::float16 : input_dtype::bfloat16;
  if (opt.dtype != "bfloat16" && opt.dtype != "float16") {
    throw problem_error("dtype: expected bfloat16 or float16, got '" + opt.dtype + "'");
  }
  const bench_grid& grid = opt.grid;
  grid.validate({"dense", "causal", "block_sparse"});

  // Every grid point has tokens * model elements per tensor: one set of buffers serves all.
  const std::size_t n = std::size_t(grid.tokens * grid.model);
  std::vector<std::uint16_t> host(n);
  device_ptr q = device_alloc(n * 2), k = device_alloc(n * 2), v = device_alloc(n * 2);
  device_ptr o = device_alloc(n * 2);
  // The backward's upstream gradient and gradients (allocated with --backward only).
  device_ptr d_o, d_q, d_k, d_v;
  if (opt.backward) {
    d_o = device_alloc(n * 2), d_q = device_alloc(n * 2), d_k = device_alloc(n * 2);
    d_v = device_alloc(n * 2);
  }
  for (int t = 0; t < (opt.backward ? 4 : 3); ++t) {  // values k * 2^-6, |k| < 128: never all 0
    const testdata::counter_rng rng(opt.seed, std::uint64_t(10 + t));
    for (std::size_t i = 0; i < n; ++i) {
      const auto kq = std::int64_t(rng.bits(i) >> 56) - 128;  // [-128, 127]
      host[i] = half_bits(float(kq) * 0x1p-6f, dt);
    }
    void* const dst[] = {q.get(), k.get(), v.get(), d_o.get()};
    check(cudaMemcpy(dst[t], host.data(), n * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  cudaEvent_t start = nullptr, stop = nullptr;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");

  if (table != nullptr) {
    std::fprintf(table, "%-13s %-18s %6s %4s %4s %4s %8s %10s %9s %8s %5s\n", "mask", "pass", "L",
                 "D", "B", "Hq", "density", "time_ms", "TFLOP/s", "vs_dense", "NaN");
  }
  std::vector<bench_record> results;
  // B · Hq · L = tokens · model / D rows: the LSE buffer of the largest count serves all.
  std::int64_t min_d = grid.head_dims.empty() ? 1 : grid.head_dims.front();
  for (std::int64_t D : grid.head_dims)
    min_d = std::min(min_d, D);
  device_ptr lse = device_alloc(std::size_t(grid.tokens * grid.model / min_d) * sizeof(float));
  std::vector<float> lse_host;
  double dense_time = 0;
  double dense_bwd_time = 0;
  std::pair<std::int64_t, std::int64_t> shape_now{-1, -1};  // (D, L) of dense_time
  for (const bench_point& pt : grid.points(opt.dtype)) {
    const std::int64_t B = pt.B, Hq = pt.Hq, L = pt.Lq, D = pt.D;
    const std::size_t rows = std::size_t(B * Hq * L);
    lse_host.resize(rows);
    if (shape_now != std::pair{D, L}) {
      shape_now = {D, L};
      dense_time = dense_bwd_time = 0;
    }
    bench_record r;
    r.point = pt;
    r.backend = "cuda";
    r.threads = 0;
    r.nan_rows = r.empty_rows = r.empty_rows_bad = 0;
    cuda::device_problem dp;
    const std::array<std::int64_t, 4> shape{B, Hq, L, D};
    const std::array<std::int64_t, 4> stride{Hq * L * D, L * D, D, 1};
    dp.q = {q.get(), dt, shape, stride};
    dp.k = {k.get(), dt, shape, stride};
    dp.v = {v.get(), dt, shape, stride};
    dp.o = {o.get(), dt, shape, stride};
    dp.lse = {lse.get(), input_dtype::float32, {B, Hq, L}, {Hq * L, L, 1}};
    double fraction = 1.0;
    device_ptr mask_dev;
    std::vector<std::uint8_t> mask;
    if (pt.mask == "causal") {
      dp.causal = causal_mode::bottom_right;
      fraction = 0.5;  // SPEC §8: exactly 1/2 for square causal
    } else if (pt.mask == "block_sparse") {
      const std::int64_t block = pt.block;
      mask = block_sparse_mask(Hq, L, block, pt.density, opt.seed);
      const std::int64_t nb = (L + block - 1) / block;
      // The fraction of (query, key) pairs in visible blocks (the last blocks may be short).
      double pairs = 0;
      for (std::int64_t h = 0; h < Hq; ++h)
        for (std::int64_t qb = 0; qb < nb; ++qb)
          for (std::int64_t kb = 0; kb < nb; ++kb)
            if (mask[std::size_t((h * nb + qb) * nb + kb)] != 0) {
              pairs +=
                  double(std::min(block, L - qb * block)) * double(std::min(block, L - kb * block));
            }
      fraction = pairs / (double(Hq) * double(L) * double(L));
      r.mask_hash = mask_hash(mask);
      mask_dev = device_alloc(mask.size());
      check(cudaMemcpy(mask_dev.get(), mask.data(), mask.size(), cudaMemcpyHostToDevice),
            "cudaMemcpy");
      dp.block_mask = {static_cast<const std::uint8_t*>(mask_dev.get()),
                       {1, Hq, nb, nb},
                       {Hq * nb * nb, nb * nb, nb, 1}};
      dp.block_q = block;
      dp.block_k = block;
    }
    r.visible_fraction = fraction;
    r.kernel = cuda::kernel_for(dp);

    // The median of event-timed runs of `launch` (two warm-up runs set the repetitions). The
    // events enclose the host's part of the call too (checks, tensor maps, launches: the GPU
    // waits for them), so `host_s` keeps the median wall time until a single call returned.
    int reps = 0;
    double host_s = 0;
    const auto median = [](std::vector<double>& xs) {
      std::nth_element(xs.begin(), xs.begin() + std::ptrdiff_t(xs.size() / 2), xs.end());
      return xs[xs.size() / 2];
    };
    const auto median_time = [&](const auto& launch) {
      std::vector<double> host_times;
      // Seconds per call of `calls` calls between one pair of events.
      const auto timed = [&](int calls) {
        check(cudaEventRecord(start, nullptr), "cudaEventRecord");
        const auto t0 = std::chrono::steady_clock::now();
        for (int c = 0; c < calls; ++c)
          launch();
        if (calls == 1) {
          host_times.push_back(
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        check(cudaEventRecord(stop, nullptr), "cudaEventRecord");
        check(cudaEventSynchronize(stop), "attention kernel");
        float ms = 0;
        check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
        return double(ms) * 1e-3 / calls;
      };
      double first = timed(1);
      first = std::min(first, timed(1));
      reps = int(std::clamp(opt.seconds_per_point / std::max(first, 1e-7), 5.0, 200.0));
      std::vector<double> times;
      if (opt.back_to_back) {
        // Five runs of `calls` calls each: the time per call of a stream of calls, the host's
        // part overlapping the kernels before it.
        const int calls = std::clamp(reps / 5, 5, 100);
        timed(1);  // a third single call: three host times for their median
        for (int run = 0; run < 5; ++run)
          times.push_back(timed(calls));
        reps = 5 * calls;
      } else {
        for (int i = 0; i < reps; ++i)
          times.push_back(timed(1));
      }
      host_s = median(host_times);
      return median(times);
    };
    // The note of a record: repetitions, kernel and host part.
    const auto note_of = [&](const std::string& kernel, double host_part_s) {
      std::ostringstream note;
      note << "reps=" << reps << " kernel=" << kernel << " host_us=" << std::fixed
           << std::setprecision(1) << host_part_s * 1e6;
      return note.str();
    };
    check(cudaMemset(o.get(), 0xff, n * 2), "cudaMemset");  // NaN: unwritten rows show
    r.median_s = median_time([&] { cuda::attention(dp, nullptr); });
    r.host_s = host_s;
    r.back_to_back = opt.back_to_back;
    r.flops = 4.0 * double(B) * double(Hq) * double(L) * double(L) * double(D) * fraction;
    r.gflops = r.flops / r.median_s * 1e-9;
    if (pt.mask == "dense") dense_time = r.median_s;
    if (pt.mask != "dense" && dense_time > 0) r.vs_dense = r.median_s / dense_time;

    // The contract on the output: no NaN, and rows with LSE = -inf exactly 0.
    std::vector<std::uint16_t> o_host(n);
    check(cudaMemcpy(o_host.data(), o.get(), n * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
    check(cudaMemcpy(lse_host.data(), lse.get(), rows * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
    for (std::size_t row = 0; row < rows; ++row) {
      bool bad_row = std::isnan(lse_host[row]) || lse_host[row] == INFINITY;
      const bool empty = lse_host[row] == -INFINITY;
      bool nonzero = false;
      for (std::int64_t d = 0; d < D; ++d) {
        const std::uint16_t bits = o_host[row * std::size_t(D) + std::size_t(d)];
        bad_row = bad_row || half_not_finite(bits, dt);
        nonzero = nonzero || (bits & 0x7fffu) != 0;
      }
      r.nan_rows += bad_row ? 1 : 0;
      r.empty_rows += empty ? 1 : 0;
      r.empty_rows_bad += (empty && nonzero) ? 1 : 0;
    }
    r.note = note_of(r.kernel, r.host_s);
    print_row(table, r, "forward");
    results.push_back(r);
    if (opt.backward) {
      // The backward from the forward just run (its O and LSE). SPEC §9 counts 2.5 x the
      // forward's FLOPs.
      cuda::device_backward_problem bp;
      bp.forward = dp;
      bp.d_o = {d_o.get(), dt, shape, stride};
      bp.d_q = {d_q.get(), dt, shape, stride};
      bp.d_k = {d_k.get(), dt, shape, stride};
      bp.d_v = {d_v.get(), dt, shape, stride};
      bp.deterministic = !opt.nondeterministic;
      bp.workspace_bytes = cuda::backward_workspace_bytes(bp);
      device_ptr workspace = device_alloc(bp.workspace_bytes);
      bp.workspace = workspace.get();
      bench_record w = r;
      w.pass = "backward";
      w.kernel = cuda::backward_kernel_for(bp);
      for (void* g : {d_q.get(), d_k.get(), d_v.get()})
        check(cudaMemset(g, 0xff, n * 2), "cudaMemset");  // NaN: unwritten elements show
      w.median_s = median_time([&] { cuda::attention_backward(bp, nullptr); });
      w.host_s = host_s;
      w.flops = 2.5 * r.flops;
      w.gflops = w.flops / w.median_s * 1e-9;
      if (pt.mask == "dense") dense_bwd_time = w.median_s;
      w.vs_dense = pt.mask != "dense" && dense_bwd_time > 0 ? w.median_s / dense_bwd_time : 0;
      // No NaN in any gradient; the dQ rows of empty rows exactly 0.
      w.nan_rows = w.empty_rows_bad = 0;
      std::vector<std::uint16_t> g_host(n);
      for (void* g : {d_q.get(), d_k.get(), d_v.get()}) {
        check(cudaMemcpy(g_host.data(), g, n * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
        for (std::size_t row = 0; row < rows; ++row) {
          bool bad_row = false, nonzero = false;
          for (std::int64_t d = 0; d < D; ++d) {
            const std::uint16_t bits = g_host[row * std::size_t(D) + std::size_t(d)];
            bad_row = bad_row || half_not_finite(bits, dt);
            nonzero = nonzero || (bits & 0x7fffu) != 0;
          }
          w.nan_rows += bad_row ? 1 : 0;
          const bool empty = lse_host[row] == -INFINITY;
          w.empty_rows_bad += (g == d_q.get() && empty && nonzero) ? 1 : 0;
        }
      }
      w.note = note_of(w.kernel, w.host_s) + (opt.nondeterministic ? " nondeterministic" : "");
      print_row(table, w, "backward");
      results.push_back(std::move(w));
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return results;
}

}  // namespace

void add_bench_gpu(CLI::App& app, exit_slot status) {
  auto opt = std::make_shared<gpu_bench_options>();
  auto json = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand(
      "bench-gpu", "GPU benchmark grid (SPEC §8): dense, causal and block-sparse attention");
  bench_grid& g = opt->grid;
  cmd->add_option("--lengths", g.lengths, "sequence lengths L (B = tokens / L)")->delimiter(',');
  cmd->add_option("--head-dims", g.head_dims, "head dims D (Hq = model / D)")->delimiter(',');
  cmd->add_option("--masks", g.masks, "dense, causal, block_sparse")->delimiter(',');
  cmd->add_option("--densities", g.densities, "block-sparse densities")->delimiter(',');
  cmd->add_option("--tokens", g.tokens, "B * L");
  cmd->add_option("--model", g.model, "Hq * D");
  cmd->add_option("--dtype", opt->dtype, "bfloat16 or float16");
  cmd->add_option("--seconds", opt->seconds_per_point, "timed seconds per grid point");
  cmd->add_option("--seed", opt->seed, "seed of the inputs and block masks");
  cmd->add_option("--json", *json, "write the records as JSON to this file");
  cmd->add_flag("--back-to-back", opt->back_to_back,
                "time five runs of several calls each between one pair of events (the time "
                "per call of a stream of calls) instead of one call per pair");
  cmd->add_flag("--backward", opt->backward,
                "also time the backward at every point (SPEC §9: 2.5 x the forward's FLOPs)");
  cmd->add_flag("--nondeterministic", opt->nondeterministic,
                "the backward with dQ's sums in any order (device_backward_problem::"
                "deterministic = false)");
  cmd->callback([opt, json, status]() {
    check_output_path(*json);
    const std::vector<bench_record> results = run_grid(*opt, stdout);
    bool ok = true;
    for (const bench_record& r : results)
      ok = ok && r.nan_rows == 0 && r.empty_rows_bad == 0;
    if (!json->empty()) write_records(*json, results);
    if (!ok)
      std::fprintf(stderr,
                   "flashref bench-gpu: NaN or a non-zero empty row in the output or gradients\n");
    *status = ok ? 0 : 1;
  });
}

}  // namespace flashref::cli
