// flashref bench — the CPU benchmark grid of SPEC §8 with its baselines measured in the same
// run: the processor's peak fp32 FMA rate and copy bandwidth, naive materialised attention
// over OpenBLAS sgemm (what many users would write) and the scalar tiled reference.
//
// FLOPs: 2 · B · Hq · Lq · Lk · (D + Dv) for dense, times the fraction of visible blocks for
// block-sparse, exactly 1/2 for square causal, and the visible (query, key) pairs for a local
// window. Times are medians over repetitions after one warm-up run.

#include <cblas.h>
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "../commands.hpp"
#include "../io.hpp"
#include "../svg.hpp"
#include "flashref/cpu/attention.hpp"
#include "flashref/cpu/backward.hpp"
#include "flashref/cpu/half.hpp"
#include "flashref/reference/data.hpp"
#include "flashref/reference/mask.hpp"
#include "flashref/reference/tiled.hpp"
#include "flashref/testdata/fixture.hpp"
#include "flashref/testdata/random.hpp"
#include "grid.hpp"
#include "record.hpp"

namespace flashref::cli {

namespace {

// SPEC §8 on a 2-core machine: B · L = 4096 tokens so that a grid point runs in seconds.
bench_grid cpu_grid() {
  bench_grid g;
  g.lengths = {512, 1024, 2048, 4096};
  g.masks = {"dense", "causal", "block_sparse", "local_window"};
  g.tokens = 4096;
  return g;
}

struct bench_options {
  std::vector<std::string> backends{"cpu"};
  bench_grid grid = cpu_grid();
  bool targets = true;    // the target points (D = 128, L = 4096, 8 heads; decode)
  bool baselines = true;  // peak FMA, copy bandwidth, OpenBLAS naive, reference
  double seconds = 0.3;   // timed repetitions per point fill about this long
  std::string isa = "automatic";
  std::string dtype = "fp32";           // fp32 | bf16 | fp16: the inputs' (and O's) storage
  std::string half_path = "automatic";  // the CPU's path for bf16 / fp16
  std::int64_t tile_q = 0, tile_k = 0;  // the CPU kernels' tiles; 0 = the instruction set's default
  std::string json, plot;
  bool memory_check = false;
  std::uint64_t seed = 2024;
  bool backward = false;                        // also time the CPU backward (SPEC §9)
  std::int64_t bwd_tile_q = 0, bwd_tile_k = 0;  // its tiles; 0 = the backward's defaults
  std::int64_t bwd_chunks = 0;                  // its key-tile chunks; 0 = from the shape
};

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// One warm-up run, then at least 3 timed runs and about `seconds` in total; the median.
template <class F>
double median_time(F&& run, double seconds) {
  run();
  std::vector<double> t;
  const auto start = clock_type::now();
  while (t.size() < 3 || (seconds_since(start) < seconds && t.size() < 50)) {
    const auto t0 = clock_type::now();
    run();
    t.push_back(seconds_since(t0));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The inputs and outputs of one grid point, owned.
struct bench_data {
  bench_point pt;
  problem_data data;    // inputs and outputs, owned
  attention_problem p;  // the view of `data` the kernels run on
  // bf16 / fp16 points: Q, K, V and O stored in 16 bits (the values of `data`, rounded), as a
  // caller holding half tensors would pass them; hp views them.
  std::vector<std::uint16_t> q16, k16, v16, o16;
  cpu::half_problem hp;
  double flops = 0;
  double density = 1;  // fraction of (query, key) pairs computed
};

xt::xtensor<float, 4> uniform(std::array<std::int64_t, 4> shape, std::uint64_t seed,
                              std::uint64_t stream) {
  const testdata::counter_rng r(seed, stream);
  auto x = xt::xtensor<float, 4>::from_shape(
      {std::size_t(shape[0]), std::size_t(shape[1]), std::size_t(shape[2]), std::size_t(shape[3])});
  for (std::size_t i = 0; i < x.size(); ++i)
    x.data()[i] = float(2.0 * r.uniform(i) - 1.0);
  return x;
}

void make_data(bench_data& d, const bench_point& pt, std::uint64_t seed) {
  d.pt = pt;
  const std::int64_t B = pt.B, Hq = pt.Hq, Hk = pt.Hk, Lq = pt.Lq, Lk = pt.Lk;
  d.data = problem_data{};
  d.data.q = uniform({B, Hq, Lq, pt.D}, seed, 0);
  d.data.k = uniform({B, Hk, Lk, pt.D}, seed, 1);
  d.data.v = uniform({B, Hk, Lk, pt.Dv}, seed, 2);
  attention_options& opt = d.data.opt;
  opt.dtype = parse_input_dtype(pt.dtype);
  d.density = 1.0;
  if (pt.mask == "causal") {
    opt.causal = causal_mode::bottom_right;
    d.density = Lq == Lk ? 0.5 : -1;  // SPEC §8: exactly 1/2 for square causal
  } else if (pt.mask == "local_window") {
    opt.window_left = opt.window_right = pt.window;
    d.density = -1;
  } else if (pt.mask == "block_sparse") {
    // The grid's mask (as on the GPU), broadcast over the batch; square points only.
    if (Lq != Lk)
      throw problem_error("block_sparse: expected Lq = Lk, got " + std::to_string(Lq) + " and " +
                          std::to_string(Lk));
    const std::int64_t nb = (Lq + pt.block - 1) / pt.block;
    const std::vector<std::uint8_t> m = block_sparse_mask(Hq, Lq, pt.block, pt.density, seed);
    opt.block_mask = xt::xtensor<std::uint8_t, 4>::from_shape(
        {1, std::size_t(Hq), std::size_t(nb), std::size_t(nb)});
    std::copy(m.begin(), m.end(), opt.block_mask.begin());
    opt.block_q = opt.block_k = pt.block;
    d.density = -1;
  }
  d.p = d.data.problem();
  const attention_problem& p = d.p;
  if (opt.dtype != input_dtype::float32) {
    const bool bf16 = opt.dtype == input_dtype::bfloat16;
    auto to16 = [&](xt::xtensor<float, 4>& x, std::vector<std::uint16_t>& out) {
      out.resize(x.size());
      for (std::size_t n = 0; n < x.size(); ++n) {
        x.data()[n] = testdata::round_to(opt.dtype, x.data()[n]);
        out[n] = bf16 ? cpu::bf16_from_float(x.data()[n]) : cpu::f16_from_float(x.data()[n]);
      }
    };
    to16(d.data.q, d.q16);
    to16(d.data.k, d.k16);
    to16(d.data.v, d.v16);
    d.o16.assign(d.data.o.size(), 0);
    d.hp.p = p;
    d.hp.q = d.q16.data(), d.hp.k = d.k16.data(), d.hp.v = d.v16.data(), d.hp.o = d.o16.data();
  }
  if (d.density < 0) {  // count the visible pairs of the computed blocks exactly
    const mask_spec m = make_mask_spec(p);
    double pairs = 0;
    for (std::int64_t h = 0; h < Hq; ++h) {
      for (std::int64_t i = 0; i < Lq; ++i) {
        const key_range r = m.row_range(0, i);
        if (m.block_mask == nullptr) {
          pairs += double(std::max<std::int64_t>(0, r.hi - r.lo));
          continue;
        }
        for (std::int64_t kb = 0; kb * pt.block < Lk; ++kb) {
          const std::int64_t lo = std::max(r.lo, kb * pt.block);
          const std::int64_t hi = std::min(r.hi, (kb + 1) * pt.block);
          if (hi > lo && m.block_visible(0, h, i / pt.block, kb)) pairs += double(hi - lo);
        }
      }
    }
    d.density = pairs / (double(Hq) * double(Lq) * double(Lk));
  }
  d.flops = dense_flops(p) * d.density;
}

// Naive materialised attention, as many users would write it: S = scale · Q Kᵀ (sgemm), a
// row-wise masked softmax over the whole (Lq, Lk) matrix, O = P V (sgemm). Dense and causal.
// The (batch, head) pairs are spread over the OpenMP threads, each calling a single-threaded
// sgemm: one thread pool, no oversubscription between OpenBLAS's threads and OpenMP's.
void naive_blas(bench_data& d, int threads) {
  const bench_point& pt = d.pt;
  const std::int64_t Lq = pt.Lq, Lk = pt.Lk, D = pt.D, Dv = pt.Dv;
  const float scale = float(d.p.softmax_scale());
  const bool causal = pt.mask == "causal";
  openblas_set_num_threads(1);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> s(std::size_t(Lq * Lk));  // (Lq, Lk) for one head
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t bh = 0; bh < pt.B * pt.Hq; ++bh) {
      const std::int64_t b = bh / pt.Hq, h = bh % pt.Hq, hk = h / (pt.Hq / pt.Hk);
      const float* q = d.data.q.data() + bh * Lq * D;
      const float* k = d.data.k.data() + (b * pt.Hk + hk) * Lk * D;
      const float* v = d.data.v.data() + (b * pt.Hk + hk) * Lk * Dv;
      float* o = d.data.o.data() + bh * Lq * Dv;
      float* lse = d.data.lse.data() + bh * Lq;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(Lq), int(Lk), int(D), scale, q,
                  int(D), k, int(D), 0.0f, s.data(), int(Lk));
      for (std::int64_t i = 0; i < Lq; ++i) {
        float* row = s.data() + i * Lk;
        const std::int64_t visible =
            causal ? std::clamp<std::int64_t>(i + (Lk - Lq) + 1, 0, Lk) : Lk;
        float mx = -INFINITY;
        for (std::int64_t j = 0; j < visible; ++j)
          mx = std::max(mx, row[j]);
        float sum = 0;
        for (std::int64_t j = 0; j < visible; ++j)
          sum += row[j] = std::exp(row[j] - mx);
        const float inv = sum > 0 ? 1.0f / sum : 0.0f;
        for (std::int64_t j = 0; j < visible; ++j)
          row[j] *= inv;
        for (std::int64_t j = visible; j < Lk; ++j)
          row[j] = 0;
        lse[i] = sum > 0 ? mx + std::log(sum) : -INFINITY;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(Lq), int(Dv), int(Lk), 1.0f,
                  s.data(), int(Lk), v, int(Dv), 0.0f, o, int(Dv));
    }
  }
}

// Copy bandwidth on `threads` threads: bytes read + written per second (256 MiB each way).
double copy_bandwidth_gbps(int threads, double seconds) {
  const std::size_t n = std::size_t(64) << 20;  // floats
  std::vector<float> a(n, 1.0f), b(n, 0.0f);
  const double t = median_time(
      [&] {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (std::int64_t c = 0; c < 64; ++c) {
          const std::size_t chunk = n / 64;
          std::memcpy(b.data() + std::size_t(c) * chunk, a.data() + std::size_t(c) * chunk,
                      chunk * sizeof(float));
        }
      },
      seconds);
  return 2.0 * double(n * sizeof(float)) / t * 1e-9;
}

std::string point_label(const bench_record& r) {
  std::ostringstream os;
  os << r.point.mask;
  if (r.point.mask == "block_sparse") os << ' ' << std::setprecision(3) << r.point.density;
  return os.str();
}

void print_header() {
  std::printf("%-15s %-17s %3s %4s %3s %6s %6s %4s %4s %10s %9s %6s %8s %8s %8s  %s\n", "backend",
              "mask", "B", "Hq", "Hk", "Lq", "Lk", "D", "thr", "median_ms", "GFLOP/s", "%peak",
              "vs_naive", "vs_ref", "vs_dense", "note");
}

void print_record(const bench_record& r) {
  auto ratio = [](double x) {
    char buf[32];
    if (x > 0) {
      std::snprintf(buf, sizeof buf, "%.2fx", x);
    } else {
      std::snprintf(buf, sizeof buf, "-");
    }
    return std::string(buf);
  };
  char peak[32] = "-";
  if (r.peak_fraction > 0) std::snprintf(peak, sizeof peak, "%.0f%%", 100 * r.peak_fraction);
  const bench_point& p = r.point;
  if (p.mask == "none") {  // a machine baseline: no attention shape
    std::printf("%-15s %-17s %3s %4s %3s %6s %6s %4s %4d %10s %9.1f %6s %8s %8s %8s  %s\n",
                r.backend.c_str(), "-", "-", "-", "-", "-", "-", "-", r.threads, "-",
                r.gflops > 0 ? r.gflops : r.gbps, "-", "-", "-", "-", r.note.c_str());
    std::fflush(stdout);
    return;
  }
  std::printf(
      "%-15s %-17s %3lld %4lld %3lld %6lld %6lld %4lld %4d %10.3f %9.1f %6s %8s %8s %8s  %s\n",
      r.backend.c_str(), point_label(r).c_str(), (long long)p.B, (long long)p.Hq, (long long)p.Hk,
      (long long)p.Lq, (long long)p.Lk, (long long)p.D, r.threads, 1e3 * r.median_s, r.gflops, peak,
      ratio(r.vs_naive).c_str(), ratio(r.vs_reference).c_str(),
      r.vs_dense > 0 ? (std::to_string(r.vs_dense).substr(0, 5)).c_str() : "-", r.note.c_str());
  std::fflush(stdout);
}

// GFLOP/s against sequence length, one line per (mask, head dim), for the cpu backend's grid
// points; the measured peak as a dashed line.
std::string plot_svg(const std::vector<bench_record>& recs, const std::vector<double>& densities,
                     double peak) {
  std::map<std::string, std::vector<std::pair<double, double>>> lines;
  double xmin = 1e30, xmax = 0, ymax = peak;
  for (const bench_record& r : recs) {
    if (r.backend != "cpu" || r.note.find("grid") == std::string::npos) continue;
    std::ostringstream key;  // one line per requested density (the drawn one varies with L)
    key << r.point.mask;
    if (r.point.mask == "block_sparse") {
      double nominal = r.point.density, best = INFINITY;
      for (double d : densities) {
        if (std::abs(d - r.point.density) < best) best = std::abs(d - r.point.density), nominal = d;
      }
      key << ' ' << nominal;
    }
    key << ", D=" << r.point.D;
    lines[key.str()].push_back({double(r.point.Lk), r.gflops});
    xmin = std::min(xmin, double(r.point.Lk));
    xmax = std::max(xmax, double(r.point.Lk));
    ymax = std::max(ymax, r.gflops);
  }
  if (lines.empty()) xmin = 512, xmax = 4096;
  if (xmax <= xmin) xmax = xmin * 2;
  const double width = 780, height = 460, left = 70, right = 250, top = 40, bottom = 50;
  auto X = [&](double x) {
    return left + (std::log2(x) - std::log2(xmin)) / (std::log2(xmax) - std::log2(xmin)) *
                      (width - left - right);
  };
  auto Y = [&](double y) { return height - bottom - y / (ymax * 1.05) * (height - top - bottom); };
  svg g(width, height);
  g.text(left, 22, "flashref cpu: GFLOP/s vs sequence length (fp32)", 15);
  g.line(left, height - bottom, width - right, height - bottom, "black");
  g.line(left, top, left, height - bottom, "black");
  for (double x = xmin; x <= xmax * 1.001; x *= 2)
    g.text(X(x), height - bottom + 18, std::to_string(std::int64_t(x)), 12, "middle");
  g.text((left + width - right) / 2, height - 12, "sequence length L", 12, "middle");
  for (int t = 0; t <= 5; ++t) {
    const double y = ymax * 1.05 * t / 5;
    g.text(left - 6, Y(y) + 4, std::to_string(std::int64_t(y)), 12, "end");
    g.line(left, Y(y), width - right, Y(y), "#ddd");
  }
  if (peak > 0) {
    g.line(left, Y(peak), width - right, Y(peak), "#888", 1, "stroke-dasharray='6,4'");
    g.text(width - right - 4, Y(peak) - 5, "measured peak FMA", 12, "end", "#555");
  }
  const char* colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                          "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939"};
  int n = 0;
  for (auto& [key, pts] : lines) {
    std::sort(pts.begin(), pts.end());
    const std::string color = colors[n % 12];
    std::ostringstream points;
    for (auto [x, y] : pts)
      points << X(x) << ',' << Y(y) << ' ';
    g.polyline(points.str(), color);
    for (auto [x, y] : pts)
      g.circle(X(x), Y(y), 3, color);
    const double ly = top + 10 + 18 * n;
    g.line(width - right + 12, ly, width - right + 40, ly, color, 2);
    g.text(width - right + 46, ly + 4, key);
    ++n;
  }
  return g.str();
}

long peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024;  // kilobytes on Linux
}

// Peak resident memory for causal L = 8192, 16384, 32768 (one head, D = 128): it grows with
// the inputs (linear in L), not with an Lq x Lk matrix. With the backward, dO and the
// gradients count as inputs and the backward's time is the last column.
void memory_check(const cpu::options& copt, const cpu::options* bopt) {
  std::printf("%8s %14s %16s %18s %12s%s\n", "L", "inputs_MiB", "peak_rss_MiB", "LqxLk_fp32_MiB",
              "seconds", bopt ? "  backward_s" : "");
  std::printf("%8s %14s %16ld %18s %12s\n", "start", "-", peak_rss_mib(), "-", "-");
  for (std::int64_t L : {8192, 16384, 32768}) {
    bench_point pt;
    pt.mask = "causal";
    pt.B = 1, pt.Hq = pt.Hk = 1, pt.Lq = pt.Lk = L, pt.D = pt.Dv = 128;
    bench_data d;
    make_data(d, pt, 1);
    const auto t0 = clock_type::now();
    cpu::attention(d.p, copt);
    const double s = seconds_since(t0);
    double bwd_s = 0;
    if (bopt != nullptr) {
      d.data.d_o = uniform({pt.B, pt.Hq, pt.Lq, pt.Dv}, 1, 3);
      const attention_gradients g = d.data.gradients();
      const auto t1 = clock_type::now();
      cpu::attention_backward(d.data.problem(), g, *bopt);
      bwd_s = seconds_since(t1);
    }
    double elements = double(d.data.q.size() + d.data.k.size() + d.data.v.size() + d.data.o.size() +
                             d.data.lse.size());
    if (bopt != nullptr)
      elements +=
          double(d.data.d_o.size() + d.data.dq.size() + d.data.dk.size() + d.data.dv.size());
    const double inputs = elements * 4.0 / (1 << 20);
    std::printf("%8lld %14.1f %16ld %18.0f %12.2f", (long long)L, inputs, peak_rss_mib(),
                double(L) * double(L) * 4.0 / (1 << 20), s);
    if (bopt != nullptr) std::printf("  %10.2f", bwd_s);
    std::printf("\n");
    std::fflush(stdout);
  }
}

