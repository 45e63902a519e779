// The CPU backward against the naive float64 golden gradients, on every instruction set this
// processor runs: the backward catalogue's edge cases (tests/common/catalogue.hpp, every mask
// alone and combined) at several tiles, random problems with tiles from 1 upwards; then bitwise
// identity across thread counts, independence of the tile sizes, confinement of a NaN, and
// validation.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "../common/backward_check.hpp"
#include "../common/catalogue.hpp"
#include "cpu_test.hpp"
#include "flashref/cpu/attention.hpp"
#include "flashref/cpu/backward.hpp"

using flashref::causal_mode;
using flashref::problem_data;
using flashref::cpu::isa;
using flashref::test::add_upstream_gradient;
using flashref::test::catalogue_case;
using flashref::test::check_backward_against_naive;
using flashref::test::problem_shape;
using flashref::test::random_problem;
using flashref::test::same_bits;
using flashref::test::with_isa;

namespace {

// The forward, then the backward from its float32 O and LSE (as in use), on one instruction set.
flashref::test::runner cpu_forward(isa i) {
  return [i](const flashref::attention_problem& p) { flashref::cpu::attention(p, with_isa(i)); };
}

flashref::test::backward_runner cpu_backward(isa i, std::int64_t tq, std::int64_t tk) {
  return [=](const flashref::attention_problem& p, const flashref::attention_gradients& g) {
    flashref::cpu::attention_backward(p, g, with_isa(i, tq, tk));
  };
}

std::vector<float> as_vector(const xt::xtensor<float, 4>& x) {
  return {x.begin(), x.end()};
}

}  // namespace

TEST_CASE("cpu backward: the backward catalogue's edge cases on every instruction set",
          "[cpu][backward]") {
  // The defaults, and tiles that leave partial tails and straddle the cases' mask blocks.
  std::vector<flashref::test::backward_variant> variants;
  for (isa i : flashref::cpu::supported_isas())
    for (auto [tq, tk] : {std::pair<std::int64_t, std::int64_t>{0, 0},
                          {16, 16},
                          {32, 32},
                          {32, 48},
                          {16, 48},
                          {20, 33}}) {
      variants.push_back({std::string(flashref::cpu::to_string(i)) + ", tiles " +
                              std::to_string(tq) + " x " + std::to_string(tk),
                          cpu_forward(i), cpu_backward(i, tq, tk)});
    }
  for (const catalogue_case& c : flashref::test::backward_edge_cases())
    flashref::test::check_backward_case(c, variants);
}

TEST_CASE("cpu backward: random problems on every instruction set at random tiles",
          "[cpu][backward]") {
  for (const catalogue_case& c : flashref::test::random_cases(0, 60)) {
    // Tiles from 1 row/key upwards, and the defaults.
    const std::int64_t tq = c.seed % 3 == 0 ? 0 : 1 + std::int64_t(c.seed % 37);
    const std::int64_t tk = c.seed % 3 == 0 ? 0 : 1 + std::int64_t((c.seed * 7) % 70);
    CAPTURE(tq, tk);
    std::vector<flashref::test::backward_variant> variants;
    for (isa i : flashref::cpu::supported_isas())
      variants.push_back({flashref::cpu::to_string(i), cpu_forward(i), cpu_backward(i, tq, tk)});
    flashref::test::check_backward_case(flashref::test::for_backward(c), variants);
  }
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

TEST_CASE("cpu backward: any number of key-tile chunks, each bitwise on any thread count",
          "[cpu][backward][determinism]") {
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 150, s.Lk = 333, s.D = 40, s.Dv = 24, s.block_q = 16;
  s.block_k = 24, s.block_density = 0.5, s.causal = causal_mode::bottom_right;
  problem_data d = random_problem(s, 44);
  flashref::cpu::attention(d.problem());
  add_upstream_gradient(d, 44);
  const std::int64_t key_tiles = (s.Lk + 15) / 16;
  std::vector<float> first_dq, first_dk, first_dv;
  for (std::int64_t chunks : {1, 2, 5, 8, 1000}) {
    CAPTURE(chunks);
    flashref::cpu::options opt = with_isa(isa::automatic, 16, 16);
    opt.backward_chunks = chunks;
    REQUIRE(flashref::cpu::make_backward_plan(d.problem(), opt).chunks ==
            std::min(chunks, key_tiles));
    std::vector<float> dq;
    for (int threads : {1, 3}) {
      opt.threads = threads;
      flashref::cpu::attention_backward(d.problem(), d.gradients(), opt);
      FLASHREF_REQUIRE_GRADIENTS_CONFORM(check_backward_against_naive(d));
      if (dq.empty())
        dq = as_vector(d.dq);
      else
        REQUIRE(same_bits(as_vector(d.dq), dq));
    }
    // dK and dV never depend on the chunks (each key tile is one item's); dQ's sum order does.
    if (first_dq.empty()) first_dq = dq, first_dk = as_vector(d.dk), first_dv = as_vector(d.dv);
    REQUIRE(same_bits(as_vector(d.dk), first_dk));
    REQUIRE(same_bits(as_vector(d.dv), first_dv));
    for (std::size_t n = 0; n < dq.size(); ++n)
      REQUIRE(dq[n] == Approx(first_dq[n]).margin(1e-5));
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
  opt.tile_q = 0;
  opt.backward_chunks = -2;
  REQUIRE_THROWS_WITH(flashref::cpu::attention_backward(d.problem(), d.gradients(), opt),
                      "backward_chunks: expected >= 0 (0 = automatic), got -2");
}
