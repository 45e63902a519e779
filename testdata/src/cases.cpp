// The golden cases. Compiled with -ffp-contract=off: every input is a pure function of the
// case's seed (counter_rng) and IEEE-exact arithmetic, so regeneration is bit-identical.

#include "flashref/testdata/cases.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "flashref/reference/spec.hpp"
#include "flashref/testdata/random.hpp"

#ifndef FLASHREF_VERSION_STRING
#error "FLASHREF_VERSION_STRING must be defined by the build"
#endif

namespace flashref::testdata {

namespace {

using shape4 = std::array<std::size_t, 4>;

// Streams of counter_rng per tensor, so that adding a tensor never shifts another one.
enum stream : std::uint64_t { kQ = 0, kK = 1, kV = 2, kMask = 3, kDirection = 4, kDo = 5 };

// Standard normals times sigma, rounded to float32 and then to dtype.
xt::xtensor<float, 4> normals(std::uint64_t seed, std::uint64_t stream, shape4 shape,
                              double sigma = 1.0, input_dtype dtype = input_dtype::float32) {
  const counter_rng rng(seed, stream);
  auto x = xt::xtensor<float, 4>::from_shape(shape);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x.data()[i] = round_to(dtype, float(sigma * rng.normal(i)));
  }
  return x;
}

struct dims {
  std::size_t B, Hq, Hk, Lq, Lk, D, Dv;
};

// The head dim of the half-precision twins where their case has a smaller one: tensor-core
// kernels (ours among them) take D = Dv in {64, 128}.
constexpr std::size_t kTwinHeadDim = 64;

// How a case is built: as itself, or as a half-precision twin — the same construction with
// the inputs rounded to `twin` (a float32 case's bfloat16 or float16 sibling) and equal head
// dims below kTwinHeadDim widened to it. Masks, lengths, heads and seed stay the case's.
struct variant {
  input_dtype twin = input_dtype::float32;  // float32: the case itself

