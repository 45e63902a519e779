// The scalar tiled reference against the naive float64 reference, across every mask, alone
// and combined, with edge cases first and then random problems.
#include <catch2/catch.hpp>

#include "../common/check.hpp"
#include "flashref/reference/tiled.hpp"

using flashref::causal_mode;
using flashref::test::check_against_naive;
using flashref::test::owned_problem;
using flashref::test::problem_shape;

namespace {

void run_and_check(const problem_shape& s, std::uint64_t seed,
                   flashref::reference::tile_shape tile = {}) {
  CAPTURE(s.describe(), seed, tile.q, tile.k);
  owned_problem op(s, seed);
  op.poison_outputs();
  flashref::reference::tiled_attention(op.p, tile);
  FLASHREF_REQUIRE_CONFORMS(check_against_naive(op));
}

}  // namespace

TEST_CASE("tiled reference: edge cases", "[tiled]") {
  problem_shape s;
  SECTION("zero-sized dimensions are valid") {
    for (auto dims :
         {std::array<std::int64_t, 4>{0, 1, 4, 4}, {1, 0, 4, 4}, {1, 1, 0, 4}, {1, 1, 4, 0}}) {
      s.B = dims[0], s.Hq = dims[1], s.Hk = 1, s.Lq = dims[2], s.Lk = dims[3];
      run_and_check(s, 1);
    }
    s = {};
    s.D = 0;  // scores are all 0: uniform softmax
    run_and_check(s, 1);
    s = {};
    s.Dv = 0;  // O is empty, LSE is still defined
    run_and_check(s, 1);
  }
  SECTION("causal with more queries than keys leaves the top rows empty") {
    s.Lq = 20, s.Lk = 7, s.causal = causal_mode::bottom_right;
    run_and_check(s, 2);
    s.causal = causal_mode::top_left;
    run_and_check(s, 2);
  }
  SECTION("causal with fewer queries than keys") {
    s.Lq = 5, s.Lk = 37, s.causal = GENERATE(causal_mode::bottom_right, causal_mode::top_left);
    run_and_check(s, 3);
  }
  SECTION("kv_len = 0 next to normal entries") {
    s.B = 4, s.Lq = 9, s.Lk = 33, s.use_kv_len = true;
    run_and_check(s, 4);
  }
  SECTION("block masks with sizes that divide nothing, all empty and all full") {
    s.Lq = 50, s.Lk = 70, s.block_q = 7, s.block_k = 9;
    s.block_density = GENERATE(0.0, 0.3, 1.0);
    run_and_check(s, 5, {16, 32});
    run_and_check(s, 5, {3, 5});
  }
  SECTION("broadcast block masks") {
    s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 24, s.Lk = 40, s.block_q = 8, s.block_k = 8;
    s.mask_broadcast_b = GENERATE(false, true);
    s.mask_broadcast_h = GENERATE(false, true);
    run_and_check(s, 6);
  }
  SECTION("local windows, including empty ones") {
    s.Lq = 30, s.Lk = 20;
    s.window_left = GENERATE(-1, 0, 3);
    s.window_right = GENERATE(-1, 0, 2);
    run_and_check(s, 7);
  }
  SECTION("GQA, MQA and Dv != D in the [B, L, H, D] layout") {
    s.B = 2, s.Hq = 8, s.Hk = GENERATE(1, 2, 8), s.Lq = 13, s.Lk = 29, s.D = 7, s.Dv = 5;
    s.blhd = true;
    run_and_check(s, 8);
  }
  SECTION("large score magnitudes") {
    s.Lq = 9, s.Lk = 41, s.D = 16, s.value_scale = 30.0;  // scores ~ 1e3
    run_and_check(s, 9, {4, 8});
  }
}

TEST_CASE("tiled reference: every mask combined", "[tiled]") {
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 37, s.Lk = 53, s.D = 6, s.Dv = 3;
  s.causal = GENERATE(causal_mode::none, causal_mode::bottom_right, causal_mode::top_left);
  s.window_left = GENERATE(-1, 5);
  s.block_q = GENERATE(0, 6);
  s.block_k = s.block_q == 0 ? 0 : 11;
  s.use_kv_len = GENERATE(false, true);
  run_and_check(s, 10, {8, 16});
}

TEST_CASE("tiled reference: random problems", "[tiled]") {
  const std::uint64_t seed = GENERATE(range(0, 60));
  const problem_shape s = flashref::test::random_shape(seed);
  run_and_check(s, seed, {1 + std::int64_t(seed % 17), 1 + std::int64_t((seed * 7) % 33)});
}

TEST_CASE("tiled reference: results do not depend on its tile sizes", "[tiled]") {
  problem_shape s;
  s.B = 1, s.Hq = 2, s.Lq = 41, s.Lk = 67, s.D = 8, s.Dv = 8, s.block_q = 5, s.block_k = 13;
  s.causal = causal_mode::bottom_right;
  owned_problem a(s, 11), b(s, 11);
  flashref::reference::tiled_attention(a.p, {1, 1});
  flashref::reference::tiled_attention(b.p, {64, 64});
  FLASHREF_REQUIRE_OUTPUTS_CLOSE(a, b, 1e-6);
}

TEST_CASE("tiled reference: NaN in one row's input stays in that row", "[tiled]") {
  problem_shape s;
  s.Lq = 6, s.Lk = 10, s.D = 4, s.Dv = 4, s.causal = causal_mode::bottom_right;
  owned_problem op(s, 12);
  op.q[2 * 4 + 1] = NAN;  // query row 2
  flashref::reference::tiled_attention(op.p);
  for (std::int64_t i = 0; i < s.Lq; ++i) {
    CAPTURE(i);
    REQUIRE(std::isnan(op.p.lse(0, 0, i)) == (i == 2));
  }
  // A NaN value row is read only by the queries that see that key.
  owned_problem ov(s, 13);
  ov.v[9 * 4] = NAN;  // key 9: visible only to the last query under causal masking
  flashref::reference::tiled_attention(ov.p);
  for (std::int64_t i = 0; i < s.Lq; ++i)
    REQUIRE(std::isnan(ov.p.o(0, 0, i, 0)) == (i == 5));
}
