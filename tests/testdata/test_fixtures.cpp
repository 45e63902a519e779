// Every committed fixture on every available backend and through the spec function, the
// property each case exists for, and the generator's determinism.

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <set>

#include "flashref/flashref.hpp"
#include "flashref/reference/mask.hpp"
#include "flashref/testdata/cases.hpp"
#include "helpers.hpp"

namespace td = flashref::testdata;
using flashref::test::testdata_dir;

namespace {

td::fixture load(const std::string& name) {
  return td::read_fixture(testdata_dir() / (name + ".h5"));
}

std::int64_t empty_rows(const td::fixture& fx) {
  return std::count(fx.golden.lse.begin(), fx.golden.lse.end(), -INFINITY);
}

// Golden LSE of row (b, h, i).
double golden_lse(const td::fixture& fx, std::int64_t b, std::int64_t h, std::int64_t i) {
  const auto& s = fx.golden.o_shape;
  return fx.golden.lse[std::size_t((b * s[1] + h) * s[2] + i)];
}

bool is_spec_case(const std::string& name) {
  return name.rfind("spec_", 0) == 0;
}

}  // namespace

TEST_CASE("the committed folder holds exactly the generator's cases, small", "[fixtures]") {
  std::set<std::string> on_disk, generated;
  std::uintmax_t bytes = 0;
  for (const auto& e : std::filesystem::directory_iterator(testdata_dir())) {
    if (e.path().extension() != ".h5") continue;
    on_disk.insert(e.path().stem().string());
    bytes += e.file_size();
  }
  for (const td::case_info& c : td::cases())
    generated.insert(c.name);
  CHECK(on_disk == generated);
  CHECK(bytes < 10'000'000u);  // the whole folder, twins included, under 10 MB
  for (const char* required : {"spec_random",
                               "spec_rescale_lower",
                               "spec_rescale_higher",
                               "spec_masked_first_block",
                               "spec_all_masked",
                               "blocksparse_empty_rows",
                               "blocksparse_all_empty",
                               "blocksparse_full",
                               "blocksparse_odd_blocks",
                               "causal_square",
                               "causal_lq_gt_lk",
                               "causal_lq_lt_lk",
                               "local_window",
                               "kv_len_zero",
                               "gqa",
                               "dv_ne_d",
                               "extreme_scores",
                               "monotone_maxima",
                               "decode_lq1",
                               "half_inputs_bf16",
                               "half_inputs_fp16",
                               "bwd_empty_row_in_tile",
                               "bwd_unseen_key",
                               "bwd_kv_len_cuts_tile",
                               "bwd_gqa_empty_row_one_head",
                               "bwd_large_scores"}) {
    CAPTURE(required);
    CHECK(generated.count(required) == 1);
  }
}

TEST_CASE("every fixture passes on every available backend", "[fixtures][backends]") {
  // Backends join by registering in flashref::backends(); no test code changes.
  for (const td::case_info& c : td::cases()) {
    const td::fixture fx = load(c.name);
    CHECK(fx.name == c.name);
    for (const flashref::backend_info& info : flashref::backends()) {
      if (!info.available) continue;  // e.g. CUDA without a device
      DYNAMIC_SECTION(c.name << " on " << flashref::to_string(info.id)) {
        flashref::problem_data d = fx.in;
        const flashref::attention_problem p = d.problem();
        auto& o = d.o;
        auto& lse = d.lse;
        std::fill(o.begin(), o.end(), NAN);  // unwritten elements must show
        std::fill(lse.begin(), lse.end(), NAN);
        try {
          flashref::attention(p, info.id);
        } catch (const flashref::problem_error& e) {
          // A backend may decline head dims it does not implement, but never the D = 64 / 128
          // of the benchmark shapes (SPEC §8).
          WARN(flashref::to_string(info.id) << " declined " << c.name << ": " << e.what());
          const bool common_dims = (p.head_dim() == 64 || p.head_dim() == 128) &&
                                   (p.head_dim_v() == 64 || p.head_dim_v() == 128);
          CHECK_FALSE(common_dims);
          continue;
        }
        const flashref::conformance_report r =
            flashref::compare(fx.golden, o.data(), lse.data(), fx.tol);
        CAPTURE(r.max_abs_err, r.max_rel_err, r.max_lse_err, r.nan_rows, r.empty_rows_bad,
                r.bad_elements, fx.tol.atol, fx.tol.rtol, fx.tol.atol_lse);
        CHECK(r.nan_rows == 0);
        CHECK(r.empty_rows_bad == 0);
        CHECK(r.empty_rows == empty_rows(fx));
        CHECK(r.pass());
      }
    }
  }
}

