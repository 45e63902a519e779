// The CPU backward against the naive float64 golden gradients, on every instruction set this
// processor runs: edge cases first (the backward's own traps among them), every mask combined,
// random problems with tiles from 1 upwards; then bitwise identity across thread counts,
// independence of the tile sizes, confinement of a NaN, and validation.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <vector>

#include "../common/backward_check.hpp"
#include "flashref/cpu/attention.hpp"
#include "flashref/cpu/backward.hpp"

using flashref::causal_mode;
using flashref::problem_data;
using flashref::cpu::isa;
using flashref::test::add_upstream_gradient;
using flashref::test::check_backward_against_naive;
using flashref::test::problem_shape;
using flashref::test::random_problem;

namespace {

flashref::cpu::options with_isa(isa i, std::int64_t tq = 0, std::int64_t tk = 0) {
  flashref::cpu::options opt;
  opt.instruction_set = i;
  opt.tile_q = tq;
  opt.tile_k = tk;
  return opt;
}

// The forward then the backward on every supported instruction set, judged against the golden
// gradients (the forward's float32 O and LSE are what the backward starts from, as in use).
void run_and_check(const problem_shape& s, std::uint64_t seed, std::int64_t tq = 0,
                   std::int64_t tk = 0, double score_offset = 0.0) {
  for (isa i : flashref::cpu::supported_isas()) {
    CAPTURE(s.describe(), seed, flashref::cpu::to_string(i), tq, tk, score_offset);
    problem_data d = random_problem(s, seed);
    flashref::test::offset_scores(d, score_offset);
    flashref::cpu::attention(d.problem(), with_isa(i));
    add_upstream_gradient(d, seed);
    flashref::cpu::attention_backward(d.problem(), d.gradients(), with_isa(i, tq, tk));
    FLASHREF_REQUIRE_GRADIENTS_CONFORM(check_backward_against_naive(d));
  }
}

std::vector<float> as_vector(const xt::xtensor<float, 4>& x) {
  return {x.begin(), x.end()};
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("cpu backward: edge cases", "[cpu][backward]") {
  problem_shape s;
  SECTION("zero-sized dimensions are valid") {
    for (auto dims :
         {std::array<std::int64_t, 4>{0, 1, 4, 4}, {1, 0, 4, 4}, {1, 1, 0, 4}, {1, 1, 4, 0}}) {
      s.B = dims[0], s.Hq = dims[1], s.Hk = 1, s.Lq = dims[2], s.Lk = dims[3];
      run_and_check(s, 1);
    }
    s = {};
    s.Lq = 40, s.D = 0;
    run_and_check(s, 1);
    s.D = 4, s.Dv = 0;
    run_and_check(s, 1);
    s.Lk = 0, s.Dv = 3;  // no keys: every row is empty, dQ = 0
    run_and_check(s, 1);
  }
  SECTION("empty rows next to full rows in the same tile") {
    s.Lq = 150, s.Lk = 70, s.D = 16, s.Dv = 16;
    s.causal = GENERATE(causal_mode::bottom_right, causal_mode::top_left);
    run_and_check(s, 2);
    run_and_check(s, 2, 16, 16);
  }
  SECTION("keys no row sees: causal with fewer queries than keys, partial tails") {
    s.Lq = 67, s.Lk = 301, s.D = 24, s.Dv = 24;
    s.causal = GENERATE(causal_mode::bottom_right, causal_mode::top_left);
    run_and_check(s, 3);
  }
  SECTION("kv_len = 0 next to normal entries, kv_len cutting a tile") {
    s.B = 4, s.Lq = 70, s.Lk = 200, s.D = 8, s.Dv = 8, s.use_kv_len = true;
    run_and_check(s, 4);
    run_and_check(s, 4, 32, 48);
    s.Lq = 2;
    run_and_check(s, 4);
  }
  SECTION("block masks with sizes that divide nothing, all empty and all full") {
    s.Lq = 100, s.Lk = 170, s.D = 12, s.Dv = 12, s.block_q = 24, s.block_k = 40;
    s.block_density = GENERATE(0.0, 0.3, 1.0);
    run_and_check(s, 5);
    run_and_check(s, 5, 16, 48);
    s.block_q = 7, s.block_k = 1;
    run_and_check(s, 5, 20, 33);
    s.block_q = 1000, s.block_k = 3;
    run_and_check(s, 5);
  }
  SECTION("GQA with an empty row in one head of a group (head-wise block masks)") {
    s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 96, s.Lk = 160, s.D = 8, s.Dv = 8;
    s.block_q = 16, s.block_k = 32, s.block_density = 0.4;
    s.mask_broadcast_b = GENERATE(false, true);
    s.mask_broadcast_h = GENERATE(false, true);
    run_and_check(s, 6);
  }
  SECTION("local windows, including empty ones") {
    s.Lq = 90, s.Lk = 60, s.D = 8, s.Dv = 8;
    s.window_left = GENERATE(-1, 0, 17);
    s.window_right = GENERATE(-1, 0, 2);
    // (0, 0) leaves each row one key, where dQ = dK = 0 exactly and a float32 backward returns
    // rounding noise no tolerance scaled by max|ref| = 0 admits (see well_conditioned).
    if (s.window_left == 0 && s.window_right == 0) s.window_right = 1;
    run_and_check(s, 7);
  }
  SECTION("GQA, MQA and Dv != D in the [B, L, H, D] layout") {
    s.B = 2, s.Hq = 8, s.Hk = GENERATE(1, 2, 8), s.Lq = 45, s.Lk = 131, s.D = 37, s.Dv = 19;
    s.blhd = true;
    run_and_check(s, 8);
    s.Lq = 3;
    run_and_check(s, 8);
  }
  SECTION("scores of magnitude 1e3: P comes from the stored LSE") {
    s.Lq = 40, s.Lk = 90, s.D = 16, s.Dv = 16;
    run_and_check(s, 9, 0, 0, 1000.0);
    s.causal = causal_mode::bottom_right, s.block_q = 8, s.block_k = 8;
    run_and_check(s, 9, 16, 16, 1000.0);
  }
  SECTION("long keys, few heads: key tiles split into interleaved chunks") {
    s.B = 1, s.Hq = 2, s.Hk = 1, s.Lq = 33, s.Lk = 1500, s.D = 64, s.Dv = 64;
    s.causal = GENERATE(causal_mode::none, causal_mode::top_left);
    run_and_check(s, 10);
  }
}

TEST_CASE("cpu backward: every mask combined", "[cpu][backward]") {
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 77, s.Lk = 141, s.D = 20, s.Dv = 12;
  s.causal = GENERATE(causal_mode::none, causal_mode::bottom_right, causal_mode::top_left);
  s.window_left = GENERATE(-1, 25);
  s.block_q = GENERATE(0, 6);
  s.block_k = s.block_q == 0 ? 0 : 11;
  s.use_kv_len = GENERATE(false, true);
  run_and_check(s, 20, 32, 32);
}

TEST_CASE("cpu backward: random problems", "[cpu][backward]") {
  const std::uint64_t seed = GENERATE(range(0, 60));
  const problem_shape s = flashref::test::well_conditioned(flashref::test::random_shape(seed));
  const std::int64_t tq = seed % 3 == 0 ? 0 : 1 + std::int64_t(seed % 37);
  const std::int64_t tk = seed % 3 == 0 ? 0 : 1 + std::int64_t((seed * 7) % 70);
  run_and_check(s, seed, tq, tk);
}

TEST_CASE("cpu backward: bitwise identical on 1, 2, 3 and 7 threads",
          "[cpu][backward][determinism]") {
  problem_shape s;
  s.B = 1, s.Hq = 4, s.Hk = 2, s.D = 32, s.Dv = 32, s.block_q = 32, s.block_k = 48;
  s.block_density = 0.6, s.causal = causal_mode::bottom_right;
  s.Lq = GENERATE(5, 300), s.Lk = 1000;
  for (isa i : flashref::cpu::supported_isas()) {
    CAPTURE(s.describe(), flashref::cpu::to_string(i));
    problem_data d = random_problem(s, 40);
    flashref::cpu::attention(d.problem(), with_isa(i));
    std::vector<float> dq, dk, dv;
    for (int threads : {1, 2, 3, 7, 1}) {
      CAPTURE(threads);
      add_upstream_gradient(d, 40);
      flashref::cpu::options opt = with_isa(i);
      opt.threads = threads;
      REQUIRE(flashref::cpu::make_backward_plan(d.problem(), opt).chunks >
              1);  // dQ summed over chunks
      flashref::cpu::attention_backward(d.problem(), d.gradients(), opt);
      if (dq.empty()) {
        FLASHREF_REQUIRE_GRADIENTS_CONFORM(check_backward_against_naive(d));
        dq = as_vector(d.dq), dk = as_vector(d.dk), dv = as_vector(d.dv);
      } else {
        REQUIRE(same_bits(as_vector(d.dq), dq));
        REQUIRE(same_bits(as_vector(d.dk), dk));
        REQUIRE(same_bits(as_vector(d.dv), dv));
      }
    }
  }
}

TEST_CASE("cpu backward: results do not depend on the tile sizes beyond rounding",
          "[cpu][backward]") {
  problem_shape s;
  s.B = 1, s.Hq = 2, s.Lq = 141, s.Lk = 267, s.D = 24, s.Dv = 24, s.block_q = 5, s.block_k = 13;
  s.causal = causal_mode::bottom_right;
  problem_data a = random_problem(s, 41);
  flashref::cpu::attention(a.problem());
  add_upstream_gradient(a, 41);
  problem_data b = a;
  flashref::cpu::attention_backward(a.problem(), a.gradients(), with_isa(isa::automatic, 1, 1));
  flashref::cpu::attention_backward(b.problem(), b.gradients(), with_isa(isa::automatic, 128, 96));
  for (std::size_t n = 0; n < a.dq.size(); ++n)
    REQUIRE(a.dq.data()[n] == Approx(b.dq.data()[n]).margin(1e-5));
  for (std::size_t n = 0; n < a.dk.size(); ++n)
    REQUIRE(a.dk.data()[n] == Approx(b.dk.data()[n]).margin(1e-5));
  for (std::size_t n = 0; n < a.dv.size(); ++n)
    REQUIRE(a.dv.data()[n] == Approx(b.dv.data()[n]).margin(1e-5));
}

TEST_CASE("cpu backward: a NaN query row feeds only the keys it sees", "[cpu][backward]") {
  problem_shape s;
  s.Lq = 40, s.Lk = 40, s.D = 8, s.Dv = 8, s.causal = causal_mode::bottom_right;
  for (isa i : flashref::cpu::supported_isas()) {
    CAPTURE(flashref::cpu::to_string(i));
    problem_data d = random_problem(s, 42);
    d.q.data()[5 * 8] = NAN;  // row 5 sees keys 0..5
    flashref::cpu::attention(d.problem(), with_isa(i));
    add_upstream_gradient(d, 42);
    flashref::cpu::attention_backward(d.problem(), d.gradients(), with_isa(i, 16, 16));
    for (std::int64_t j = 0; j < s.Lk; ++j) {
      CAPTURE(j);
      REQUIRE(std::isnan(d.dv.data()[std::size_t(j * 8)]) == (j <= 5));
    }
    for (std::int64_t r = 0; r < s.Lq; ++r) {
      CAPTURE(r);
      // dQ_r = scale Σ_j dS_rj K_j and only row 5's dS is NaN.
      REQUIRE(std::isnan(d.dq.data()[std::size_t(r * 8)]) == (r == 5));
    }
  }
}

TEST_CASE("cpu backward: options and tensors are validated", "[cpu][backward]") {
  problem_shape s;
  problem_data d = random_problem(s, 43);
  flashref::cpu::attention(d.problem());
  add_upstream_gradient(d, 43);
  flashref::attention_gradients g = d.gradients();
  g.dq.shape[3] = 5;
  REQUIRE_THROWS_WITH(flashref::cpu::attention_backward(d.problem(), g),
                      "dq: expected shape [1, 1, 8, 4], got [1, 1, 8, 5]");
  flashref::cpu::options opt;
  opt.tile_q = -1;
  REQUIRE_THROWS_WITH(flashref::cpu::attention_backward(d.problem(), d.gradients(), opt),
                      Catch::Contains("tile_q: expected"));
}
