#include "catalogue.hpp"

#include <catch2/catch.hpp>

#include <array>
#include <cmath>

#include "backward_check.hpp"
#include "check.hpp"
#include "flashref/reference/naive.hpp"

namespace flashref::test {

namespace {

using dims = std::array<std::int64_t, 4>;  // B, Hq, Lq, Lk

class builder {
 public:
  explicit builder(std::vector<catalogue_case>& out) : out_(out) {}
  void add(const std::string& name, const problem_shape& s, std::uint64_t seed,
           bool integer_qk = false, double score_offset = 0.0) {
    out_.push_back({name, s, seed, integer_qk, score_offset, std::nullopt});
  }
  void add_scaled(const std::string& name, const problem_shape& s, std::uint64_t seed,
                  double scale) {
    out_.push_back({name, s, seed, false, 0.0, scale});
  }

 private:
  std::vector<catalogue_case>& out_;
};

// The cases that depend on the head dim run at the tensor-core dims 64 and 128.
void edge_cases_at(builder& add, std::int64_t d) {
  problem_shape s;
  s.D = s.Dv = d;
  for (const dims& z :
       {dims{0, 1, 4, 4}, dims{1, 0, 4, 4}, dims{1, 1, 0, 4}, dims{1, 1, 4, 0}, dims{1, 1, 1, 0}}) {
    problem_shape t = s;
    t.B = z[0], t.Hq = z[1], t.Lq = z[2], t.Lk = z[3];
    add.add("zero-sized dimension", t, 1);
  }
  for (std::int64_t lq : {1, 31, 64, 65, 129})
    for (std::int64_t lk : {1, 33, 64, 127, 200, 257}) {
      problem_shape t = s;
      t.Lq = lq, t.Lk = lk;
      add.add("lengths around the tile sizes", t, 2);
    }
  for (causal_mode c : {causal_mode::bottom_right, causal_mode::top_left})
    for (auto [lq, lk] : {std::pair<std::int64_t, std::int64_t>{200, 70}, {70, 200}, {150, 150}}) {
      problem_shape t = s;
      t.causal = c, t.Lq = lq, t.Lk = lk;
      add.add("causal, more and fewer queries than keys", t, 3);
    }
  for (std::int64_t left : {0, 5, 40, -1})
    for (std::int64_t right : {0, 17, -1}) {
      problem_shape t = s;
      t.Lq = 160, t.Lk = 90, t.window_left = left, t.window_right = right;
      add.add("local window, some rows with an empty window", t, 4);
    }
  {
    problem_shape t = s;
    t.B = 4, t.Lq = 70, t.Lk = 150, t.use_kv_len = true;
    add.add("kv_len = 0 next to normal entries", t, 5);
  }
  for (double density : {0.0, 0.2, 0.6, 1.0})
    for (auto [bq, bk] : {std::pair<std::int64_t, std::int64_t>{128, 128},
                          {24, 40},
                          {1, 7},
                          {64, 64},
                          {300, 300}}) {
      problem_shape t = s;
      t.Lq = 200, t.Lk = 260, t.block_q = bq, t.block_k = bk, t.block_density = density;
      add.add("block mask: empty, sparse, full; sizes that divide nothing", t, 6);
    }
  for (bool bcast_h : {false, true}) {
    problem_shape t = s;
    t.B = 2, t.Hq = 4, t.Hk = 2, t.Lq = 130, t.Lk = 190, t.block_q = 32, t.block_k = 48;
    t.block_density = 0.4, t.mask_broadcast_b = true, t.mask_broadcast_h = bcast_h;
    t.causal = causal_mode::bottom_right, t.use_kv_len = true;
    add.add("broadcast block mask with causal and kv_len", t, 7);
  }
  for (std::int64_t hk : {2, 1}) {
    problem_shape t = s;
    t.Hq = 8, t.Hk = hk, t.Lq = 70, t.Lk = 100;
    add.add("GQA and MQA", t, 8);
  }
  {
    problem_shape t = s;
    t.B = 2, t.Hq = 4, t.Hk = 2, t.Lq = 90, t.Lk = 130, t.blhd = true;
    t.causal = causal_mode::top_left;
    add.add("[B, L, H, D] layout", t, 9);
  }
  {
    problem_shape t = s;
    t.Lq = 70, t.Lk = 150, t.value_scale = 24.0;
    add.add("extreme scores: exp overflows without the max subtraction", t, 10,
            /*integer_qk=*/true);
  }
  for (bool kv : {false, true}) {
    problem_shape t = s;
    t.B = 2, t.Hq = 4, t.Hk = 2, t.Lq = 1, t.Lk = 3000, t.use_kv_len = kv;
    add.add("decode: one query against many keys", t, 11);
  }
  {
    problem_shape t = s;
    t.B = 2, t.Hq = 4, t.Hk = 2, t.Lq = 1, t.Lk = 3000, t.causal = causal_mode::bottom_right;
    t.block_q = 1, t.block_k = 128, t.block_density = 0.3;
    add.add("decode with a block mask", t, 11);
  }
  {
    problem_shape t = s;
    t.B = 2, t.Hq = 4, t.Hk = 2, t.Lq = 3, t.Lk = 700, t.causal = causal_mode::bottom_right;
    t.block_q = 8, t.block_k = 24, t.block_density = 0.4;
    add.add("a few queries, many keys, some key chunks empty for some rows", t, 12);
  }
  for (double scale : {0.0, -0.125, -1.0}) {
    // Several key tiles, full ones and partial ones on both sides (causal and a window).
    problem_shape t = s;
    t.Hq = 2, t.Hk = 1, t.Lq = 200, t.Lk = 300, t.causal = causal_mode::bottom_right;
    t.window_left = 150;
    add.add_scaled("softmax scale 0 (uniform over the visible keys) or negative", t, 16, scale);
  }
}

}  // namespace

std::vector<catalogue_case> edge_cases() {
  std::vector<catalogue_case> out;
  builder add(out);
  {  // Head-dim corner cases first: they are cheap and break the most.
    problem_shape s;
    s.Lq = 40, s.D = 0;
    add.add("D = 0: every score is 0, a uniform softmax", s, 1);
    s = {};
    s.Dv = 0;
    add.add("Dv = 0: O is empty, LSE is still defined", s, 1);
    s = {};
    s.Lk = 0, s.Dv = 3;
    add.add("no keys: every row is empty", s, 1);
  }
  edge_cases_at(add, 64);
  edge_cases_at(add, 128);
  for (auto [d, dv] : {std::pair<std::int64_t, std::int64_t>{1, 1},
                       {16, 16},
                       {40, 40},
                       {256, 256},
                       {24, 40},
                       {64, 128},
                       {96, 3}}) {
    problem_shape s;
    s.D = d, s.Dv = dv, s.Lq = 70, s.Lk = 90, s.causal = causal_mode::bottom_right;
    add.add("head dims outside the tensor-core set", s, 13);
    s.Lq = 150, s.Lk = 70, s.block_q = 24, s.block_k = 40, s.block_density = 0.5;
    add.add("head dims outside the tensor-core set, block mask", s, 13);
  }
  for (std::int64_t hk : {1, 2, 8}) {
    problem_shape s;
    s.B = 2, s.Hq = 8, s.Hk = hk, s.Lq = 45, s.Lk = 131, s.D = 37, s.Dv = 19, s.blhd = true;
    add.add("GQA, MQA and Dv != D in the [B, L, H, D] layout", s, 14);
  }
  {
    problem_shape s;
    s.Lq = 40, s.Lk = 90, s.D = 16, s.Dv = 16, s.value_scale = 30.0;  // scores ~ 1e3
    add.add("large score magnitudes, not integer", s, 15);
  }
  return out;
}

std::vector<catalogue_case> combined_masks() {
  std::vector<catalogue_case> out;
  builder add(out);
  for (causal_mode c : {causal_mode::none, causal_mode::bottom_right, causal_mode::top_left})
    for (std::int64_t left : {-1, 25})
      for (std::int64_t bq : {0, 6})
        for (bool kv : {false, true}) {
          problem_shape s;
          s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 77, s.Lk = 141, s.D = 64, s.Dv = 64;
          s.causal = c, s.window_left = left, s.block_q = bq, s.block_k = bq == 0 ? 0 : 11;
          s.use_kv_len = kv;
          add.add("every mask combined", s, 20);
        }
  return out;
}

std::vector<catalogue_case> random_cases(std::uint64_t first_seed, int count) {
  std::vector<catalogue_case> out;
  for (int n = 0; n < count; ++n) {
    const std::uint64_t seed = first_seed + std::uint64_t(n);
    out.push_back({"random problem", random_shape(seed), seed});
  }
  return out;
}

problem_data build(const catalogue_case& c, input_dtype dtype) {
  problem_data d = random_problem(c.shape, c.seed);
  if (c.scale) d.opt.scale = *c.scale;
  if (c.integer_qk) {
    for (auto* x : {&d.q, &d.k})
      for (float& e : *x)
        e = std::nearbyint(e);
    d.opt.scale = 1.0;
  }
  round_inputs(d, dtype);
  return d;
}

void check_case(const catalogue_case& c, input_dtype dtype, const runner& run) {
  CAPTURE(c.name, c.shape.describe(), c.seed, c.integer_qk, to_string(dtype));
  problem_data d = build(c, dtype);
  run(d.problem());
  FLASHREF_REQUIRE_CONFORMS(check_against_naive(d, dtype));
}

void check_nan_isolation(input_dtype dtype, const runner& run) {
  for (std::int64_t lq : {2, 90})
    for (const char* where : {"q", "k", "v"}) {
      problem_shape s;
      s.Hq = 2, s.Hk = 1, s.Lq = lq, s.Lk = 200, s.D = 64, s.Dv = 64;
      s.causal = causal_mode::bottom_right, s.block_q = 8, s.block_k = 16, s.block_density = 0.5;
      CAPTURE(s.describe(), where, to_string(dtype));
      problem_data d = random_problem(s, 60);
      round_inputs(d, dtype);
      // Query row Lq/2 of head 0, or a key that some rows see and others do not (causal and
      // block mask): with two rows only the last row sees the last key.
      const std::size_t key = s.Lq > 2 ? 150 : std::size_t(s.Lk - 1);
      if (where[0] == 'q') d.q(0, 0, std::size_t(s.Lq / 2), 3) = NAN;
      if (where[0] == 'k') d.k(0, 0, key, 5) = NAN;
      if (where[0] == 'v') d.v(0, 0, key, 7) = NAN;
      run(d.problem());
      // The golden result marks exactly the rows that read the NaN.
      const reference::golden g = reference::naive_attention(d.inputs());
      std::vector<float> o, lse;
      gather_outputs(d, o, lse);
      std::int64_t poisoned = 0;
      for (std::int64_t row = 0; row < s.Hq * s.Lq; ++row) {
        bool golden_nan = std::isnan(g.lse[std::size_t(row)]);
        bool ours_nan = std::isnan(lse[std::size_t(row)]);
        for (std::int64_t x = 0; x < s.Dv; ++x) {
          golden_nan = golden_nan || std::isnan(g.o[std::size_t(row * s.Dv + x)]);
          ours_nan = ours_nan || std::isnan(o[std::size_t(row * s.Dv + x)]);
        }
        CAPTURE(row);
        REQUIRE(ours_nan == golden_nan);
        poisoned += golden_nan;
      }
      REQUIRE(poisoned > 0);
      REQUIRE(poisoned < s.Hq * s.Lq);
    }
}

std::vector<catalogue_case> backward_edge_cases() {
  std::vector<catalogue_case> out;
  builder add(out);
  problem_shape s;
  for (const dims& z : {dims{0, 1, 4, 4}, dims{1, 0, 4, 4}, dims{1, 1, 0, 4}, dims{1, 1, 4, 0}}) {
    s = {};
    s.B = z[0], s.Hq = z[1], s.Lq = z[2], s.Lk = z[3];
    add.add("backward: zero-sized dimension", s, 1);
  }
  for (std::int64_t lq : {8, 40}) {
    s = {};
    s.Lq = lq, s.D = 0;
    add.add("backward: D = 0", s, 1);
    s.D = 4, s.Dv = 0;
    add.add("backward: Dv = 0", s, 1);
  }
  s = {};
  s.Lq = 40, s.Lk = 0, s.Dv = 3;
  add.add("backward: no keys, every row empty, dQ = 0", s, 1);
  for (causal_mode c : {causal_mode::bottom_right, causal_mode::top_left}) {
    s = {};
    s.Lq = 20, s.Lk = 7, s.causal = c;
    add.add("backward: causal, empty rows next to full rows in one tile", s, 2);
    s.Lq = 150, s.Lk = 70, s.D = s.Dv = 16;
    add.add("backward: causal, empty rows next to full rows in one tile", s, 2);
    s = {};
    s.Lq = 5, s.Lk = 37, s.causal = c;
    add.add("backward: causal, keys no row sees", s, 3);
    s.Lq = 67, s.Lk = 301, s.D = s.Dv = 24;
    add.add("backward: causal, keys no row sees, partial tails", s, 3);
  }
  s = {};
  s.D = s.Dv = 64;
  s.Lq = 100, s.Lk = 37, s.causal = causal_mode::bottom_right;
  add.add("backward: empty rows next to full rows in one tile", s, 30);
  s = {};
  s.D = s.Dv = 64;
  s.Lq = 20, s.Lk = 200, s.causal = causal_mode::top_left;
  add.add("backward: keys visible to no row", s, 31);
  for (auto [lq, lk, d] : {std::array<std::int64_t, 3>{9, 33, 4}, {70, 200, 8}, {2, 200, 8}}) {
    s = {};
    s.B = 4, s.Lq = lq, s.Lk = lk, s.D = s.Dv = d, s.use_kv_len = true;
    add.add("backward: kv_len = 0 next to normal entries, kv_len cutting a tile", s, 4);
  }
  s = {};
  s.D = s.Dv = 64;
  s.B = 3, s.Lq = 50, s.Lk = 150, s.use_kv_len = true;
  add.add("backward: kv_len cutting a tile", s, 32);
  for (double density : {0.0, 0.3, 1.0}) {
    s = {};
    s.Lq = 50, s.Lk = 70, s.block_q = 7, s.block_k = 9, s.block_density = density;
    add.add("backward: block mask, sizes that divide nothing, empty to full", s, 5);
    s.Lq = 100, s.Lk = 170, s.D = s.Dv = 12, s.block_q = 24, s.block_k = 40;
    add.add("backward: block mask, sizes that divide nothing, empty to full", s, 5);
    s.block_q = 7, s.block_k = 1;
    add.add("backward: block mask, sizes that divide nothing, empty to full", s, 5);
    s.block_q = 1000, s.block_k = 3;
    add.add("backward: block mask, sizes that divide nothing, empty to full", s, 5);
  }
  for (bool bcast_b : {false, true})
    for (bool bcast_h : {false, true}) {
      s = {};
      s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 24, s.Lk = 40, s.block_q = 8, s.block_k = 8;
      s.mask_broadcast_b = bcast_b, s.mask_broadcast_h = bcast_h;
      add.add("backward: broadcast block masks, GQA with an empty row in one head of a group", s,
              6);
      s.Lq = 96, s.Lk = 160, s.D = s.Dv = 8, s.block_q = 16, s.block_k = 32;
      s.block_density = 0.4;
      add.add("backward: broadcast block masks, GQA with an empty row in one head of a group", s,
              6);
    }
  s = {};
  s.D = s.Dv = 64;
  s.Hq = 4, s.Hk = 2, s.Lq = 64, s.Lk = 96, s.block_q = 16, s.block_k = 16;
  s.block_density = 0.35;  // head-wise masks: some rows of one head of a group see nothing
  add.add("backward: GQA with an empty row in one head of a group", s, 33);
  for (std::int64_t left : {-1, 0, 3, 17})
    for (std::int64_t right : {-1, 0, 2}) {
      // (0, 0) leaves each row one key, where dQ = dK = 0 exactly and a float32 backward
      // returns rounding noise no tolerance scaled by max|ref| = 0 admits (well_conditioned).
      s = {};
      s.window_left = left, s.window_right = left == 0 && right == 0 ? 1 : right;
      s.Lq = 30, s.Lk = 20;
      add.add("backward: local windows, including empty ones", s, 7);
      s.Lq = 90, s.Lk = 60, s.D = s.Dv = 8;
      add.add("backward: local windows, including empty ones", s, 7);
    }
  for (std::int64_t hk : {1, 2, 8})
    for (auto [lq, lk, d, dv] :
         {std::array<std::int64_t, 4>{13, 29, 7, 5}, {45, 131, 37, 19}, {3, 131, 37, 19}}) {
      s = {};
      s.B = 2, s.Hq = 8, s.Hk = hk, s.Lq = lq, s.Lk = lk, s.D = d, s.Dv = dv, s.blhd = true;
      add.add("backward: GQA, MQA and Dv != D in the [B, L, H, D] layout", s, 8);
    }
  for (auto [lq, lk, d, dv] : {std::array<std::int64_t, 4>{9, 41, 16, 4}, {40, 90, 16, 16}}) {
    s = {};
    s.Lq = lq, s.Lk = lk, s.D = d, s.Dv = dv;
    add.add("backward: scores of magnitude 1e3, P comes from the stored LSE", s, 9,
            /*integer_qk=*/false, /*score_offset=*/1000.0);
    s.causal = causal_mode::bottom_right, s.Lq = lq == 9 ? 50 : lq, s.block_q = 8, s.block_k = 8;
    add.add("backward: scores of magnitude 1e3, causal and block mask", s, 9,
            /*integer_qk=*/false, /*score_offset=*/1000.0);
  }
  for (causal_mode c : {causal_mode::none, causal_mode::top_left}) {
    s = {};
    s.Hq = 2, s.Lq = 33, s.Lk = 1500, s.D = s.Dv = 64, s.causal = c;
    add.add("backward: long keys, few heads: key tiles split into chunks", s, 10);
  }
  // Every mask combined at small and odd head dims (combined_masks has them at 64).
  for (auto [lq, lk, d, dv, left, seed] :
       {std::array<std::int64_t, 6>{37, 53, 6, 3, 5, 10}, {77, 141, 20, 12, 25, 20}})
    for (causal_mode c : {causal_mode::none, causal_mode::bottom_right, causal_mode::top_left})
      for (std::int64_t l : {std::int64_t(-1), left})
        for (std::int64_t bq : {0, 6})
          for (bool kv : {false, true}) {
            s = {};
            s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = lq, s.Lk = lk, s.D = d, s.Dv = dv;
            s.causal = c, s.window_left = l, s.block_q = bq, s.block_k = bq == 0 ? 0 : 11;
            s.use_kv_len = kv;
            add.add("backward: every mask combined, small head dims", s, std::uint64_t(seed));
          }
  return out;
}

catalogue_case for_backward(catalogue_case c) {
  // Large scores come from large |Q|, |K|, and a float32 score of magnitude S carries an
  // error of ~S · 6e-8 that dQ, dK multiply by |K|, |Q|: beyond SPEC §9's rule for any
  // float32 backward (docs/semantics.md, section 8). They run at unit scale here; the
  // backward's large-score trap is score_offset (backward_edge_cases) and the bwd_large_scores
  // fixture.
  c.integer_qk = false;
  c.shape = well_conditioned(c.shape);
  if (c.shape.window_left == 0 && c.shape.window_right == 0) c.shape.window_right = 1;
  return c;
}

std::vector<catalogue_case> backward_cases() {
  std::vector<catalogue_case> out = backward_edge_cases();
  for (auto part : {edge_cases(), combined_masks(), random_cases(0, 61)})
    for (const catalogue_case& c : part)
      out.push_back(for_backward(c));
  return out;
}

void check_backward_case(const catalogue_case& c, const std::vector<backward_variant>& variants) {
  CAPTURE(c.name, c.shape.describe(), c.seed, c.score_offset);
  problem_data inputs = build(c, input_dtype::float32);
  offset_scores(inputs, c.score_offset);
  add_upstream_gradient(inputs, c.seed);  // dO; O, LSE and the gradients poisoned
  const reference::golden_gradients gold = golden_gradients_of(inputs);
  for (const backward_variant& v : variants) {
    CAPTURE(v.name);
    problem_data d = inputs;
    v.forward(d.problem());
    v.backward(d.problem(), d.gradients());
    FLASHREF_REQUIRE_GRADIENTS_CONFORM(compare_gradients(d, gold));
  }
}

void check_backward_case(const catalogue_case& c, const runner& forward,
                         const backward_runner& backward) {
  check_backward_case(c, {{"", forward, backward}});
}

}  // namespace flashref::test