TEST_CASE("the spec function reproduces every fixture row by row", "[fixtures][spec]") {
  for (const td::case_info& c : td::cases()) {
    CAPTURE(c.name);
    const td::fixture fx = load(c.name);
    const flashref::attention_problem p = fx.in.inputs();
    std::vector<double> o, lse;
    for (std::int64_t b = 0; b < p.batch(); ++b)
      for (std::int64_t h = 0; h < p.heads_q(); ++h)
        for (std::int64_t i = 0; i < p.len_q(); ++i) {
          const td::spec_row row = td::spec_row_of(p, b, h, i);
          const auto r = flashref::reference::tiled_softmax_dot(row.q, row.K, row.V, td::kSpecTile,
                                                                row.key_mask, row.scale);
          o.insert(o.end(), r.out.begin(), r.out.end());
          lse.push_back(r.lse);
        }
    const flashref::conformance_report r =
        flashref::compare(fx.golden, o.data(), lse.data(), fx.tol);
    CAPTURE(r.max_abs_err, r.max_lse_err, r.nan_rows, r.empty_rows_bad, r.bad_elements);
    CHECK(r.pass());
  }
}

TEST_CASE("spec cases: one query, and the spec function's trace equals the stored trace",
          "[fixtures][spec]") {
  std::size_t spec_cases = 0;
  for (const td::case_info& c : td::cases()) {
    const td::fixture fx = load(c.name);
    CAPTURE(c.name);
    CHECK(fx.trace.has_value() == is_spec_case(c.name));
    if (!fx.trace) continue;
    ++spec_cases;
    const flashref::attention_problem p = fx.in.inputs();
    REQUIRE(p.batch() == 1);
    REQUIRE(p.heads_q() == 1);
    REQUIRE(p.heads_k() == 1);
    REQUIRE(p.len_q() == 1);
    const td::spec_row row = td::spec_row_of(p, 0, 0, 0);
    const auto r = flashref::reference::tiled_softmax_dot(row.q, row.K, row.V, fx.trace->tile,
                                                          row.key_mask, row.scale);
    CHECK(fx.trace->tile == td::kSpecTile);
    REQUIRE(r.trace.size() == fx.trace->m.size());
    REQUIRE(r.trace.size() == std::size_t((p.len_k() + td::kSpecTile - 1) / td::kSpecTile));
    for (std::size_t t = 0; t < r.trace.size(); ++t) {
      CAPTURE(t);
      CHECK(r.trace[t].m_new == fx.trace->m(t));  // bit for bit, -inf included
      CHECK(r.trace[t].s == fx.trace->s(t));
      CHECK(r.trace[t].exp_old == fx.trace->exp_old(t));
    }
  }
  CHECK(spec_cases == 5);
}