  bool is_twin() const { return twin != input_dtype::float32; }
  std::size_t head_dim(std::size_t D) const {
    return is_twin() && D < kTwinHeadDim ? kTwinHeadDim : D;
  }
  dims shape(dims d) const {
    if (d.D == d.Dv) d.D = d.Dv = head_dim(d.D);
    return d;
  }
};

// Random q, k, v of the given dims (widened for a twin), rounded to dtype.
void dense(fixture& fx, dims d, const variant& v, input_dtype dtype = input_dtype::float32) {
  d = v.shape(d);
  fx.in.q = normals(fx.seed, kQ, {d.B, d.Hq, d.Lq, d.D}, 1.0, dtype);
  fx.in.k = normals(fx.seed, kK, {d.B, d.Hk, d.Lk, d.D}, 1.0, dtype);
  fx.in.v = normals(fx.seed, kV, {d.B, d.Hk, d.Lk, d.Dv}, 1.0, dtype);
  fx.in.opt.dtype = dtype;
}

// A block mask drawn like the repro: visible where randn <= threshold.
void random_block_mask(fixture& fx, shape4 shape, std::int64_t block_q, std::int64_t block_k,
                       double threshold) {
  const counter_rng rng(fx.seed, kMask);
  auto m = xt::xtensor<std::uint8_t, 4>::from_shape(shape);
  for (std::size_t i = 0; i < m.size(); ++i)
    m.data()[i] = rng.normal(i) <= threshold;
  fx.in.opt.block_mask = std::move(m);
  fx.in.opt.block_q = block_q;
  fx.in.opt.block_k = block_k;
}

// Single-query spec cases express the key mask as a block mask of 1 x 1 blocks, (1, 1, 1, Lk).
void key_mask(fixture& fx, const std::vector<std::uint8_t>& visible) {
  auto m = xt::xtensor<std::uint8_t, 4>::from_shape({1, 1, 1, visible.size()});
  std::copy(visible.begin(), visible.end(), m.begin());
  fx.in.opt.block_mask = std::move(m);
  fx.in.opt.block_q = fx.in.opt.block_k = 1;
}

// Moves key j of the single query of a spec case along q so that its score rises by shift[j]
// (up to float32 rounding): k_j += shift_j * q / (scale * q.q).
void shift_scores(fixture& fx, const std::vector<double>& shift) {
  auto& q = fx.in.q;
  auto& k = fx.in.k;
  const std::size_t D = q.shape(3);
  const double scale = 1.0 / std::sqrt(double(D));
  double qq = 0;
  for (std::size_t d = 0; d < D; ++d)
    qq += double(q(0, 0, 0, d)) * double(q(0, 0, 0, d));
  for (std::size_t j = 0; j < shift.size(); ++j) {
    for (std::size_t d = 0; d < D; ++d) {
      k(0, 0, j, d) =
          float(double(k(0, 0, j, d)) + shift[j] * double(q(0, 0, 0, d)) / (scale * qq));
    }
  }
}

[[noreturn]] void broken(const fixture& fx, const std::string& what) {
  throw std::logic_error("fixture " + fx.name + ": the construction does not deliver: " + what);
}

// --- the cases ---------------------------------------------------------------------------

void make_spec_random(fixture& fx, const variant& v) {
  dense(fx, {1, 1, 1, 1, 13, 8, 8}, v);
}

void make_spec_rescale_lower(fixture& fx, const variant& v) {
  dense(fx, {1, 1, 1, 1, 16, 8, 8}, v);
  std::vector<double> shift(16, -3.0);  // later tiles: well below ...
  for (std::size_t j = 0; j < 4; ++j)
    shift[j] = 0.0;
  shift[1] = 6.0;  // ... the clear maximum in the first tile
  shift_scores(fx, shift);
}

void check_rescale_lower(const fixture& fx) {
  for (std::size_t t = 1; t < fx.trace->exp_old.size(); ++t)
    if (!(fx.trace->exp_old(t) == 1.0)) broken(fx, "exp_old == 1 on every tile after the first");
}

void make_spec_rescale_higher(fixture& fx, const variant& v) {
  dense(fx, {1, 1, 1, 1, 16, 8, 8}, v);
  std::vector<double> shift(16);
  for (std::size_t j = 0; j < 16; ++j)
    shift[j] = 4.0 * double(j / std::size_t(kSpecTile));
  shift_scores(fx, shift);  // tile t is lifted by 4 t: each tile raises the running max
}

void check_rescale_higher(const fixture& fx) {
  for (std::size_t t = 1; t < fx.trace->exp_old.size(); ++t) {
    const double e = fx.trace->exp_old(t);
    if (!(e > 0.0 && e < 1.0)) broken(fx, "0 < exp_old < 1 on every tile after the first");
  }
}

void make_spec_masked_first_block(fixture& fx, const variant& v) {
  dense(fx, {1, 1, 1, 1, 12, 8, 8}, v);
  std::vector<std::uint8_t> visible(12, 1);
  for (std::size_t j = 0; j < 4; ++j)
    visible[j] = 0;  // the whole first tile
  visible[6] = 0;    // and one key of a later tile
  key_mask(fx, visible);
}

void check_masked_first_block(const fixture& fx) {
  const spec_trace& t = *fx.trace;
  if (!(t.m(0) == -INFINITY && t.s(0) == 0.0 && std::isfinite(t.m(1)) &&
        std::isfinite(fx.golden.lse[0]))) {
    broken(fx, "a fully masked first tile followed by visible tiles");
  }
}

void make_spec_all_masked(fixture& fx, const variant& v) {
  dense(fx, {1, 1, 1, 1, 8, 8, 8}, v);
  key_mask(fx, std::vector<std::uint8_t>(8, 0));
}

void check_all_masked(const fixture& fx) {
  if (fx.golden.lse[0] != -INFINITY) broken(fx, "a row with no visible key");
}

void make_blocksparse_empty_rows(fixture& fx, const variant& v) {
  dense(fx, {1, 2, 2, 256, 256, 32, 32}, v);
  random_block_mask(fx, {1, 2, 8, 8}, 32, 32, 0.2);
  auto& m = fx.in.opt.block_mask;
  // The arrangement the bug needs, whatever the draw gave: an empty q-block row (failure
  // case 2) and a row whose first four k-blocks (128 keys, a whole kernel tile) are masked
  // before a visible one (failure case 1).
  for (std::size_t kb = 0; kb < 8; ++kb)
    m(0, 0, 1, kb) = 0;
  for (std::size_t kb = 0; kb < 4; ++kb)
    m(0, 1, 2, kb) = 0;
  m(0, 1, 2, 4) = 1;
}

void check_blocksparse_empty_rows(const fixture& fx) {
  const auto& m = fx.in.opt.block_mask;
  bool empty_row = false, first_masked = false;
  for (std::size_t h = 0; h < m.shape(1); ++h) {
    for (std::size_t qb = 0; qb < m.shape(2); ++qb) {
      std::size_t on = 0;
      for (std::size_t kb = 0; kb < m.shape(3); ++kb)
        on += m(0, h, qb, kb) != 0;
      empty_row = empty_row || on == 0;
      first_masked = first_masked || (on > 0 && m(0, h, qb, 0) == 0);
    }
  }
  if (!empty_row || !first_masked) broken(fx, "an empty q-block row and a first-masked row");
}

void make_blocksparse_all_empty(fixture& fx, const variant& v) {
  dense(fx, {1, 2, 2, 48, 48, 16, 16}, v);
  fx.in.opt.block_mask = xt::zeros<std::uint8_t>(shape4{1, 2, 3, 3});
  fx.in.opt.block_q = fx.in.opt.block_k = 16;
}

void make_blocksparse_full(fixture& fx, const variant& v) {
  dense(fx, {1, 2, 2, 40, 40, 16, 16}, v);
  fx.in.opt.block_mask = xt::ones<std::uint8_t>(shape4{1, 1, 3, 3});  // broadcast over heads
  fx.in.opt.block_q = fx.in.opt.block_k = 16;                         // a partial tail block
}

void make_blocksparse_odd_blocks(fixture& fx, const variant& v) {
  dense(fx, {2, 2, 2, 100, 130, 16, 16}, v);
  random_block_mask(fx, {1, 2, 5, 4}, 24, 40, 0.2);  // ceil(100/24) = 5, ceil(130/40) = 4
}

void make_causal(fixture& fx, const variant& v, std::size_t Lq, std::size_t Lk, causal_mode mode) {
  dense(fx, {1, 2, 2, Lq, Lk, 16, 16}, v);
  fx.in.opt.causal = mode;
}

void make_local_window(fixture& fx, const variant& v) {
  dense(fx, {1, 2, 2, 48, 40, 16, 16}, v);
  fx.in.opt.window_left = 3;  // row i sees keys [i - 11, i - 6]: empty for i < 6
  fx.in.opt.window_right = 2;
}

void make_local_window_causal(fixture& fx, const variant& v) {
  dense(fx, {1, 2, 2, 64, 64, 16, 16}, v);
  fx.in.opt.causal = causal_mode::bottom_right;
  fx.in.opt.window_left = 7;
}

void make_kv_len_zero(fixture& fx, const variant& v) {
  dense(fx, {3, 2, 2, 8, 24, 16, 16}, v);
  fx.in.opt.kv_len = {17, 0, 5};
}

void make_extreme_scores(fixture& fx, const variant& v) {
  const std::size_t D = v.head_dim(16);  // the scores' spread is 64 * 32 whatever D (scale)
  fx.in.q = normals(fx.seed, kQ, {1, 2, 8, D}, 64.0);
  fx.in.k = normals(fx.seed, kK, {1, 2, 40, D}, 32.0);
  fx.in.v = normals(fx.seed, kV, {1, 2, 40, D});
}

// Scores in float64 of the stored inputs, one row at a time.
template <class F>
void for_each_score_row(const fixture& fx, F&& f) {
  const attention_problem p = fx.in.inputs();
  std::vector<double> s(std::size_t(p.len_k()));
  for (std::int64_t h = 0; h < p.heads_q(); ++h) {
    for (std::int64_t i = 0; i < p.len_q(); ++i) {
      for (std::int64_t j = 0; j < p.len_k(); ++j) {
        double dot = 0;
        for (std::int64_t d = 0; d < p.head_dim(); ++d)
          dot += double(p.q(0, h, i, d)) * double(p.k(0, h / p.group_size(), j, d));
        s[std::size_t(j)] = p.softmax_scale() * dot;
      }
      f(h, s);
    }
  }
}

void check_extreme_scores(const fixture& fx) {
  for_each_score_row(fx, [&](std::int64_t, std::vector<double> s) {
    std::sort(s.begin(), s.end(), std::greater<>());
    // Magnitudes of 1e3..1e4, and one clear winner per row: a gap of 20 makes the runner-up's
    // weight < 3e-9, so float32 rounding of scores this large cannot move O beyond tolerance.
    if (!(std::abs(s[0]) >= 1e3 && std::abs(s[0]) <= 2e4 && s[0] - s[1] >= 20.0))
      broken(fx, "row maxima of magnitude 1e3..2e4 with a top-2 gap >= 20");
  });
}

void make_monotone_maxima(fixture& fx, const variant& v) {
  const std::size_t H = 2, Lq = 8, Lk = 64, D = v.head_dim(16);
  const double scale = 1.0 / std::sqrt(double(D));
  const counter_rng rq(fx.seed, kQ), rk(fx.seed, kK), ru(fx.seed, kDirection);
  fx.in.q = xt::xtensor<float, 4>::from_shape({1, H, Lq, D});
  fx.in.k = xt::xtensor<float, 4>::from_shape({1, H, Lk, D});
  fx.in.v = normals(fx.seed, kV, {1, H, Lk, D});
  // Every query of head h is close to a direction u; key j lies along u so that its score is
  // about slope * j: rising keys in head 0, falling keys in head 1.
  for (std::size_t h = 0; h < H; ++h) {
    std::vector<double> u(D);
    double uu = 0;
    for (std::size_t d = 0; d < D; ++d) {
      u[d] = ru.normal(h * D + d);
      uu += u[d] * u[d];
    }
    const double slope = h == 0 ? 0.25 : -0.25;
    for (std::size_t i = 0; i < Lq; ++i)
      for (std::size_t d = 0; d < D; ++d)
        fx.in.q(0, h, i, d) = float(u[d] + 0.1 * rq.normal((h * Lq + i) * D + d));
    for (std::size_t j = 0; j < Lk; ++j)
      for (std::size_t d = 0; d < D; ++d)
        fx.in.k(0, h, j, d) =
            float(0.05 * rk.normal((h * Lk + j) * D + d) + slope * double(j) * u[d] / (scale * uu));
  }
}

void check_monotone_maxima(const fixture& fx) {
  // Strict monotonicity over tiles of 4 keys implies it over any tile of a multiple of 4.
  for_each_score_row(fx, [&](std::int64_t h, const std::vector<double>& s) {
    double prev = h == 0 ? -INFINITY : INFINITY;
    for (std::size_t k0 = 0; k0 < s.size(); k0 += std::size_t(kSpecTile)) {
      const double mx = *std::max_element(s.begin() + std::ptrdiff_t(k0),
                                          s.begin() + std::ptrdiff_t(k0 + std::size_t(kSpecTile)));
      if (h == 0 ? !(mx > prev) : !(mx < prev)) broken(fx, "tile maxima strictly monotone");
      prev = mx;
    }
  });
}

// ---- the backward's own traps (SPEC §9) ---------------------------------------------------

// One row in the middle of a tile sees nothing (block_q = 1), its neighbours see every key.
void make_bwd_empty_row_in_tile(fixture& fx, const variant& v) {
  dense(fx, {1, 2, 2, 32, 48, 16, 16}, v);
  xt::xtensor<std::uint8_t, 4> m = xt::ones<std::uint8_t>(shape4{1, 2, 32, 1});
  m(0, 0, 9, 0) = m(0, 1, 20, 0) = 0;
  fx.in.opt.block_mask = m;
  fx.in.opt.block_q = 1;
  fx.in.opt.block_k = 48;
}

// Keys 5 and 30 are masked for every row (block_k = 1): their dK, dV must be exactly 0.
void make_bwd_unseen_key(fixture& fx, const variant& v) {
  dense(fx, {1, 2, 2, 24, 40, 16, 16}, v);
  xt::xtensor<std::uint8_t, 4> m = xt::ones<std::uint8_t>(shape4{1, 1, 1, 40});
  m(0, 0, 0, 5) = m(0, 0, 0, 30) = 0;
  fx.in.opt.block_mask = m;
  fx.in.opt.block_q = 24;
  fx.in.opt.block_k = 1;
}

// Key lengths that cut a 32-, 64- or 128-key tile; keys at or beyond them get dK = dV = 0.
void make_bwd_kv_len_cuts_tile(fixture& fx, const variant& v) {
  dense(fx, {2, 2, 2, 16, 150, 16, 16}, v);
  fx.in.opt.kv_len = {45, 129};
}

// GQA (Hq = 4, Hk = 2) with a head-wise block mask: in group 0, head 1 has an empty q-block row
// that head 0 does not, so dK, dV of the group sum a full head and a partly empty one.
void make_bwd_gqa_empty_row_one_head(fixture& fx, const variant& v) {
  dense(fx, {1, 4, 2, 24, 32, 16, 16}, v);
  xt::xtensor<std::uint8_t, 4> m = xt::ones<std::uint8_t>(shape4{1, 4, 3, 4});
  for (std::size_t kb = 0; kb < 4; ++kb)
    m(0, 1, 1, kb) = 0;
  m(0, 2, 0, 3) = 0;
  fx.in.opt.block_mask = m;
  fx.in.opt.block_q = fx.in.opt.block_k = 8;
}

// Scores ~1e3 whose spread within a row stays O(1): Q[..., 0] = K[..., 0] = c with
// scale c^2 ~ 1000 (scale = 1/sqrt(D)). P is spread, so dQ and dK are large and only a
// recomputation from the stored LSE (not a fresh block max, not LSE = 0) gives them.
void make_bwd_large_scores(fixture& fx, const variant& v) {
  dense(fx, {1, 2, 2, 16, 48, 16, 16}, v);
  const std::size_t D = fx.in.q.shape(3);  // 16, or a twin's widened head dim
  const float c = float(std::sqrt(1000.0 * std::sqrt(double(D))));
  for (auto* x : {&fx.in.q, &fx.in.k})
    for (std::size_t n = 0; n < x->size(); n += D)
      x->data()[n] = c;
}

void check_bwd_large_scores(const fixture& fx) {
  for_each_score_row(fx, [&](std::int64_t, std::vector<double> s) {
    std::sort(s.begin(), s.end(), std::greater<>());
    if (!(s[0] > 900.0 && s[0] < 1100.0 && s[0] - s[1] < 3.0))
      broken(fx, "row maxima ~1e3 with a top-2 gap below 3 (P spread)");
  });
}
// What a case is, beyond its inputs: a spec case (single query, with a /trace), a float32
// case with half-precision twins, or a case whose inputs are half precision already.
enum class case_kind { spec, twinned, half };

struct case_def {
  case_info info;
  void (*make)(fixture&, const variant&);
  void (*check)(const fixture&);  // the property the case exists for, or null
  case_kind kind;
  bool backward = true;  // /inputs/do and /golden/dq, dk, dv (else its description says why)
};

const std::vector<case_def>& definitions() {
  using cm = causal_mode;
  static const std::vector<case_def> defs = {
      {{"spec_random",
        "spec function equals one-shot softmax on random input; Lk = 13 is not a multiple of the "
        "tile (4)",
        101},
       make_spec_random,
       nullptr,
       case_kind::spec},
      {{"spec_rescale_lower",
        "every tile after the first scores below the running max: exp_old == 1", 102},
       make_spec_rescale_lower,
       check_rescale_lower,
       case_kind::spec},
      {{"spec_rescale_higher",
        "every tile raises the running max: exp_old < 1, earlier terms shrink", 103},
       make_spec_rescale_higher,
       check_rescale_higher,
       case_kind::spec},
      {{"spec_masked_first_block",
        "first tile fully masked, later tiles visible (failure case 1): no NaN", 104},
       make_spec_masked_first_block,
       check_masked_first_block,
       case_kind::spec},
      {{"spec_all_masked", "no visible key (failure case 2): O = 0, LSE = -inf", 105},
       make_spec_all_masked,
       check_all_masked,
       case_kind::spec},
      {{"blocksparse_empty_rows",
        "the block-sparse repro: mask randn <= 0.2 with an empty q-block row and a row whose first "
        "four k-blocks are masked",
        201},
       make_blocksparse_empty_rows,
       check_blocksparse_empty_rows,
       case_kind::twinned},
      {{"blocksparse_all_empty", "block mask all zero: every row is empty", 202},
       make_blocksparse_all_empty,
       nullptr,
       case_kind::twinned},
      {{"blocksparse_full",
        "block mask all one (broadcast over heads, partial tail block) equals dense", 203},
       make_blocksparse_full,
       nullptr,
       case_kind::twinned},
      {{"blocksparse_odd_blocks",
        "block sizes 24 x 40 that divide nothing (Lq = 100, Lk = 130), mask broadcast over batch",
        204},
       make_blocksparse_odd_blocks,
       nullptr,
       case_kind::twinned},
      {{"causal_square", "causal, Lq = Lk = 33 (both alignments agree)", 301},
       [](fixture& fx, const variant& v) { make_causal(fx, v, 33, 33, cm::bottom_right); },
       nullptr,
       case_kind::twinned},
      {{"causal_lq_gt_lk", "causal bottom-right, Lq = 40 > Lk = 24: the first 16 rows are empty",
        302},
       [](fixture& fx, const variant& v) { make_causal(fx, v, 40, 24, cm::bottom_right); },
       nullptr,
       case_kind::twinned},
      {{"causal_lq_gt_lk_top_left",
        "causal top-left, Lq = 40 > Lk = 24: row i sees keys j <= i, no empty row", 303},
       [](fixture& fx, const variant& v) { make_causal(fx, v, 40, 24, cm::top_left); },
       nullptr,
       case_kind::twinned},
      {{"causal_lq_lt_lk", "causal bottom-right, Lq = 24 < Lk = 40: row i sees keys j <= i + 16",
        304},
       [](fixture& fx, const variant& v) { make_causal(fx, v, 24, 40, cm::bottom_right); },
       nullptr,
       case_kind::twinned},
      {{"causal_lq_lt_lk_top_left", "causal top-left, Lq = 24 < Lk = 40: row i sees keys j <= i",
        305},
       [](fixture& fx, const variant& v) { make_causal(fx, v, 24, 40, cm::top_left); },
       nullptr,
       case_kind::twinned},
      {{"local_window",
        "sliding window (left 3, right 2), Lq = 48 > Lk = 40: the windows of the first 6 rows are "
        "empty",
        401},
       make_local_window,
       nullptr,
       case_kind::twinned},
      {{"local_window_causal", "causal sliding window (left 7), Lq = Lk = 64", 402},
       make_local_window_causal,
       nullptr,
       case_kind::twinned},
      {{"kv_len_zero", "kv_len = [17, 0, 5]: a batch entry without keys next to normal ones", 501},
       make_kv_len_zero,
       nullptr,
       case_kind::twinned},
      {{"gqa", "grouped-query attention: Hq = 8, Hk = 2", 601},
       [](fixture& fx, const variant& v) {
         dense(fx, {1, 8, 2, 16, 24, 16, 16}, v);
       },
       nullptr,
       case_kind::twinned},
      {{"gqa_mqa", "multi-query attention: Hq = 4, Hk = 1", 602},
       [](fixture& fx, const variant& v) {
         dense(fx, {2, 4, 1, 12, 20, 16, 16}, v);
       },
       nullptr,
       case_kind::twinned},
      {{"dv_ne_d", "D = 24 (not a power of two) and Dv = 40", 701},
       [](fixture& fx, const variant& v) {
         dense(fx, {1, 2, 2, 32, 32, 24, 40}, v);
       },
       nullptr,
       case_kind::twinned},
      {{"extreme_scores",
        "scores of magnitude 1e3..1e4 (exp overflows without max subtraction), top-2 gap >= 20; "
        "no backward: P is one-hot to 1e-9, so dQ and dK lie below the float32 rounding of O "
        "that every backward starts from (bwd_large_scores has large scores with P spread)",
        801},
       make_extreme_scores,
       check_extreme_scores,
       case_kind::twinned,
       /*backward=*/false},
      {{"monotone_maxima",
        "tile maxima rising every 4 keys (head 0: a rescale at every tile) and falling (head 1: "
        "none)",
        802},
       make_monotone_maxima,
       check_monotone_maxima,
       case_kind::twinned},
      {{"decode_lq1", "decoding: Lq = 1, Lk = 777, multi-query (Hq = 4, Hk = 1), D = 64", 901},
       [](fixture& fx, const variant& v) {
         dense(fx, {1, 4, 1, 1, 777, 64, 64}, v);
       },
       nullptr,
       case_kind::twinned},
      {{"half_inputs_bf16", "inputs exactly representable in bfloat16, D = 64; bfloat16 tolerance",
        1001},
       [](fixture& fx, const variant& v) {
         dense(fx, {1, 2, 2, 64, 64, 64, 64}, v, input_dtype::bfloat16);
       },
       nullptr,
       case_kind::half},
      {{"half_inputs_fp16", "inputs exactly representable in float16, D = 64; float16 tolerance",
        1002},
       [](fixture& fx, const variant& v) {
         dense(fx, {1, 2, 2, 64, 64, 64, 64}, v, input_dtype::float16);
       },
       nullptr,
       case_kind::half},
      {{"bwd_empty_row_in_tile",
        "backward: rows 9 (head 0) and 20 (head 1) see no key, their neighbours every key "
        "(block_q = 1): dQ = 0 there, no NaN",
        1101},
       make_bwd_empty_row_in_tile,
       nullptr,
       case_kind::twinned},
      {{"bwd_unseen_key", "backward: keys 5 and 30 are visible to no row: dK = dV = 0 exactly",
        1102},
       make_bwd_unseen_key,
       nullptr,
       case_kind::twinned},
      {{"bwd_kv_len_cuts_tile",
        "backward: kv_len = [45, 129] cuts 32-, 64- and 128-key tiles: keys beyond get dK = dV = 0",
        1103},
       make_bwd_kv_len_cuts_tile,
       nullptr,
       case_kind::twinned},
      {{"bwd_gqa_empty_row_one_head",
        "backward: GQA (Hq = 4, Hk = 2), head 1 has an empty q-block row that head 0 of its group "
        "has not",
        1104},
       make_bwd_gqa_empty_row_one_head,
       nullptr,
       case_kind::twinned},
      {{"bwd_large_scores",
        "backward: scores ~1e3 with P spread (top-2 gap < 3): P must come from the stored LSE",
        1105},
       make_bwd_large_scores,
       check_bwd_large_scores,
       case_kind::twinned},
  };
  return defs;
}

// Golden values, tolerance and (for spec cases) the trace of the spec function.
void finish(fixture& fx, bool spec, bool backward) {
  const attention_problem p = fx.in.inputs();
  fx.golden = reference::naive_attention(p);
  double max_v = 0;
  for (float x : fx.in.v)
    max_v = std::max(max_v, double(std::abs(x)));
  fx.tol = default_tolerance(fx.in.opt.dtype, max_v);
  if (backward) {
    // dO ~ N(0, 1) from its own stream (representable in the input dtype), then the golden
    // gradients of Σ O ∘ dO from the naive float64 backward.
    fx.in.d_o = normals(fx.seed, kDo,
                        {fx.in.q.shape(0), fx.in.q.shape(1), fx.in.q.shape(2), fx.in.v.shape(3)},
                        1.0, fx.in.opt.dtype);
    fx.grads = reference::naive_attention_backward(p, fx.in.gradients().d_o);
  }
  if (!spec) return;
  if (p.batch() != 1 || p.heads_q() != 1 || p.len_q() != 1) broken(fx, "a single query");
  const spec_row row = spec_row_of(p, 0, 0, 0);
  const reference::spec_result r =
      reference::tiled_softmax_dot(row.q, row.K, row.V, kSpecTile, row.key_mask, row.scale);
  spec_trace t;
  const std::size_t n = r.trace.size();
  t.m = xt::xtensor<double, 1>::from_shape({n});
  t.s = t.m;
  t.exp_old = t.m;
  for (std::size_t i = 0; i < n; ++i) {
    t.m(i) = r.trace[i].m_new;
    t.s(i) = r.trace[i].s;
    t.exp_old(i) = r.trace[i].exp_old;
  }
  fx.trace = std::move(t);
}

// A case as the folder holds it: a definition built as itself or as one of its twins.
struct built_case {
  case_info info;
  const case_def* def;
  variant v;
  std::string twin_of;  // the float32 case, for a twin
};

const char* twin_suffix(input_dtype t) {
  return t == input_dtype::bfloat16 ? "_bf16" : "_fp16";
}

// Every case, in the order `fixtures list` prints: the definitions, then their bfloat16 twins,
// then their float16 twins.
const std::vector<built_case>& built_cases() {
  static const std::vector<built_case> all = [] {
    std::vector<built_case> out;
    for (const case_def& d : definitions())
      out.push_back({d.info, &d, variant{}, ""});
    for (const input_dtype t : {input_dtype::bfloat16, input_dtype::float16}) {
      for (const case_def& d : definitions()) {
        if (d.kind != case_kind::twinned) continue;
        const variant v{t};
        case_info info = d.info;
        info.name += twin_suffix(t);
        info.description = std::string(to_string(t)) + " twin of " + d.info.name +
                           " (inputs rounded to " + to_string(t) + ", D = Dv < " +
                           std::to_string(kTwinHeadDim) + " widened to " +
                           std::to_string(kTwinHeadDim) + "; " + to_string(t) +
                           " tolerance): " + d.info.description;
        // The backward's half-precision rule is pinned by half_inputs_bf16/fp16; twins with
        // gradients would more than double the folder.
        if (d.backward)
          info.description +=
              "; no backward in the twin (half_inputs_* carry the half-precision gradients)";
        out.push_back({info, &d, v, d.info.name});
      }
    }
    return out;
  }();
  return all;
}

// A twin reads exactly its dtype: every input rounded (idempotent where dense() did it).
void round_inputs(fixture& fx, input_dtype t) {
  for (auto* x : {&fx.in.q, &fx.in.k, &fx.in.v})
    for (float& e : *x)
      e = round_to(t, e);
  fx.in.opt.dtype = t;
}

}  // namespace

const std::vector<case_info>& cases() {
  static const std::vector<case_info> infos = [] {
    std::vector<case_info> v;
    for (const built_case& c : built_cases())
      v.push_back(c.info);
    return v;
  }();
  return infos;
}

fixture generate(const std::string& name) {
  for (const built_case& c : built_cases()) {
    if (c.info.name != name) continue;
    fixture fx;
    fx.name = c.info.name;
    fx.description = c.info.description;
    fx.seed = c.info.seed;
    fx.twin_of = c.twin_of;
    fx.generator = "flashref " FLASHREF_VERSION_STRING " fixtures (format " +
                   std::to_string(kFormatVersion) + ")";
    c.def->make(fx, c.v);
    if (c.v.is_twin()) round_inputs(fx, c.v.twin);
    finish(fx, c.def->kind == case_kind::spec, c.def->backward && !c.v.is_twin());
    if (c.def->check != nullptr) c.def->check(fx);
    return fx;
  }
  throw problem_error("case: expected one of the names `flashref fixtures list` prints, got '" +
                      name + "'");
}

}  // namespace flashref::testdata