int run_bench(const bench_options& opt) {
  for (const std::string& b : opt.backends) {
    if (b != "cpu" && b != "reference")  // the GPU grid is its own command
      throw problem_error(
          "backend: expected cpu or reference (the GPU grid is `flashref bench-gpu`), got '" + b +
          "'");
  }
  opt.grid.validate({"dense", "causal", "block_sparse", "local_window"});
  check_output_path(opt.json);
  check_output_path(opt.plot);
  const std::map<std::string, std::string> dtypes{
      {"fp32", "float32"}, {"bf16", "bfloat16"}, {"fp16", "float16"}};
  if (dtypes.count(opt.dtype) == 0)
    throw problem_error("dtype: expected one of fp32, bf16, fp16, got '" + opt.dtype + "'");
  const std::string dtype = dtypes.at(opt.dtype);
  cpu::options copt;
  copt.instruction_set = cpu::parse_isa(opt.isa);
  copt.half = cpu::parse_half_path(opt.half_path);
  copt.tile_q = opt.tile_q;
  copt.tile_k = opt.tile_k;
  if (copt.instruction_set != cpu::isa::automatic && !cpu::supported(copt.instruction_set))
    throw problem_error(std::string("isa: expected an instruction set this processor runs, got '") +
                        opt.isa + "'");
  cpu::options bopt = copt;  // the backward: same instruction set, its own tiles
  bopt.tile_q = opt.bwd_tile_q;
  bopt.tile_k = opt.bwd_tile_k;
  bopt.backward_chunks = opt.bwd_chunks;
  if (opt.memory_check) {
    memory_check(copt, opt.backward ? &bopt : nullptr);
    return 0;
  }
  const cpu::isa used =
      copt.instruction_set == cpu::isa::automatic ? cpu::best_isa() : copt.instruction_set;
  const int threads = omp_get_max_threads();
  std::printf("flashref bench: %d threads (OMP_NUM_THREADS), cpu kernels %s, %s inputs\n", threads,
              cpu::to_string(used), dtype.c_str());
  std::vector<bench_record> recs;
  print_header();

  // Baselines of the machine.
  double peak = 0, peak_dot = 0;
  cpu::half_path peak_dot_path = cpu::half_path::convert;
  if (opt.baselines) {
    bench_record r;
    r.backend = "peak_fma";
    r.threads = threads;
    r.isa = cpu::to_string(used);
    r.gflops = cpu::peak_fma_gflops(used, threads, 0.3);
    r.point.mask = "none";
    r.note = std::string("register-only ") + r.isa + " FMA loop";
    peak = r.gflops;
    print_record(r);
    recs.push_back(r);
    // bfloat16 on a path with its own unit: that unit's rate, which its points' %peak is taken
    // against (the convert path runs the fp32 kernels, against peak_fma).
    const cpu::half_path hp = copt.half == cpu::half_path::automatic
                                  ? cpu::preferred_half_path(input_dtype::bfloat16)
                                  : copt.half;
    if (dtype == "bfloat16" && used == cpu::isa::avx512 &&
        (hp == cpu::half_path::avx512_bf16 || hp == cpu::half_path::amx)) {
      bench_record dot;
      dot.backend = "peak_dot";
      dot.threads = threads;
      dot.isa = std::string(cpu::to_string(used)) + "+" + cpu::to_string(hp);
      dot.gflops = cpu::peak_dot_gflops(hp, threads, 0.3);
      dot.point.mask = "none";
      dot.note = hp == cpu::half_path::amx ? "register-only AMX tdpbf16ps loop"
                                           : "register-only vdpbf16ps loop";
      peak_dot = dot.gflops;
      peak_dot_path = hp;
      print_record(dot);
      recs.push_back(dot);
    }
    bench_record c;
    c.backend = "copy_bandwidth";
    c.threads = threads;
    c.point.mask = "none";
    c.gbps = copy_bandwidth_gbps(threads, 0.5);
    c.note = std::to_string(int(c.gbps)) + " GB/s read+write (memcpy, 256 MiB)";
    print_record(c);
    recs.push_back(c);
  }

  // The points: the grid (tokens, model) and the targets.
  std::vector<std::pair<bench_point, std::string>> points;
  for (const bench_point& pt : opt.grid.points(dtype))
    points.push_back({pt, "grid"});
  if (opt.targets) {
    bench_point t;
    t.dtype = dtype;
    t.B = 1, t.Hq = t.Hk = 8, t.Lq = t.Lk = 4096, t.D = t.Dv = 128;
    for (const char* m : {"dense", "causal"}) {
      t.mask = m;
      points.push_back({t, "target"});
    }
    t.mask = "block_sparse";
    for (double dens : {0.2, 0.05}) {
      t.density = dens;
      points.push_back({t, "target"});
    }
    bench_point dec;
    dec.dtype = dtype;
    dec.mask = "decode";
    dec.B = 1, dec.Hq = dec.Hk = 8, dec.Lq = 1, dec.Lk = 65536, dec.D = dec.Dv = 128;
    points.push_back({dec, "target"});
  }

  std::map<std::string, double> dense_time;      // shape key -> cpu dense time
  std::map<std::string, double> dense_bwd_time;  // shape key -> cpu backward dense time
  auto shape_key = [](const bench_point& p) {
    return std::to_string(p.B) + "/" + std::to_string(p.Hq) + "/" + std::to_string(p.Lq) + "/" +
           std::to_string(p.Lk) + "/" + std::to_string(p.D);
  };
  bool ok = true;
  for (const auto& [pt0, tag] : points) {
    bench_point pt = pt0;
    bench_data d;
    make_data(d, pt, opt.seed);
    if (pt.mask == "block_sparse") pt.density = d.density;
    double cpu_time = 0;
    for (const std::string& b : opt.backends) {
      if (b == "reference" && d.flops > 2e9) continue;  // far too slow: see the reference baseline
      bench_record r;
      r.point = pt;
      r.backend = b;
      r.flops = d.flops;
      r.note = tag;
      double point_peak = 0;
      if (b == "cpu") {
        const bool half = d.data.opt.dtype != input_dtype::float32;
        const cpu::plan pl = half ? cpu::make_plan(d.hp, copt) : cpu::make_plan(d.p, copt);
        // %peak against the rate of the unit the point's kernels use: the FMA for fp32 and the
        // convert path, the bf16 path's own unit otherwise (where it was measured).
        point_peak = !half || pl.half == cpu::half_path::convert ? peak
                     : pl.half == peak_dot_path                  ? peak_dot
                                                                 : 0;
        r.threads = pl.threads;
        r.isa = cpu::to_string(pl.used);
        if (half) {
          r.isa += std::string("+") + cpu::to_string(pl.half);
          r.median_s = median_time([&] { cpu::attention(d.hp, copt); }, opt.seconds);
          const bool bf16 = d.data.opt.dtype == input_dtype::bfloat16;
          for (std::size_t n = 0; n < d.o16.size(); ++n)  // O for the NaN check below
            d.data.o.data()[n] = bf16 ? cpu::bf16_to_float(d.o16[n]) : cpu::f16_to_float(d.o16[n]);
        } else {
          r.median_s = median_time([&] { cpu::attention(d.p, copt); }, opt.seconds);
        }
        cpu_time = r.median_s;
        if (pl.kv_splits > 1) r.note += ", " + std::to_string(pl.kv_splits) + " kv chunks";
        if (opt.tile_q > 0 || opt.tile_k > 0)
          r.note += ", tiles " + std::to_string(pl.tile_q) + "x" + std::to_string(pl.tile_k);
      } else {
        r.threads = 1;
        r.median_s = median_time([&] { reference::tiled_attention(d.p); }, opt.seconds);
      }
      r.gflops = r.flops / r.median_s * 1e-9;
      if (point_peak > 0 && b == "cpu" && (pt.dtype == "float32" || pt.mask != "decode"))
        r.peak_fraction = r.gflops / point_peak;  // decode rows of bf16 take the fp32 kernels
      for (float x : d.data.o)
        ok = ok && !std::isnan(x);
      if (pt.mask == "decode") {
        const double bytes = pt.dtype == "float32" ? 4.0 : 2.0;
        r.gbps = double(pt.B * pt.Hk * pt.Lk * (pt.D + pt.Dv)) * bytes / r.median_s * 1e-9;
        r.note += ", " + std::to_string(r.gbps).substr(0, 5) + " GB/s of K,V";
      }
      if (b == "cpu" && pt.mask == "dense") dense_time[shape_key(pt)] = r.median_s;
      if (b == "cpu" && pt.mask != "dense" && dense_time.count(shape_key(pt)))
        r.vs_dense = r.median_s / dense_time[shape_key(pt)];
      recs.push_back(r);
      if (!(opt.baselines && b == "cpu" && (pt.mask == "dense" || pt.mask == "causal"))) {
        print_record(recs.back());
      }
      if (b == "cpu" && opt.backward && pt.mask != "decode") {
        // The backward from the forward just timed: SPEC §9 counts 2.5 x the forward's FLOPs.
        d.data.d_o = uniform({pt.B, pt.Hq, pt.Lq, pt.Dv}, opt.seed, 3);
        const attention_gradients g = d.data.gradients();
        bench_record w = r;
        w.backend = "cpu_backward";
        w.flops = 2.5 * r.flops;
        w.threads = cpu::make_backward_plan(d.p, bopt).threads;
        w.median_s = median_time([&] { cpu::attention_backward(d.p, g, bopt); }, opt.seconds);
        w.gflops = w.flops / w.median_s * 1e-9;
        w.peak_fraction = peak > 0 ? w.gflops / peak : 0;
        w.vs_naive = w.vs_reference = 0;
        w.vs_dense = 0;
        if (pt.mask == "dense") dense_bwd_time[shape_key(pt)] = w.median_s;
        if (pt.mask != "dense" && dense_bwd_time.count(shape_key(pt)))
          w.vs_dense = w.median_s / dense_bwd_time[shape_key(pt)];
        char ratio[64];
        std::snprintf(ratio, sizeof ratio, ", %.2f x the forward's GFLOP/s", w.gflops / r.gflops);
        w.note += ratio;
        for (float x : d.data.dq)
          ok = ok && !std::isnan(x);
        recs.push_back(w);
        print_record(w);
      }
    }
    // The naive OpenBLAS attention on the same dense and causal points.
    if (opt.baselines && (pt.mask == "dense" || pt.mask == "causal") && cpu_time > 0) {
      bench_record n;
      n.point = pt;
      n.backend = "openblas_naive";
      n.threads = threads;
      n.flops = d.flops;
      n.note = tag;
      n.median_s = median_time([&] { naive_blas(d, threads); }, opt.seconds);
      n.gflops = n.flops / n.median_s * 1e-9;
      n.peak_fraction = peak > 0 ? n.gflops / peak : 0;
      for (auto it = recs.rbegin(); it != recs.rend(); ++it) {
        if (it->backend == "cpu") {
          it->vs_naive = n.median_s / it->median_s;
          print_record(*it);
          break;
        }
      }
      print_record(n);
      recs.push_back(n);
    }
  }

  // The scalar tiled reference (float64) on a small point, with the cpu backend beside it.
  if (opt.baselines) {
    bench_point pt;
    pt.B = 1, pt.Hq = pt.Hk = 2, pt.Lq = pt.Lk = 1024, pt.D = pt.Dv = 64;
    pt.mask = "dense";
    bench_data d;
    make_data(d, pt, opt.seed);
    bench_record ref, ours;
    ref.point = ours.point = pt;
    ref.flops = ours.flops = d.flops;
    ref.backend = "reference";
    ref.threads = 1;
    ref.note = "small point: the scalar reference is too slow for the grid";
    ref.median_s = median_time([&] { reference::tiled_attention(d.p); }, opt.seconds);
    ref.gflops = ref.flops / ref.median_s * 1e-9;
    ours.backend = "cpu";
    ours.threads = cpu::make_plan(d.p, copt).threads;
    ours.isa = cpu::to_string(used);
    ours.note = "small point";
    ours.median_s = median_time([&] { cpu::attention(d.p, copt); }, opt.seconds);
    ours.gflops = ours.flops / ours.median_s * 1e-9;
    ours.peak_fraction = peak > 0 ? ours.gflops / peak : 0;
    ours.vs_reference = ref.median_s / ours.median_s;
    print_record(ref);
    print_record(ours);
    recs.push_back(ref);
    recs.push_back(ours);
  }

  if (!opt.json.empty()) write_records(opt.json, recs);
  if (!opt.plot.empty()) write_text_atomically(opt.plot, plot_svg(recs, opt.grid.densities, peak));
  if (!ok) std::fprintf(stderr, "flashref bench: NaN in an output\n");
  return ok ? 0 : 1;
}

}  // namespace