TEST_CASE("each spec case pins what its name says, read from its trace", "[fixtures][spec]") {
  SECTION("spec_random: Lk is not a multiple of the tile") {
    const td::fixture fx = load("spec_random");
    CHECK(fx.in.k.shape(2) % std::size_t(td::kSpecTile) != 0);
    CHECK_FALSE(fx.in.opt.block_mask.size() > 0);
  }
  SECTION("spec_rescale_lower: exp_old == 1 on every later tile") {
    const td::fixture fx = load("spec_rescale_lower");
    REQUIRE(fx.trace->exp_old.size() >= 3);
    CHECK(fx.trace->exp_old(0) == 0.0);  // the first visible tile keeps nothing
    for (std::size_t t = 1; t < fx.trace->exp_old.size(); ++t) {
      CAPTURE(t);
      CHECK(fx.trace->exp_old(t) == 1.0);
      CHECK(fx.trace->m(t) == fx.trace->m(0));
    }
  }
  SECTION("spec_rescale_higher: 0 < exp_old < 1 on every later tile") {
    const td::fixture fx = load("spec_rescale_higher");
    REQUIRE(fx.trace->exp_old.size() >= 3);
    for (std::size_t t = 1; t < fx.trace->exp_old.size(); ++t) {
      CAPTURE(t);
      CHECK(fx.trace->exp_old(t) > 0.0);
      CHECK(fx.trace->exp_old(t) < 1.0);
      CHECK(fx.trace->m(t) > fx.trace->m(t - 1));
    }
  }
  SECTION("spec_masked_first_block: the first tile leaves the state empty, later tiles count") {
    const td::fixture fx = load("spec_masked_first_block");
    CHECK(fx.in.opt.block_q == 1);  // the key mask as 1 x 1 blocks
    CHECK(fx.in.opt.block_k == 1);
    for (std::size_t j = 0; j < std::size_t(td::kSpecTile); ++j)
      CHECK(fx.in.opt.block_mask(0, 0, 0, j) == 0);
    CHECK(fx.trace->m(0) == -INFINITY);
    CHECK(fx.trace->s(0) == 0.0);
    for (std::size_t t = 1; t < fx.trace->m.size(); ++t)
      CHECK(std::isfinite(fx.trace->m(t)));
    CHECK(std::isfinite(fx.golden.lse[0]));
    for (double x : fx.golden.o)
      CHECK(std::isfinite(x));
  }
  SECTION("spec_all_masked: O = 0 and LSE = -inf") {
    const td::fixture fx = load("spec_all_masked");
    CHECK(fx.golden.lse[0] == -INFINITY);
    for (double x : fx.golden.o)
      CHECK(x == 0.0);
    for (std::size_t t = 0; t < fx.trace->m.size(); ++t) {
      CHECK(fx.trace->m(t) == -INFINITY);
      CHECK(fx.trace->s(t) == 0.0);
    }
  }
}

