// flashref demo — the block-sparse bug, reproduced and fixed on an embedded default problem.
//
// A random sparse block mask (drawn like randn(...) <= threshold) with at least one empty
// q-block row and at least one q-block row whose first visible k-block comes after a masked
// one. The two broken teaching loops, the guarded spec function, the tiled reference and every
// available backend run on it; one table compares each to the float64 golden result.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "commands.hpp"
#include "flashref/flashref.hpp"
#include "flashref/reference/conformance.hpp"
#include "flashref/reference/mask.hpp"
#include "flashref/testdata/random.hpp"

namespace flashref::cli {

namespace {

struct demo_options {
  std::uint64_t seed = 2024;
  std::int64_t batch = 2, heads = 4, seq = 1024, dim = 64, block = 64;
  double threshold = 0.2;
  std::vector<std::string> backends;  // empty: every available backend
  bool timing = true;                 // false: omit time and GFLOP/s (reproducible output)
};

struct demo_problem {
  std::int64_t B, H, L, D, nb;
  problem_data data;    // q, k, v, o (B, H, L, D); lse (B, H, L); block mask (B, H, nb, nb)
  attention_problem p;  // the view of `data`
};

void build(const demo_options& opt, demo_problem& d) {
  if (opt.batch < 1 || opt.heads < 2 || opt.dim < 1 || opt.block < 1 || opt.seq < 4 * opt.block)
    throw problem_error(
        "demo: expected batch >= 1, heads >= 2, dim >= 1, block >= 1 and seq >= 4 * block, got "
        "batch " +
        std::to_string(opt.batch) + ", heads " + std::to_string(opt.heads) + ", dim " +
        std::to_string(opt.dim) + ", block " + std::to_string(opt.block) + ", seq " +
        std::to_string(opt.seq));
  d.B = opt.batch, d.H = opt.heads, d.L = opt.seq, d.D = opt.dim;
  d.nb = (d.L + opt.block - 1) / opt.block;
  const std::array<std::size_t, 4> shape{std::size_t(d.B), std::size_t(d.H), std::size_t(d.L),
                                         std::size_t(d.D)};
  problem_data& data = d.data;
  data.q = xt::xtensor<float, 4>::from_shape(shape);
  data.k = xt::xtensor<float, 4>::from_shape(shape);
  data.v = xt::xtensor<float, 4>::from_shape(shape);
  const testdata::counter_rng rq(opt.seed, 0), rk(opt.seed, 1), rv(opt.seed, 2), rm(opt.seed, 3);
  for (std::size_t i = 0; i < data.q.size(); ++i) {
    data.q.data()[i] = float(rq.normal(i));
    data.k.data()[i] = float(rk.normal(i));
    data.v.data()[i] = float(rv.normal(i));
  }
  auto& mask = data.opt.block_mask;
  mask = xt::xtensor<std::uint8_t, 4>::from_shape(
      {std::size_t(d.B), std::size_t(d.H), std::size_t(d.nb), std::size_t(d.nb)});
  for (std::size_t i = 0; i < mask.size(); ++i)
    mask.data()[i] = rm.normal(i) <= opt.threshold;
  auto at = [&](std::int64_t b, std::int64_t h, std::int64_t qb, std::int64_t kb) -> std::uint8_t& {
    return mask(std::size_t(b), std::size_t(h), std::size_t(qb), std::size_t(kb));
  };
  // The arrangement the bug needs: an empty q-block row (failure case 2) and a row whose
  // first visible k-block follows a masked one (failure case 1).
  for (std::int64_t kb = 0; kb < d.nb; ++kb)
    at(0, 0, 1, kb) = 0;
  at(0, 1, 2, 0) = 0;
  at(0, 1, 2, 1) = 1;

  data.opt.block_q = data.opt.block_k = opt.block;
  d.p = data.problem();
  const attention_problem& p = d.p;
  validate(p);
}

enum class loop_kind { unguarded, patched, guarded };

// Runs one of the spec-function variants row by row over the whole problem.
void run_spec_variant(const demo_problem& d, std::int64_t tile, loop_kind kind,
                      std::vector<double>& o, std::vector<double>& lse) {
  const mask_spec mask = make_mask_spec(d.p);
  const double scale = d.p.softmax_scale();
  o.assign(std::size_t(d.B * d.H * d.L * d.D), 0.0);
  lse.assign(std::size_t(d.B * d.H * d.L), 0.0);
  xt::xtensor<double, 2> K = xt::zeros<double>({std::size_t(d.L), std::size_t(d.D)});
  xt::xtensor<double, 2> V = K;
  xt::xtensor<double, 1> q = xt::zeros<double>({std::size_t(d.D)});
  xt::xtensor<std::uint8_t, 1> key_mask = xt::zeros<std::uint8_t>({std::size_t(d.L)});
  for (std::int64_t b = 0; b < d.B; ++b) {
    for (std::int64_t h = 0; h < d.H; ++h) {
      for (std::int64_t j = 0; j < d.L; ++j)
        for (std::int64_t c = 0; c < d.D; ++c) {
          K(j, c) = d.p.k(b, h, j, c);
          V(j, c) = d.p.v(b, h, j, c);
        }
      for (std::int64_t i = 0; i < d.L; ++i) {
        for (std::int64_t c = 0; c < d.D; ++c)
          q(c) = d.p.q(b, h, i, c);
        for (std::int64_t j = 0; j < d.L; ++j)
          key_mask(j) = mask.visible(b, h, i, j);
        const reference::spec_result r =
            kind == loop_kind::guarded
                ? reference::tiled_softmax_dot(q, K, V, tile, key_mask, scale)
            : kind == loop_kind::patched
                ? reference::teaching::tiled_softmax_dot_patched(q, K, V, tile, key_mask, scale)
                : reference::teaching::tiled_softmax_dot_unguarded(q, K, V, tile, key_mask, scale);
        const std::size_t row = std::size_t((b * d.H + h) * d.L + i);
        std::copy(r.out.begin(), r.out.end(), o.begin() + std::ptrdiff_t(row * std::size_t(d.D)));
        lse[row] = r.lse;
      }
    }
  }
}

struct variant_result {
  std::string variant;
  bool teaching;
  conformance_report rep;
  std::int64_t nan_first_masked;  // NaN rows among non-empty rows whose first k-block is masked
  double seconds;
};

template <class T>
std::int64_t count_nan_first_masked(const demo_problem& d, const reference::golden& g, const T* o,
                                    const T* lse, std::int64_t block) {
  const mask_spec mask = make_mask_spec(d.p);
  std::int64_t n = 0;
  for (std::int64_t b = 0; b < d.B; ++b)
    for (std::int64_t h = 0; h < d.H; ++h)
      for (std::int64_t i = 0; i < d.L; ++i) {
        const std::size_t row = std::size_t((b * d.H + h) * d.L + i);
        if (g.lse[row] == -INFINITY || mask.block_visible(b, h, i / block, 0)) continue;
        bool nan = std::isnan(double(lse[row]));
        for (std::int64_t c = 0; c < d.D; ++c)
          nan = nan || std::isnan(double(o[row * std::size_t(d.D) + std::size_t(c)]));
        n += nan;
      }
  return n;
}

int run_demo(const demo_options& opt) {
  demo_problem d;
  build(opt, d);
  std::vector<backend> chosen;
  if (opt.backends.empty()) {
    for (const backend_info& info : flashref::backends())
      if (info.available) chosen.push_back(info.id);
  } else {
    for (const std::string& s : opt.backends)
      chosen.push_back(resolve(parse_backend(s)));
  }

  const reference::golden g = reference::naive_attention(d.p);
  double max_v = 0;
  for (float x : d.data.v)
    max_v = std::max(max_v, double(std::abs(x)));
  const tolerance tol = default_tolerance(input_dtype::float32, max_v);
  const mask_spec mask = make_mask_spec(d.p);
  double pairs = 0;
  std::int64_t empty_qblocks = 0, first_masked_qblocks = 0;
  for (std::int64_t b = 0; b < d.B; ++b)
    for (std::int64_t h = 0; h < d.H; ++h)
      for (std::int64_t qb = 0; qb < d.nb; ++qb) {
        std::int64_t on = 0;
        for (std::int64_t kb = 0; kb < d.nb; ++kb)
          on += mask.block_visible(b, h, qb, kb);
        pairs += double(on) / double(d.nb);
        empty_qblocks += on == 0;
        first_masked_qblocks += on > 0 && !mask.block_visible(b, h, qb, 0);
      }
  const double density = pairs / double(d.B * d.H * d.nb);
  const double flops = dense_flops(d.p) * density;

  std::printf(
      "flashref demo: block-sparse attention, B=%lld H=%lld L=%lld D=%lld, block %lldx%lld, seed "
      "%llu\n",
      (long long)d.B, (long long)d.H, (long long)d.L, (long long)d.D, (long long)opt.block,
      (long long)opt.block, (unsigned long long)opt.seed);
  std::printf(
      "block mask: randn <= %.2f, density %.3f, %lld empty q-block rows, %lld q-block rows whose "
      "first k-block is masked\n",
      opt.threshold, density, (long long)empty_qblocks, (long long)first_masked_qblocks);
  std::printf(
      "tolerance (float32): |o - ref| <= %.3g + %.3g |ref|, |lse - ref| <= %.3g max(1, |ref|); "
      "empty rows: O = 0, LSE = -inf\n\n",
      tol.atol, tol.rtol, tol.atol_lse);

  using clock = std::chrono::steady_clock;
  std::vector<variant_result> rows;
  const struct {
    const char* name;
    loop_kind kind;
    bool teaching;
  } spec_variants[] = {{"unguarded loop [teaching]", loop_kind::unguarded, true},
                       {"s != 0 patch [teaching]", loop_kind::patched, true},
                       {"spec function (guarded)", loop_kind::guarded, false}};
  for (const auto& sv : spec_variants) {
    std::vector<double> o, lse;
    const auto t0 = clock::now();
    run_spec_variant(d, opt.block, sv.kind, o, lse);
    const double secs = std::chrono::duration<double>(clock::now() - t0).count();
    rows.push_back({sv.name, sv.teaching, compare(g, o.data(), lse.data(), tol),
                    count_nan_first_masked(d, g, o.data(), lse.data(), opt.block), secs});
  }
  for (backend be : chosen) {
    d.data.o.fill(NAN);
    d.data.lse.fill(NAN);
    const auto t0 = clock::now();
    attention(d.p, be);
    const double secs = std::chrono::duration<double>(clock::now() - t0).count();
    rows.push_back(
        {std::string("backend ") + to_string(be) + (be == backend::reference ? " (tiled)" : ""),
         false, compare(g, d.data.o.data(), d.data.lse.data(), tol),
         count_nan_first_masked(d, g, d.data.o.data(), d.data.lse.data(), opt.block), secs});
  }

  std::printf("%-27s %12s %9s %16s %18s", "variant", "max|err|", "NaN rows", "empty rows ok",
              "NaN first-masked");
  if (opt.timing) std::printf(" %10s %9s", "time ms", "GFLOP/s");
  std::printf("  %s\n", "verdict");
  bool ok = true;
  for (const variant_result& r : rows) {
    const bool pass = r.rep.pass();
    if (!r.teaching && !pass) ok = false;
    char empty[32];
    std::snprintf(empty, sizeof empty, "%lld/%lld",
                  (long long)(r.rep.empty_rows - r.rep.empty_rows_bad),
                  (long long)r.rep.empty_rows);
    std::printf("%-27s %12.3e %9lld %16s %18lld", r.variant.c_str(), r.rep.max_abs_err,
                (long long)r.rep.nan_rows, empty, (long long)r.nan_first_masked);
    if (opt.timing) std::printf(" %10.1f %9.2f", r.seconds * 1e3, flops / r.seconds * 1e-9);
    std::printf("  %s\n", pass ? "PASS" : (r.teaching ? "FAIL (expected: teaching)" : "FAIL"));
  }
  std::printf("\n%s\n", ok ? "every non-teaching variant meets the contract"
                           : "CONTRACT BROKEN: a non-teaching variant failed");
  return ok ? 0 : 1;
}

}  // namespace

void add_demo(CLI::App& app, exit_slot status) {
  auto opt = std::make_shared<demo_options>();
  CLI::App* cmd = app.add_subcommand(
      "demo", "Reproduce the block-sparse NaN bug and show every backend meeting the contract");
  cmd->add_option("--seed", opt->seed, "Seed of the inputs and the block mask")
      ->capture_default_str();
  cmd->add_option("--batch", opt->batch, "Batch size")->capture_default_str();
  cmd->add_option("--heads", opt->heads, "Number of heads")->capture_default_str();
  cmd->add_option("--seq", opt->seq, "Sequence length (queries = keys)")->capture_default_str();
  cmd->add_option("--dim", opt->dim, "Head dimension")->capture_default_str();
  cmd->add_option("--block", opt->block, "Mask block size (square); also the teaching loops' tile")
      ->capture_default_str();
  cmd->add_option("--threshold", opt->threshold, "A block is visible when randn <= threshold")
      ->capture_default_str();
  cmd->add_option(
      "--backend", opt->backends,
      "Backends to run (reference, cpu, cuda, automatic); default: every available one");
  cmd->add_flag("!--no-timing", opt->timing,
                "Omit the time and GFLOP/s columns (reproducible output)");
  cmd->callback([opt, status] { *status = run_demo(*opt); });
}

}  // namespace flashref::cli