void add_bench(CLI::App& app, exit_slot status) {
  auto opt = std::make_shared<bench_options>();
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "CPU benchmark grid (SPEC §8) with peak-FMA, OpenBLAS-naive and reference baselines");
  cmd->add_option("--backend", opt->backends, "backends to time: cpu, reference")->delimiter(',');
  bench_grid& g = opt->grid;
  cmd->add_option("--lengths", g.lengths, "sequence lengths L (B = tokens / L)")->delimiter(',');
  cmd->add_option("--head-dims", g.head_dims, "head dims D (Hq = model / D)")->delimiter(',');
  cmd->add_option("--masks", g.masks, "dense, causal, block_sparse, local_window")->delimiter(',');
  cmd->add_option("--densities", g.densities, "block-sparse densities (128x128 blocks)")
      ->delimiter(',');
  cmd->add_option("--tokens", g.tokens, "B * L on the grid");
  cmd->add_option("--model", g.model, "Hq * D on the grid");
  cmd->add_option("--seconds", opt->seconds, "timed seconds per point (at least 3 runs)");
  cmd->add_option("--isa", opt->isa, "CPU instruction set: automatic, portable, avx2, avx512");
  cmd->add_option("--dtype", opt->dtype, "inputs and O stored as fp32, bf16 or fp16");
  cmd->add_option("--half-path", opt->half_path,
                  "CPU path for bf16/fp16: automatic, convert, avx512_bf16, amx");
  cmd->add_option("--tile-q", opt->tile_q, "CPU query tile (0: the instruction set's default)");
  cmd->add_option("--tile-k", opt->tile_k, "CPU key tile (0: the instruction set's default)");
  cmd->add_option("--seed", opt->seed, "seed of the inputs and block masks");
  cmd->add_option("--json", opt->json, "write the records as JSON to this file");
  cmd->add_option("--plot", opt->plot, "write GFLOP/s vs sequence length as SVG to this file");
  cmd->add_flag("!--no-targets", opt->targets, "skip the target points");
  cmd->add_flag("--backward", opt->backward,
                "also time the CPU backward (SPEC §9: 2.5 x the forward's FLOPs) at every point");
  cmd->add_option("--bwd-tile-q", opt->bwd_tile_q, "CPU backward query tile (0: its default)");
  cmd->add_option("--bwd-tile-k", opt->bwd_tile_k, "CPU backward key tile (0: its default)");
  cmd->add_option("--bwd-chunks", opt->bwd_chunks,
                  "CPU backward key-tile chunks per (batch, kv head) (0: from the shape)");
  cmd->add_flag("!--no-baselines", opt->baselines, "skip peak FMA, copy, OpenBLAS and reference");
  cmd->add_flag("--memory-check", opt->memory_check,
                "only report peak resident memory for causal L = 8192 ... 32768");
  cmd->callback([opt, status]() { *status = run_bench(*opt); });
}

}  // namespace flashref::cli