TEST_CASE("the other cases pin what their names say", "[fixtures]") {
  SECTION("blocksparse_empty_rows: an empty q-block row and a row whose first k-block is masked") {
    const td::fixture fx = load("blocksparse_empty_rows");
    const auto& m = fx.in.opt.block_mask;
    REQUIRE(m.dimension() == 4);
    std::int64_t empty_qrows = 0, first_masked = 0;
    for (std::size_t b = 0; b < m.shape(0); ++b)
      for (std::size_t h = 0; h < m.shape(1); ++h)
        for (std::size_t qb = 0; qb < m.shape(2); ++qb) {
          std::size_t on = 0;
          for (std::size_t kb = 0; kb < m.shape(3); ++kb)
            on += m(b, h, qb, kb) != 0;
          empty_qrows += on == 0;
          first_masked += on > 0 && m(b, h, qb, 0) == 0;
        }
    CHECK(empty_qrows >= 1);
    CHECK(first_masked >= 1);
    CHECK(empty_rows(fx) == empty_qrows * fx.in.opt.block_q);
    // Density near that of randn <= 0.2 (Φ(0.2) = 0.58).
    const double density = double(std::count(m.begin(), m.end(), 1)) / double(m.size());
    CHECK(density > 0.4);
    CHECK(density < 0.75);
  }
  SECTION("blocksparse_all_empty: every row empty") {
    const td::fixture fx = load("blocksparse_all_empty");
    CHECK(empty_rows(fx) == std::int64_t(fx.golden.lse.size()));
    for (double x : fx.golden.o)
      CHECK(x == 0.0);
  }
  SECTION("blocksparse_full: equals dense, bit for bit") {
    td::fixture fx = load("blocksparse_full");
    CHECK(std::all_of(fx.in.opt.block_mask.begin(), fx.in.opt.block_mask.end(),
                      [](std::uint8_t x) { return x == 1; }));
    CHECK(fx.in.q.shape(2) % std::size_t(fx.in.opt.block_q) != 0);  // a partial tail block
    fx.in.opt.block_mask = {};
    fx.in.opt.block_q = fx.in.opt.block_k = 0;
    const flashref::reference::golden dense = flashref::reference::naive_attention(fx.in.inputs());
    CHECK(dense.o == fx.golden.o);
    CHECK(dense.lse == fx.golden.lse);
  }
  SECTION("blocksparse_odd_blocks: block sizes that divide neither length") {
    const td::fixture fx = load("blocksparse_odd_blocks");
    CHECK(fx.in.q.shape(2) % std::size_t(fx.in.opt.block_q) != 0);
    CHECK(fx.in.k.shape(2) % std::size_t(fx.in.opt.block_k) != 0);
    CHECK(fx.in.opt.block_mask.shape(0) == 1);  // broadcast over batch
    CHECK(fx.in.q.shape(0) == 2);
  }
  SECTION("causal: empty top rows exactly when bottom-right aligned with Lq > Lk") {
    const td::fixture br = load("causal_lq_gt_lk"), tl = load("causal_lq_gt_lk_top_left");
    const std::int64_t Lq = br.golden.o_shape[2], Lk = std::int64_t(br.in.k.shape(2));
    REQUIRE(Lq > Lk);
    for (std::int64_t h = 0; h < br.golden.o_shape[1]; ++h)
      for (std::int64_t i = 0; i < Lq; ++i) {
        CAPTURE(h, i);
        CHECK((golden_lse(br, 0, h, i) == -INFINITY) == (i < Lq - Lk));
        CHECK(std::isfinite(golden_lse(tl, 0, h, i)));
      }
    CHECK(br.in.opt.causal == flashref::causal_mode::bottom_right);
    CHECK(tl.in.opt.causal == flashref::causal_mode::top_left);
    CHECK(load("causal_lq_lt_lk").in.q.shape(2) < load("causal_lq_lt_lk").in.k.shape(2));
    CHECK(load("causal_lq_lt_lk_top_left").in.opt.causal == flashref::causal_mode::top_left);
    CHECK(empty_rows(load("causal_square")) == 0);
  }
  SECTION("local_window: rows whose window is empty") {
    const td::fixture fx = load("local_window");
    CHECK(fx.in.opt.window_left >= 0);
    CHECK(fx.in.opt.window_right >= 0);
    for (std::int64_t i = 0; i < fx.golden.o_shape[2]; ++i) {
      CAPTURE(i);
      CHECK((golden_lse(fx, 0, 0, i) == -INFINITY) == (i < 6));
    }
  }
  SECTION("kv_len_zero: a batch entry without keys next to normal ones") {
    const td::fixture fx = load("kv_len_zero");
    REQUIRE(fx.in.opt.kv_len.size() == 3);
    CHECK(fx.in.opt.kv_len[1] == 0);
    for (std::int64_t b = 0; b < 3; ++b)
      for (std::int64_t i = 0; i < fx.golden.o_shape[2]; ++i)
        CHECK((golden_lse(fx, b, 1, i) == -INFINITY) == (b == 1));
  }
  SECTION("gqa / mqa, Dv != D, decode") {
    const td::fixture g = load("gqa"), m = load("gqa_mqa"), d = load("dv_ne_d"),
                      dec = load("decode_lq1");
    CHECK(g.in.q.shape(1) == 8);
    CHECK(g.in.k.shape(1) == 2);
    CHECK(m.in.k.shape(1) == 1);
    CHECK(d.in.q.shape(3) != d.in.v.shape(3));
    CHECK(std::popcount(d.in.q.shape(3)) != 1);  // D not a power of two
    CHECK(dec.in.q.shape(2) == 1);
    CHECK(dec.in.k.shape(2) > 512);
  }
  SECTION("extreme_scores: LSE of magnitude 1e3..1e4, finite everywhere") {
    const td::fixture fx = load("extreme_scores");
    for (double l : fx.golden.lse) {
      CHECK(std::isfinite(l));
      CHECK(std::abs(l) > 1e3);
      CHECK(std::abs(l) < 2e4);
      CHECK(std::abs(l) > 709.0);  // beyond exp's range even in float64
    }
  }
}

