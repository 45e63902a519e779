// The CPU backend against the naive float64 reference: edge cases first, then every mask
// combined and random problems, each on every instruction set this processor runs; then the
// determinism contract (bitwise identical on 1, 2, 3 and 7 threads), independence of the tile
// sizes and of the split-KV chunking, NaN isolation and option validation.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../common/check.hpp"
#include "flashref/cpu/attention.hpp"

using flashref::causal_mode;
using flashref::cpu::isa;
using flashref::test::check_against_naive;
using flashref::test::owned_problem;
using flashref::test::problem_shape;

namespace {

flashref::cpu::options with_isa(isa i, std::int64_t tq = 0, std::int64_t tk = 0) {
  flashref::cpu::options opt;
  opt.instruction_set = i;
  opt.tile_q = tq;
  opt.tile_k = tk;
  return opt;
}

// Runs the backend with every supported instruction set (and the given tiles) and checks it.
void run_and_check(const problem_shape& s, std::uint64_t seed, std::int64_t tq = 0,
                   std::int64_t tk = 0, std::int64_t kv_chunk = 0) {
  for (isa i : flashref::cpu::supported_isas()) {
    CAPTURE(s.describe(), seed, flashref::cpu::to_string(i), tq, tk, kv_chunk);
    owned_problem op(s, seed);
    op.poison_outputs();
    flashref::cpu::options opt = with_isa(i, tq, tk);
    opt.kv_chunk = kv_chunk;
    flashref::cpu::attention(op.p, opt);
    FLASHREF_REQUIRE_CONFORMS(check_against_naive(op));
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("cpu: every instruction set the processor runs is available", "[cpu]") {
  const auto all = flashref::cpu::supported_isas();
  REQUIRE(!all.empty());
  REQUIRE(all.front() == isa::portable);
  REQUIRE(flashref::cpu::best_isa() == all.back());
#if defined(__x86_64__)
  __builtin_cpu_init();
  CHECK(flashref::cpu::supported(isa::avx2) ==
        (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")));
  CHECK(flashref::cpu::supported(isa::avx512) ==
        (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")));
#endif
}

TEST_CASE("cpu: edge cases", "[cpu]") {
  problem_shape s;
  SECTION("zero-sized dimensions are valid") {
    for (auto dims :
         {std::array<std::int64_t, 4>{0, 1, 4, 4}, {1, 0, 4, 4}, {1, 1, 0, 4}, {1, 1, 4, 0}}) {
      s.B = dims[0], s.Hq = dims[1], s.Hk = 1, s.Lq = dims[2], s.Lk = dims[3];
      run_and_check(s, 1);
    }
    s = {};
    s.Lq = 40, s.D = 0;  // scores are all 0: uniform softmax
    run_and_check(s, 1);
    s.D = 4, s.Dv = 0;  // O is empty, LSE is still defined
    run_and_check(s, 1);
    s.Lk = 0, s.Dv = 3;  // no keys: every row is empty
    run_and_check(s, 1);
  }
  SECTION("causal with more queries than keys leaves the top rows empty") {
    s.Lq = 150, s.Lk = 70, s.D = 16, s.Dv = 16;
    s.causal = GENERATE(causal_mode::bottom_right, causal_mode::top_left);
    run_and_check(s, 2);
    run_and_check(s, 2, 16, 16);
  }
  SECTION("causal with fewer queries than keys, partial tails") {
    s.Lq = 67, s.Lk = 301, s.D = 24, s.Dv = 24;
    s.causal = GENERATE(causal_mode::bottom_right, causal_mode::top_left);
    run_and_check(s, 3);
  }
  SECTION("kv_len = 0 next to normal entries") {
    s.B = 4, s.Lq = 70, s.Lk = 200, s.D = 8, s.Dv = 8, s.use_kv_len = true;
    run_and_check(s, 4);
    s.Lq = 2;  // the row kernel
    run_and_check(s, 4);
  }
  SECTION("block masks with sizes that divide nothing, all empty and all full") {
    s.Lq = 100, s.Lk = 170, s.D = 12, s.Dv = 12, s.block_q = 24, s.block_k = 40;
    s.block_density = GENERATE(0.0, 0.3, 1.0);
    run_and_check(s, 5);
    run_and_check(s, 5, 16, 48);
    s.block_q = 7, s.block_k = 1;
    run_and_check(s, 5, 20, 33);
    s.block_q = 1000, s.block_k = 3;  // a block larger than the sequence
    run_and_check(s, 5);
  }
  SECTION("broadcast block masks") {
    s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 96, s.Lk = 160, s.D = 8, s.Dv = 8;
    s.block_q = 16, s.block_k = 32;
    s.mask_broadcast_b = GENERATE(false, true);
    s.mask_broadcast_h = GENERATE(false, true);
    run_and_check(s, 6);
  }
  SECTION("local windows, including empty ones") {
    s.Lq = 90, s.Lk = 60, s.D = 8, s.Dv = 8;
    s.window_left = GENERATE(-1, 0, 17);
    s.window_right = GENERATE(-1, 0, 2);
    run_and_check(s, 7);
  }
  SECTION("GQA, MQA and Dv != D in the [B, L, H, D] layout") {
    s.B = 2, s.Hq = 8, s.Hk = GENERATE(1, 2, 8), s.Lq = 45, s.Lk = 131, s.D = 37, s.Dv = 19;
    s.blhd = true;
    run_and_check(s, 8);
    s.Lq = 3;
    run_and_check(s, 8);
  }
  SECTION("large score magnitudes") {
    s.Lq = 40, s.Lk = 90, s.D = 16, s.Dv = 16, s.value_scale = 30.0;  // scores ~ 1e3
    run_and_check(s, 9);
  }
  SECTION("decode: one query against many keys (split-KV)") {
    s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 1, s.Lk = 5000, s.D = 64, s.Dv = 64;
    s.use_kv_len = GENERATE(false, true);
    run_and_check(s, 10);
    s.causal = causal_mode::bottom_right, s.block_q = 1, s.block_k = 128, s.block_density = 0.3;
    run_and_check(s, 10);
  }
}

TEST_CASE("cpu: every mask combined", "[cpu]") {
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 77, s.Lk = 141, s.D = 20, s.Dv = 12;
  s.causal = GENERATE(causal_mode::none, causal_mode::bottom_right, causal_mode::top_left);
  s.window_left = GENERATE(-1, 25);
  s.block_q = GENERATE(0, 6);
  s.block_k = s.block_q == 0 ? 0 : 11;
  s.use_kv_len = GENERATE(false, true);
  run_and_check(s, 20, 32, 32);
}

TEST_CASE("cpu: random problems", "[cpu]") {
  const std::uint64_t seed = GENERATE(range(0, 60));
  const problem_shape s = flashref::test::random_shape(seed);
  // Tiles from 1 row/key upwards, and the defaults.
  const std::int64_t tq = seed % 3 == 0 ? 0 : 1 + std::int64_t(seed % 37);
  const std::int64_t tk = seed % 3 == 0 ? 0 : 1 + std::int64_t((seed * 7) % 70);
  run_and_check(s, seed, tq, tk);
}

TEST_CASE("cpu: split-KV chunks merge to the unsplit result", "[cpu]") {
  problem_shape s;
  s.B = 1, s.Hq = 2, s.Lq = GENERATE(1, 3, 50), s.Lk = 700, s.D = 16, s.Dv = 16;
  s.causal = GENERATE(causal_mode::none, causal_mode::bottom_right);
  s.block_q = 8, s.block_k = 24, s.block_density = 0.4;  // some chunks are empty for some rows
  run_and_check(s, 30, 0, 32, GENERATE(32, 96, 640));
}

TEST_CASE("cpu: bitwise identical on 1, 2, 3 and 7 threads", "[cpu][determinism]") {
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.D = 32, s.Dv = 32, s.block_q = 32, s.block_k = 48;
  s.block_density = 0.6, s.causal = causal_mode::bottom_right;
  s.Lq = GENERATE(1, 300), s.Lk = 3000;  // Lq = 1 takes the split-KV path
  for (isa i : flashref::cpu::supported_isas()) {
    CAPTURE(s.describe(), flashref::cpu::to_string(i));
    std::vector<float> o_first, lse_first;
    for (int threads : {1, 2, 3, 7, 1}) {
      CAPTURE(threads);
      owned_problem op(s, 40);
      op.poison_outputs();
      flashref::cpu::options opt = with_isa(i);
      opt.threads = threads;
      REQUIRE((s.Lq > 1 || flashref::cpu::make_plan(op.p, opt).kv_splits > 1));
      flashref::cpu::attention(op.p, opt);
      if (o_first.empty()) {
        FLASHREF_REQUIRE_CONFORMS(check_against_naive(op));
        o_first = op.o;
        lse_first = op.lse;
      } else {
        REQUIRE(same_bits(op.o, o_first));
        REQUIRE(same_bits(op.lse, lse_first));
      }
    }
  }
}

TEST_CASE("cpu: results do not depend on the tile sizes beyond rounding", "[cpu]") {
  problem_shape s;
  s.B = 1, s.Hq = 2, s.Lq = 141, s.Lk = 267, s.D = 24, s.Dv = 24, s.block_q = 5, s.block_k = 13;
  s.causal = causal_mode::bottom_right;
  const std::int64_t tiles[][2] = {{1, 1}, {5, 7}, {16, 16}, {64, 128}, {200, 300}};
  for (isa i : flashref::cpu::supported_isas()) {
    owned_problem base(s, 50);
    flashref::cpu::attention(base.p, with_isa(i, 32, 64));
    for (const auto& t : tiles) {
      CAPTURE(flashref::cpu::to_string(i), t[0], t[1]);
      owned_problem op(s, 50);
      flashref::cpu::attention(op.p, with_isa(i, t[0], t[1]));
      FLASHREF_REQUIRE_CONFORMS(check_against_naive(op));
      FLASHREF_REQUIRE_OUTPUTS_CLOSE(op, base, 1e-5);
    }
  }
}

TEST_CASE("cpu: NaN in an input reaches only the rows that read it", "[cpu]") {
  problem_shape s;
  s.B = 1, s.Hq = 2, s.Hk = 1, s.Lq = GENERATE(2, 90), s.Lk = 200, s.D = 16, s.Dv = 16;
  s.causal = causal_mode::bottom_right, s.block_q = 8, s.block_k = 16, s.block_density = 0.5;
  const std::string where = GENERATE("q", "k", "v");
  for (isa i : flashref::cpu::supported_isas()) {
    CAPTURE(s.describe(), where, flashref::cpu::to_string(i));
    owned_problem op(s, 60);
    // Query row Lq/2 of head 0, or a key that some rows see and others do not (causal and
    // block mask): with two rows only the last row sees the last key.
    const std::int64_t key = s.Lq > 2 ? 150 : s.Lk - 1;
    if (where == "q") op.q[std::size_t(s.Lq / 2 * s.D + 3)] = NAN;
    if (where == "k") op.k[std::size_t(key * s.D + 5)] = NAN;
    if (where == "v") op.v[std::size_t(key * s.Dv + 7)] = NAN;
    flashref::cpu::attention(op.p, with_isa(i, 32, 32));
    // The golden result marks exactly the rows that read the NaN.
    const flashref::reference::golden g = flashref::reference::naive_attention(op.p);
    std::int64_t poisoned = 0;
    for (std::int64_t row = 0; row < s.Hq * s.Lq; ++row) {
      bool golden_nan = std::isnan(g.lse[std::size_t(row)]);
      bool ours_nan = std::isnan(op.lse[std::size_t(row)]);
      for (std::int64_t d = 0; d < s.Dv; ++d) {
        golden_nan = golden_nan || std::isnan(g.o[std::size_t(row * s.Dv + d)]);
        ours_nan = ours_nan || std::isnan(op.o[std::size_t(row * s.Dv + d)]);
      }
      CAPTURE(row);
      REQUIRE(ours_nan == golden_nan);
      poisoned += golden_nan;
    }
    REQUIRE(poisoned > 0);
    REQUIRE(poisoned < s.Hq * s.Lq);
  }
}

TEST_CASE("cpu: options are validated", "[cpu]") {
  problem_shape s;
  owned_problem op(s, 70);
  flashref::cpu::options opt;
  opt.tile_q = -1;
  REQUIRE_THROWS_WITH(flashref::cpu::attention(op.p, opt),
                      "tile_q: expected 0 (default) .. 4096, got -1");
  opt.tile_q = 0;
  opt.tile_k = 100000;
  REQUIRE_THROWS_WITH(flashref::cpu::attention(op.p, opt),
                      "tile_k: expected 0 (default) .. 4096, got 100000");
  opt = {};
  opt.threads = -2;
  REQUIRE_THROWS_AS(flashref::cpu::attention(op.p, opt), flashref::problem_error);
  REQUIRE_THROWS_WITH(flashref::cpu::parse_isa("sse9"),
                      "isa: expected one of automatic, portable, avx2, avx512, got 'sse9'");
  for (isa i : {isa::portable, isa::avx2, isa::avx512}) {
    if (flashref::cpu::supported(i)) continue;
    opt = {};
    opt.instruction_set = i;
    REQUIRE_THROWS_AS(flashref::cpu::attention(op.p, opt), flashref::problem_error);
  }
  op.p.k.shape[3] = 3;  // the problem itself is validated
  REQUIRE_THROWS_AS(flashref::cpu::attention(op.p), flashref::problem_error);
}

TEST_CASE("cpu: the peak FMA microbenchmark measures something", "[cpu]") {
  for (isa i : flashref::cpu::supported_isas()) {
    const double g = flashref::cpu::peak_fma_gflops(i, 1, 0.01);
    CAPTURE(flashref::cpu::to_string(i), g);
    REQUIRE(g > 0.1);
  }
}
