// The CPU backend's own tests: the conformance catalogue on every instruction set this
// processor runs and at tile sizes of its own (the suite in tests/conformance runs it through
// backend::cpu), the determinism contract (bitwise identical on 1, 2, 3 and 7 threads),
// independence of the tile sizes and of the split-KV chunking, and option validation.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../common/catalogue.hpp"
#include "../common/check.hpp"
#include "flashref/cpu/attention.hpp"

using flashref::causal_mode;
using flashref::cpu::isa;
using flashref::test::catalogue_case;
using flashref::test::check_against_naive;
using flashref::test::problem_shape;

namespace {

flashref::cpu::options with_isa(isa i, std::int64_t tq = 0, std::int64_t tk = 0) {
  flashref::cpu::options opt;
  opt.instruction_set = i;
  opt.tile_q = tq;
  opt.tile_k = tk;
  return opt;
}

// Runs the backend with every supported instruction set (and the given tiles, split-KV chunk)
// and checks it.
void run_and_check(const problem_shape& s, std::uint64_t seed, std::int64_t tq = 0,
                   std::int64_t tk = 0, std::int64_t kv_chunk = 0) {
  for (isa i : flashref::cpu::supported_isas()) {
    CAPTURE(s.describe(), seed, flashref::cpu::to_string(i), tq, tk, kv_chunk);
    flashref::problem_data d = flashref::test::random_problem(s, seed);
    flashref::cpu::options opt = with_isa(i, tq, tk);
    opt.kv_chunk = kv_chunk;
    flashref::cpu::attention(d.problem(), opt);
    FLASHREF_REQUIRE_CONFORMS(check_against_naive(d));
  }
}

template <class X>
bool same_bits(const X& a, const X& b) {
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

TEST_CASE("cpu: the catalogue on every instruction set, at the default and odd tiles", "[cpu]") {
  // The conformance suite runs the catalogue through backend::cpu (the best instruction set);
  // here every instruction set the processor runs, and tiles that leave partial tails.
  using tiles = std::pair<std::int64_t, std::int64_t>;
  const tiles t = GENERATE(tiles{0, 0}, tiles{16, 48}, tiles{20, 33});
  for (isa i : flashref::cpu::supported_isas()) {
    CAPTURE(flashref::cpu::to_string(i), t.first, t.second);
    const flashref::test::runner run = [&](const flashref::attention_problem& p) {
      flashref::cpu::attention(p, with_isa(i, t.first, t.second));
    };
    for (const catalogue_case& c : flashref::test::edge_cases())
      flashref::test::check_case(c, flashref::input_dtype::float32, run);
    for (const catalogue_case& c : flashref::test::combined_masks())
      flashref::test::check_case(c, flashref::input_dtype::float32, run);
  }
}

TEST_CASE("cpu: random problems on every instruction set at random tiles", "[cpu]") {
  for (const catalogue_case& c : flashref::test::random_cases(1, 60)) {
    // Tiles from 1 row/key upwards, and the defaults.
    const std::int64_t tq = c.seed % 3 == 0 ? 0 : 1 + std::int64_t(c.seed % 37);
    const std::int64_t tk = c.seed % 3 == 0 ? 0 : 1 + std::int64_t((c.seed * 7) % 70);
    for (isa i : flashref::cpu::supported_isas()) {
      CAPTURE(flashref::cpu::to_string(i), tq, tk);
      flashref::test::check_case(c, flashref::input_dtype::float32,
                                 [&](const flashref::attention_problem& p) {
                                   flashref::cpu::attention(p, with_isa(i, tq, tk));
                                 });
    }
  }
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
    flashref::attention_outputs first;
    for (int threads : {1, 2, 3, 7, 1}) {
      CAPTURE(threads);
      flashref::problem_data d = flashref::test::random_problem(s, 40);
      flashref::cpu::options opt = with_isa(i);
      opt.threads = threads;
      const flashref::attention_problem p = d.problem();
      REQUIRE((s.Lq > 1 || flashref::cpu::make_plan(p, opt).kv_splits > 1));
      flashref::cpu::attention(p, opt);
      if (first.o.size() == 0) {
        FLASHREF_REQUIRE_CONFORMS(check_against_naive(d));
        first = d;
      } else {
        REQUIRE(same_bits(d.o, first.o));
        REQUIRE(same_bits(d.lse, first.lse));
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
    flashref::problem_data base = flashref::test::random_problem(s, 50);
    flashref::cpu::attention(base.problem(), with_isa(i, 32, 64));
    for (const auto& t : tiles) {
      CAPTURE(flashref::cpu::to_string(i), t[0], t[1]);
      flashref::problem_data d = flashref::test::random_problem(s, 50);
      flashref::cpu::attention(d.problem(), with_isa(i, t[0], t[1]));
      FLASHREF_REQUIRE_CONFORMS(check_against_naive(d));
      FLASHREF_REQUIRE_OUTPUTS_CLOSE(d, base, 1e-5);
    }
  }
}

TEST_CASE("cpu: options are validated", "[cpu]") {
  problem_shape s;
  flashref::problem_data d = flashref::test::random_problem(s, 70);
  flashref::attention_problem p = d.problem();
  flashref::cpu::options opt;
  opt.tile_q = -1;
  REQUIRE_THROWS_WITH(flashref::cpu::attention(p, opt),
                      "tile_q: expected 0 (default) .. 4096, got -1");
  opt.tile_q = 0;
  opt.tile_k = 100000;
  REQUIRE_THROWS_WITH(flashref::cpu::attention(p, opt),
                      "tile_k: expected 0 (default) .. 4096, got 100000");
  opt = {};
  opt.threads = -2;
  REQUIRE_THROWS_AS(flashref::cpu::attention(p, opt), flashref::problem_error);
  REQUIRE_THROWS_WITH(flashref::cpu::parse_isa("sse9"),
                      "isa: expected one of automatic, portable, avx2, avx512, got 'sse9'");
  for (isa i : {isa::portable, isa::avx2, isa::avx512}) {
    if (flashref::cpu::supported(i)) continue;
    opt = {};
    opt.instruction_set = i;
    REQUIRE_THROWS_AS(flashref::cpu::attention(p, opt), flashref::problem_error);
  }
  p.k.shape[3] = 3;  // the problem itself is validated
  REQUIRE_THROWS_AS(flashref::cpu::attention(p), flashref::problem_error);
}

// A split-KV chunk near 2^63 overflowed while being rounded up to whole tiles (the same
// ceil_div that fuzzing caught in validate()). A chunk beyond the keys is no split at all.
TEST_CASE("cpu: a kv_chunk of any size plans without overflow", "[cpu]") {
  problem_shape s;
  s.Lk = 3000;
  flashref::problem_data d = flashref::test::random_problem(s, 71);
  for (const std::int64_t chunk :
       {std::int64_t(3000), std::int64_t(1) << 40, std::numeric_limits<std::int64_t>::max()}) {
    flashref::cpu::options opt;
    opt.kv_chunk = chunk;
    const flashref::cpu::plan pl = flashref::cpu::make_plan(d.problem(), opt);
    CAPTURE(chunk);
    CHECK(pl.kv_splits == 1);
    CHECK(pl.kv_chunk == 3000);
  }
}

TEST_CASE("cpu: the peak FMA microbenchmark measures something", "[cpu]") {
  for (isa i : flashref::cpu::supported_isas()) {
    const double g = flashref::cpu::peak_fma_gflops(i, 1, 0.01);
    CAPTURE(flashref::cpu::to_string(i), g);
    REQUIRE(g > 0.1);
  }
}

// Found by fuzzing (fuzz_validate): a window as wide as 2^63 - 1 overflowed the visibility
// arithmetic (i + (Lk - Lq) - window_left) in the naive reference, and the same sum in the
// row intervals every tiled path shares (mask_spec::row_range). Such a window hides nothing.
TEST_CASE("cpu and reference: windows as wide as 2^63 - 1 equal no window", "[cpu]") {
  constexpr std::int64_t kWide = std::numeric_limits<std::int64_t>::max();
  for (const causal_mode causal : {causal_mode::none, causal_mode::bottom_right}) {
    problem_shape s;
    s.Lq = 37, s.Lk = 21, s.causal = causal;
    flashref::problem_data plain = flashref::test::random_problem(s, 72);
    flashref::problem_data wide = plain;
    wide.opt.window_left = wide.opt.window_right = kWide;
    CAPTURE(flashref::to_string(causal));
    flashref::cpu::attention(plain.problem());
    flashref::cpu::attention(wide.problem());
    const bool same_o = plain.o == wide.o;
    CHECK(same_o);
    FLASHREF_REQUIRE_CONFORMS(check_against_naive(wide));
    const auto g_plain = flashref::reference::naive_attention(plain.inputs());
    const auto g_wide = flashref::reference::naive_attention(wide.inputs());
    CHECK(g_plain.lse == g_wide.lse);
    // One side wide, the other narrow: the narrow side still applies.
    wide.opt.window_right = 0;
    plain.opt.window_right = 0;
    flashref::cpu::attention(plain.problem());
    flashref::cpu::attention(wide.problem());
    const bool same_narrow = plain.o == wide.o;
    CHECK(same_narrow);
  }
}