TEST_CASE("half_inputs and tolerances: values representable, tolerance from default_tolerance",
          "[fixtures]") {
  for (const td::case_info& c : td::cases()) {
    const td::fixture fx = load(c.name);
    CAPTURE(c.name);
    double max_v = 0;
    for (float x : fx.in.v)
      max_v = std::max(max_v, double(std::abs(x)));
    const flashref::tolerance t = flashref::default_tolerance(fx.in.opt.dtype, max_v);
    CHECK(fx.tol.atol == t.atol);
    CHECK(fx.tol.rtol == t.rtol);
    CHECK(fx.tol.atol_lse == t.atol_lse);
    for (const auto* x : {&fx.in.q, &fx.in.k, &fx.in.v})
      for (float v : *x)
        REQUIRE(td::round_to(fx.in.opt.dtype, v) == v);
  }
  CHECK(load("half_inputs_bf16").in.opt.dtype == flashref::input_dtype::bfloat16);
  CHECK(load("half_inputs_fp16").in.opt.dtype == flashref::input_dtype::float16);
  // float16 keeps 10 fraction bits, bfloat16 only 7: the float16 case really uses the extra bits.
  const td::fixture fp = load("half_inputs_fp16");
  const auto not_bf16 = std::count_if(fp.in.q.begin(), fp.in.q.end(), [](float x) {
    return td::round_to(flashref::input_dtype::bfloat16, x) != x;
  });
  CHECK(not_bf16 > std::ptrdiff_t(fp.in.q.size() / 2));
}

TEST_CASE("round_to: nearest, ties to even, subnormals and overflow", "[fixtures]") {
  using flashref::input_dtype;
  CHECK(td::round_to(input_dtype::bfloat16, 1.0f + 0x1p-8f) == 1.0f);  // tie -> even
  CHECK(td::round_to(input_dtype::bfloat16, 1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);
  CHECK(td::round_to(input_dtype::bfloat16, 1.0f + 0x1p-8f + 0x1p-20f) == 1.0f + 0x1p-7f);
  CHECK(td::round_to(input_dtype::float16, 1.0f + 0x1p-11f) == 1.0f);
  CHECK(td::round_to(input_dtype::float16, 1.0f + 3 * 0x1p-11f) == 1.0f + 0x1p-9f);
  CHECK(td::round_to(input_dtype::float16, 0x1p-25f) == 0.0f);  // subnormal tie -> even
  CHECK(td::round_to(input_dtype::float16, 3 * 0x1p-25f) == 0x1p-23f);
  CHECK(td::round_to(input_dtype::float16, -70000.0f) == -INFINITY);
  CHECK(td::round_to(input_dtype::float16, 65504.0f) == 65504.0f);
  CHECK(td::round_to(input_dtype::float32, 0.1f) == 0.1f);
}

TEST_CASE("generation is deterministic and every case checks its own property", "[fixtures]") {
  for (const td::case_info& c : td::cases()) {
    CAPTURE(c.name);
    const td::fixture a = td::generate(c.name), b = td::generate(c.name);
    CHECK((a.in.q == b.in.q));
    CHECK((a.in.k == b.in.k));
    CHECK((a.in.v == b.in.v));
    CHECK(a.golden.o == b.golden.o);
    CHECK(a.golden.lse == b.golden.lse);
    CHECK(a.seed == c.seed);
  }
  CHECK_THROWS_AS(td::generate("no_such_case"), flashref::problem_error);
}

TEST_CASE("every fixture's gradients pass on every backend with a backward",
          "[fixtures][backends][backward]") {
  // SPEC §9: every case carries /inputs/do and /golden/dq, dk, dv unless it states why not.
  std::size_t with_gradients = 0;
  for (const td::case_info& c : td::cases()) {
    const td::fixture fx = load(c.name);
    if (!fx.grads) {
      CAPTURE(c.name, fx.description);
      CHECK(fx.description.find("no backward") != std::string::npos);
      continue;
    }
    ++with_gradients;
    for (const flashref::backend_info& info : flashref::backends()) {
      if (!info.available || !info.backward) continue;
      DYNAMIC_SECTION(c.name << " backward on " << flashref::to_string(info.id)) {
        flashref::problem_data d = fx.in;
        flashref::attention(d.problem(), info.id);
        const flashref::attention_gradients g = d.gradients();
        std::fill(d.dq.begin(), d.dq.end(), NAN);  // unwritten elements must show
        std::fill(d.dk.begin(), d.dk.end(), NAN);
        std::fill(d.dv.begin(), d.dv.end(), NAN);
        flashref::attention_backward(d.problem(), g, info.id);
        const auto& gold = *fx.grads;
        const flashref::input_dtype dt = fx.in.opt.dtype;
        const std::int64_t D = gold.q_shape[3], Dv = gold.v_shape[3];
        for (auto [name, rep] :
             {std::pair{"dq",
                        flashref::compare_gradient(gold.dq, d.dq.data(), D, gold.row_empty, dt)},
              {"dk", flashref::compare_gradient(gold.dk, d.dk.data(), D, gold.key_unseen, dt)},
              {"dv", flashref::compare_gradient(gold.dv, d.dv.data(), Dv, gold.key_unseen, dt)}}) {
          CAPTURE(name, rep.bad_elements, rep.nonfinite, rep.max_abs_err, rep.max_ref,
                  rep.zero_rows, rep.zero_rows_nan, rep.zero_rows_nonzero);
          CHECK(rep.pass());
        }
      }
    }
  }
  // Without: extreme_scores and every half-precision twin (half_inputs_* carry gradients).
  CHECK(with_gradients >= 27);
}

TEST_CASE("the backward's trap cases pin what their names say", "[fixtures][backward]") {
  auto row_empty = [](const td::fixture& fx, std::int64_t h, std::int64_t i) {
    return golden_lse(fx, 0, h, i) == -INFINITY;
  };
  SECTION("bwd_empty_row_in_tile: empty rows between rows that see every key") {
    const td::fixture fx = load("bwd_empty_row_in_tile");
    CHECK(row_empty(fx, 0, 9));
    CHECK_FALSE(row_empty(fx, 0, 8));
    CHECK_FALSE(row_empty(fx, 0, 10));
    CHECK(row_empty(fx, 1, 20));
    CHECK(empty_rows(fx) == 2);
  }
  SECTION("bwd_unseen_key: keys 5 and 30 have golden dK = dV = 0 exactly") {
    const td::fixture fx = load("bwd_unseen_key");
    REQUIRE(fx.grads);
    const auto& g = *fx.grads;
    const std::int64_t Lk = g.k_shape[2], D = g.k_shape[3];
    std::int64_t unseen = 0;
    for (std::int64_t hk = 0; hk < g.k_shape[1]; ++hk)
      for (std::int64_t j = 0; j < Lk; ++j) {
        const bool expect = j == 5 || j == 30;
        CHECK(bool(g.key_unseen[std::size_t(hk * Lk + j)]) == expect);
        if (!expect) continue;
        ++unseen;
        for (std::int64_t x = 0; x < D; ++x)
          CHECK(g.dk[std::size_t((hk * Lk + j) * D + x)] == 0.0);
      }
    CHECK(unseen == 2 * g.k_shape[1]);
  }
  SECTION("bwd_kv_len_cuts_tile: key lengths inside 32-, 64- and 128-key tiles") {
    const td::fixture fx = load("bwd_kv_len_cuts_tile");
    for (std::int32_t n : fx.in.opt.kv_len)
      for (std::int32_t tile : {32, 64, 128})
        CHECK(n % tile != 0);
  }
  SECTION(
      "bwd_gqa_empty_row_one_head: in one group, one head's q-block row empty, not the other's") {
    const td::fixture fx = load("bwd_gqa_empty_row_one_head");
    CHECK(fx.in.q.shape(1) == 4);
    CHECK(fx.in.k.shape(1) == 2);
    for (std::int64_t i = 8; i < 16; ++i) {
      CHECK(row_empty(fx, 1, i));
      CHECK_FALSE(row_empty(fx, 0, i));
    }
  }
  SECTION("bwd_large_scores: LSE ~1e3 and gradients far from vanishing") {
    const td::fixture fx = load("bwd_large_scores");
    REQUIRE(fx.grads);
    for (double l : fx.golden.lse)
      CHECK((l > 900.0 && l < 1100.0));
    double max_dq = 0;
    for (double x : fx.grads->dq)
      max_dq = std::max(max_dq, std::abs(x));
    CHECK(max_dq > 1e-2);
  }
}

TEST_CASE("every float32 case but the spec cases has a bfloat16 and a float16 twin",
          "[fixtures][twins]") {
  std::set<std::string> names;
  for (const td::case_info& c : td::cases())
    names.insert(c.name);
  std::size_t twins = 0;
  for (const td::case_info& c : td::cases()) {
    const td::fixture base = load(c.name);
    CAPTURE(c.name);
    if (!base.twin_of.empty()) {
      ++twins;
      CHECK(names.count(base.twin_of) == 1);
      continue;
    }
    const bool twinned =
        !is_spec_case(c.name) && base.in.opt.dtype == flashref::input_dtype::float32;
    for (const auto& [suffix, dtype] : {std::pair{"_bf16", flashref::input_dtype::bfloat16},
                                        std::pair{"_fp16", flashref::input_dtype::float16}}) {
      const std::string name = c.name + suffix;
      CAPTURE(name);
      REQUIRE(names.count(name) == std::size_t(twinned));
      if (!twinned) continue;
      const td::fixture twin = load(name);
      CHECK(twin.twin_of == c.name);
      CHECK(twin.seed == base.seed);
      CHECK(twin.in.opt.dtype == dtype);
      CHECK(!twin.trace.has_value());
      // The same problem but for the head dims: masks, lengths, heads, batch.
      const auto& bq = base.in.q.shape();
      const auto& tq = twin.in.q.shape();
      CHECK(tq[0] == bq[0]);
      CHECK(tq[1] == bq[1]);
      CHECK(tq[2] == bq[2]);
      CHECK(twin.in.k.shape(1) == base.in.k.shape(1));
      CHECK(twin.in.k.shape(2) == base.in.k.shape(2));
      const std::size_t D = base.in.q.shape(3), Dv = base.in.v.shape(3);
      const std::size_t want_d = D == Dv ? std::max<std::size_t>(D, 64) : D;
      CHECK(tq[3] == want_d);
      CHECK(twin.in.v.shape(3) == (D == Dv ? want_d : Dv));
      CHECK(twin.in.opt.causal == base.in.opt.causal);
      CHECK(twin.in.opt.window_left == base.in.opt.window_left);
      CHECK(twin.in.opt.window_right == base.in.opt.window_right);
      CHECK(twin.in.opt.block_q == base.in.opt.block_q);
      CHECK(twin.in.opt.block_k == base.in.opt.block_k);
      CHECK((twin.in.opt.block_mask == base.in.opt.block_mask));
      CHECK(twin.in.opt.kv_len == base.in.opt.kv_len);
      // The same rows see no key: the empty-row semantics are judged in half precision too.
      REQUIRE(twin.golden.lse.size() == base.golden.lse.size());
      for (std::size_t r = 0; r < base.golden.lse.size(); ++r)
        CHECK((twin.golden.lse[r] == -INFINITY) == (base.golden.lse[r] == -INFINITY));
      // Golden values of the stored (rounded) inputs, with the half tolerance.
      const flashref::reference::golden g = flashref::reference::naive_attention(twin.in.inputs());
      CHECK(g.o == twin.golden.o);
      CHECK(g.lse == twin.golden.lse);
      CHECK(twin.tol.rtol == flashref::default_tolerance(dtype, 1.0).rtol);
    }
  }
  CHECK(twins == 2 * 23);  // 18 forward cases and the 5 backward traps
}
