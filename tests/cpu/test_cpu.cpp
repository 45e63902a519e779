// The CPU backend's own tests: the conformance catalogue on every instruction set this
// processor runs and at tile sizes of its own (the suite in tests/conformance runs it through
// backend::cpu), the determinism contract (bitwise identical on 1, 2, 3 and 7 threads),
// independence of the tile sizes and of the split-KV chunking, and option validation; then the
// same for bfloat16 and float16 inputs on every half path the processor runs (convert,
// avx512_bf16, amx), through float32 and through 16-bit storage.
#include <catch2/catch.hpp>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <xtensor/xmanipulation.hpp>
#include <xtensor/xview.hpp>

#include "../common/catalogue.hpp"
#include "../common/check.hpp"
#include "cpu_test.hpp"
#include "flashref/cpu/attention.hpp"
#include "flashref/cpu/half.hpp"
#include "flashref/testdata/fixture.hpp"

using flashref::causal_mode;
using flashref::cpu::half_path;
using flashref::cpu::isa;
using flashref::test::catalogue_case;
using flashref::test::check_against_naive;
using flashref::test::problem_shape;
using flashref::test::same_bits;
using flashref::test::to_bits;
using flashref::test::with_isa;

namespace {

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

TEST_CASE("cpu: scores of magnitude 1e3 whose row maxima move from tile to tile", "[cpu]") {
  // Q and K hold small integers, the first column 40 in both, and the scale is 1: every score
  // is an integer near 1600, computed exactly, spread over a few dozen around it, so that key
  // tiles keep raising rows' maxima while many keys carry weight. Only the exponential can err
  // here: its reduction must not lose the low bits of the large max (2^((s - m) log2 e), not
  // 2^(s log2 e - m log2 e), whose rounding of m log2 e would weigh tiles differently).
  // Row and column counts off a register's width exercise the transposes' tails.
  problem_shape s;
  s.Hq = s.Hk = 2;
  s.Lk = 700;
  s.causal = GENERATE(causal_mode::none, causal_mode::top_left);
  for (const std::int64_t lq : {std::int64_t(300), std::int64_t(37)})
    for (const std::int64_t d : {std::int64_t(64), std::int64_t(20)}) {
      s.Lq = lq;
      s.D = s.Dv = d;
      for (isa i : flashref::cpu::supported_isas()) {
        CAPTURE(s.describe(), flashref::cpu::to_string(i));
        flashref::problem_data pd = flashref::test::random_problem(s, 77 + std::uint64_t(lq + d));
        pd.q = xt::round(pd.q);
        pd.k = xt::round(pd.k);
        xt::view(pd.q, xt::all(), xt::all(), xt::all(), 0) = 40.0f;  // every score + 1600
        xt::view(pd.k, xt::all(), xt::all(), xt::all(), 0) = 40.0f;
        pd.opt.scale = 1.0;
        flashref::cpu::attention(pd.problem(), with_isa(i));
        FLASHREF_REQUIRE_CONFORMS(check_against_naive(pd));
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

TEST_CASE("cpu: K and V with a column stride give the bits of contiguous K and V", "[cpu]") {
  // Float32 K and V with contiguous rows are read in place; any other layout is packed a tile
  // at a time. The products see the same values in the same order either way, including the
  // careful path of a partial tile whose masked key holds a NaN in V.
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = GENERATE(5, 150), s.Lk = 333, s.D = 40, s.Dv = 24;
  s.causal = causal_mode::bottom_right, s.block_q = 16, s.block_k = 32, s.block_density = 0.7;
  const bool nan_in_v = GENERATE(false, true);
  for (isa i : flashref::cpu::supported_isas()) {
    CAPTURE(s.describe(), nan_in_v, flashref::cpu::to_string(i));
    flashref::problem_data d = flashref::test::random_problem(s, 91);
    // The last key: seen by the last query row only (bottom-right causal, Lq <= Lk).
    if (nan_in_v) d.v(1, 0, std::size_t(s.Lk - 1), 5) = NAN;
    flashref::problem_data t = d;
    flashref::cpu::attention(d.problem(), with_isa(i));
    if (!nan_in_v) FLASHREF_REQUIRE_CONFORMS(check_against_naive(d));

    // The same K and V stored as (B, H, X, L): element (b, h, l, x) at stride L in x.
    const auto transposed = [](const xt::xtensor<float, 4>& x) {
      return xt::xtensor<float, 4>(xt::transpose(x, {0, 1, 3, 2}));
    };
    const xt::xtensor<float, 4> kt = transposed(t.k), vt = transposed(t.v);
    flashref::attention_problem p = t.problem();
    p.k.data = kt.data(), p.k.stride = {s.Hk * s.D * s.Lk, s.D * s.Lk, 1, s.Lk};
    p.v.data = vt.data(), p.v.stride = {s.Hk * s.Dv * s.Lk, s.Dv * s.Lk, 1, s.Lk};
    flashref::cpu::attention(p, with_isa(i));
    REQUIRE(same_bits(t.o, d.o));
    REQUIRE(same_bits(t.lse, d.lse));
    if (nan_in_v) {
      // The NaN reaches exactly the rows of the golden result that see its key, and some do.
      const flashref::reference::golden g = flashref::reference::naive_attention(t.inputs());
      std::int64_t nan_rows = 0;
      for (std::int64_t row = 0; row < s.B * s.Hq * s.Lq; ++row) {
        bool golden_nan = false, ours_nan = false;
        for (std::int64_t x = 0; x < s.Dv; ++x) {
          golden_nan = golden_nan || std::isnan(g.o[std::size_t(row * s.Dv + x)]);
          ours_nan = ours_nan || std::isnan(t.o.data()[row * s.Dv + x]);
        }
        CAPTURE(row);
        REQUIRE(ours_nan == golden_nan);
        nan_rows += golden_nan;
      }
      REQUIRE(nan_rows > 0);
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
  // Several windows (about 50 ms each), the best of them reported: still a finite rate.
  const double g = flashref::cpu::peak_fma_gflops(flashref::cpu::isa::automatic, 2, 0.12);
  CAPTURE(g);
  REQUIRE(std::isfinite(g));
  REQUIRE(g > 0.1);
}

TEST_CASE("cpu: the bf16 paths' peak microbenchmark measures their own unit", "[cpu]") {
  for (half_path h : flashref::cpu::supported_half_paths(flashref::input_dtype::bfloat16)) {
    const double g = flashref::cpu::peak_dot_gflops(h, 1, 0.01);
    CAPTURE(flashref::cpu::to_string(h), g);
    REQUIRE(std::isfinite(g));
    REQUIRE(g > 0.1);
  }
  for (half_path h : {half_path::avx512_bf16, half_path::amx}) {
    if (flashref::cpu::supported(h)) continue;
    CAPTURE(flashref::cpu::to_string(h));
    REQUIRE_THROWS_WITH(flashref::cpu::peak_dot_gflops(h, 1, 0.01),
                        Catch::StartsWith("half_path: expected a path this processor runs"));
  }
}

// ---- bfloat16 and float16 inputs -------------------------------------------------------------

namespace {

flashref::cpu::options with_half(half_path h, std::int64_t tq = 0, std::int64_t tk = 0) {
  flashref::cpu::options opt;
  opt.half = h;
  opt.tile_q = tq;
  opt.tile_k = tk;
  return opt;
}

constexpr flashref::input_dtype kHalves[] = {flashref::input_dtype::bfloat16,
                                             flashref::input_dtype::float16};

float from_bits(std::uint16_t h, flashref::input_dtype dtype) {
  return dtype == flashref::input_dtype::bfloat16 ? flashref::cpu::bf16_to_float(h)
                                                  : flashref::cpu::f16_to_float(h);
}

}  // namespace

TEST_CASE("cpu: bfloat16 and float16 conversions round to nearest even", "[cpu][half]") {
  using flashref::input_dtype;
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {  // every 16-bit pattern round-trips
    const auto b = std::uint16_t(h);
    const float fb = flashref::cpu::bf16_to_float(b), fh = flashref::cpu::f16_to_float(b);
    if (!std::isnan(fb)) REQUIRE(flashref::cpu::bf16_from_float(fb) == b);
    if (!std::isnan(fh)) REQUIRE(flashref::cpu::f16_from_float(fh) == b);
    if (std::isnan(fb))
      REQUIRE(std::isnan(flashref::cpu::bf16_to_float(flashref::cpu::bf16_from_float(fb))));
    if (std::isnan(fh))
      REQUIRE(std::isnan(flashref::cpu::f16_to_float(flashref::cpu::f16_from_float(fh))));
  }
  // Against the fixtures' rounding, over every exponent (subnormal, overflow and ties too).
  for (std::uint64_t u = 0; u < (1ull << 32); u += 65521) {
    const float x = std::bit_cast<float>(std::uint32_t(u));
    if (std::isnan(x)) continue;
    CAPTURE(u);
    REQUIRE(std::bit_cast<std::uint32_t>(
                flashref::cpu::bf16_to_float(flashref::cpu::bf16_from_float(x))) ==
            std::bit_cast<std::uint32_t>(flashref::testdata::round_to(input_dtype::bfloat16, x)));
    REQUIRE(std::bit_cast<std::uint32_t>(
                flashref::cpu::f16_to_float(flashref::cpu::f16_from_float(x))) ==
            std::bit_cast<std::uint32_t>(flashref::testdata::round_to(input_dtype::float16, x)));
  }
  REQUIRE(flashref::cpu::bf16_from_float(1.00390625f) == 0x3f80);  // tie: to even
  REQUIRE(flashref::cpu::bf16_from_float(1.01171875f) == 0x3f82);  // tie: to even (up)
  REQUIRE(flashref::cpu::f16_from_float(65520.0f) == 0x7c00);      // rounds to inf
  REQUIRE(flashref::cpu::f16_from_float(5.9604645e-8f) == 0x0001);
}

TEST_CASE("cpu: the half paths this processor runs", "[cpu][half]") {
  using flashref::input_dtype;
  REQUIRE(flashref::cpu::supported_half_paths(input_dtype::float32).empty());
  const auto f16 = flashref::cpu::supported_half_paths(input_dtype::float16);
  REQUIRE(f16 == std::vector<half_path>{half_path::convert});
  const auto bf16 = flashref::cpu::supported_half_paths(input_dtype::bfloat16);
  REQUIRE(bf16.front() == half_path::convert);
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx512 = flashref::cpu::supported(isa::avx512) && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  CHECK(flashref::cpu::supported(half_path::avx512_bf16) ==
        (avx512 && __builtin_cpu_supports("avx512bf16")));
  if (flashref::cpu::supported(half_path::amx))
    CHECK(flashref::cpu::supported(half_path::avx512_bf16));
#endif
  for (half_path h : {half_path::avx512_bf16, half_path::amx}) {
    const bool listed = std::find(bf16.begin(), bf16.end(), h) != bf16.end();
    CHECK(listed == flashref::cpu::supported(h));
  }
  // automatic takes amx where granted, avx512_bf16 on AMD's cores only (their vdpbf16ps
  // outruns the FMAs; Intel's does not), convert otherwise and on a lesser instruction set.
  const half_path preferred = flashref::cpu::preferred_half_path(input_dtype::bfloat16);
  CHECK(std::find(bf16.begin(), bf16.end(), preferred) != bf16.end());
  CHECK(flashref::cpu::preferred_half_path(input_dtype::float16) == half_path::convert);
  CHECK(flashref::cpu::preferred_half_path(input_dtype::float32) == half_path::convert);
  if (flashref::cpu::supported(half_path::amx)) CHECK(preferred == half_path::amx);
#if defined(__x86_64__)
  if (!flashref::cpu::supported(half_path::amx)) {
    unsigned a = 0, b = 0, c = 0, e = 0;
    __get_cpuid(0, &a, &b, &c, &e);
    char vendor[13] = {};
    std::memcpy(vendor, &b, 4), std::memcpy(vendor + 4, &e, 4), std::memcpy(vendor + 8, &c, 4);
    CAPTURE(vendor);
    const bool amd = std::string(vendor) == "AuthenticAMD";
    CHECK(preferred == (amd && flashref::cpu::supported(half_path::avx512_bf16)
                            ? half_path::avx512_bf16
                            : half_path::convert));
  }
#endif
  problem_shape s;
  s.Lq = 40, s.Lk = 50, s.D = 16, s.Dv = 16;
  flashref::problem_data d = flashref::test::random_problem(s, 81);
  flashref::test::round_inputs(d, input_dtype::bfloat16);
  const flashref::attention_problem p = d.problem();
  const flashref::cpu::plan best = flashref::cpu::make_plan(p);
  CHECK(best.half == (best.used == isa::avx512 ? preferred : half_path::convert));
  CHECK(flashref::cpu::make_plan(p, with_isa(isa::portable)).half == half_path::convert);
  for (half_path h : bf16)
    CHECK(flashref::cpu::make_plan(p, with_half(h)).half == h);
  // Paths the processor (or the OS, for AMX) refuses, and bf16 paths for float16 inputs, are
  // named in the error.
  for (half_path h : {half_path::avx512_bf16, half_path::amx}) {
    if (flashref::cpu::supported(h)) continue;
    REQUIRE_THROWS_AS(flashref::cpu::attention(p, with_half(h)), flashref::problem_error);
  }
  flashref::problem_data d16 = flashref::test::random_problem(s, 81);
  flashref::test::round_inputs(d16, input_dtype::float16);
  REQUIRE_THROWS_WITH(
      flashref::cpu::attention(d16.problem(), with_half(half_path::avx512_bf16)),
      Catch::Matchers::StartsWith("half_path: expected a path this processor runs for float16"));
  REQUIRE_THROWS_WITH(flashref::cpu::parse_half_path("fp8"),
                      "half_path: expected one of automatic, convert, avx512_bf16, amx, got 'fp8'");
  for (half_path h :
       {half_path::automatic, half_path::convert, half_path::avx512_bf16, half_path::amx})
    REQUIRE(flashref::cpu::parse_half_path(flashref::cpu::to_string(h)) == h);
}

TEST_CASE("cpu: the catalogue in bfloat16 and float16 on every half path", "[cpu][half]") {
  using tiles = std::pair<std::int64_t, std::int64_t>;
  const tiles t = GENERATE(tiles{0, 0}, tiles{16, 48}, tiles{20, 33});
  for (flashref::input_dtype dtype : kHalves) {
    for (half_path h : flashref::cpu::supported_half_paths(dtype)) {
      CAPTURE(flashref::to_string(dtype), flashref::cpu::to_string(h), t.first, t.second);
      const flashref::test::runner run = [&](const flashref::attention_problem& p) {
        flashref::cpu::attention(p, with_half(h, t.first, t.second));
      };
      for (const catalogue_case& c : flashref::test::edge_cases())
        flashref::test::check_case(c, dtype, run);
      for (const catalogue_case& c : flashref::test::combined_masks())
        flashref::test::check_case(c, dtype, run);
      flashref::test::check_nan_isolation(dtype, run);
    }
  }
}

TEST_CASE("cpu: random half problems on every half path at random tiles", "[cpu][half]") {
  for (const catalogue_case& c : flashref::test::random_cases(101, 40)) {
    const std::int64_t tq = c.seed % 3 == 0 ? 0 : 1 + std::int64_t(c.seed % 37);
    const std::int64_t tk = c.seed % 3 == 0 ? 0 : 1 + std::int64_t((c.seed * 7) % 70);
    for (flashref::input_dtype dtype : kHalves)
      for (half_path h : flashref::cpu::supported_half_paths(dtype)) {
        CAPTURE(flashref::to_string(dtype), flashref::cpu::to_string(h), tq, tk);
        flashref::test::check_case(c, dtype, [&](const flashref::attention_problem& p) {
          flashref::cpu::attention(p, with_half(h, tq, tk));
        });
      }
  }
}

TEST_CASE("cpu: 16-bit storage gives the bits of float32 storage holding the same values",
          "[cpu][half]") {
  problem_shape s;
  // D = 64: bfloat16 K is read in place (unit column stride, D a multiple of 32), and
  // Lk = 333 ends its last tile inside a 16-row step (its zero-padded copy).
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = GENERATE(3, 150), s.Lk = 333, s.D = GENERATE(40, 64);
  s.Dv = 24, s.blhd = GENERATE(false, true);
  s.causal = causal_mode::bottom_right, s.block_q = 16, s.block_k = 32, s.block_density = 0.7;
  for (flashref::input_dtype dtype : kHalves) {
    for (half_path h : flashref::cpu::supported_half_paths(dtype)) {
      CAPTURE(s.describe(), flashref::to_string(dtype), flashref::cpu::to_string(h));
      // A bfloat16 subnormal key element: the products treat it alike, packed or in place.
      const auto with_subnormal = [dtype](flashref::problem_data& x) {
        if (dtype == flashref::input_dtype::bfloat16) x.k.data()[3] = std::ldexp(1.0f, -130);
      };
      flashref::problem_data f = flashref::test::random_problem(s, 90);
      flashref::test::round_inputs(f, dtype);
      with_subnormal(f);
      flashref::cpu::attention(f.problem(), with_half(h));
      FLASHREF_REQUIRE_CONFORMS(check_against_naive(f, dtype));

      flashref::problem_data d = flashref::test::random_problem(s, 90);
      flashref::test::round_inputs(d, dtype);
      with_subnormal(d);
      const std::vector<std::uint16_t> q = to_bits(d.q, dtype), k = to_bits(d.k, dtype),
                                       v = to_bits(d.v, dtype);
      flashref::cpu::half_problem hp;
      hp.p = d.problem();
      hp.p.q.data = hp.p.k.data = hp.p.v.data = nullptr;  // never read
      hp.q = q.data(), hp.k = k.data(), hp.v = v.data();
      REQUIRE(flashref::cpu::make_plan(hp, with_half(h)).half == h);
      flashref::cpu::attention(hp, with_half(h));  // O in float32
      REQUIRE(same_bits(d.o, f.o));
      REQUIRE(same_bits(d.lse, f.lse));

      // O in the input dtype: the float32 result rounded once.
      std::vector<std::uint16_t> o16(d.o.size(), 0xffff);
      hp.o = o16.data();
      flashref::test::poison_outputs(d);
      flashref::cpu::attention(hp, with_half(h));
      REQUIRE(same_bits(d.lse, f.lse));
      for (std::size_t n = 0; n < o16.size(); ++n) {
        CAPTURE(n, f.o.data()[n]);
        REQUIRE(from_bits(o16[n], dtype) == flashref::testdata::round_to(dtype, f.o.data()[n]));
      }
    }
  }
}

TEST_CASE("cpu: half paths are bitwise identical on 1, 2, 3 and 7 threads",
          "[cpu][half][determinism]") {
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.D = 32, s.Dv = 32, s.block_q = 32, s.block_k = 48;
  s.block_density = 0.6, s.causal = causal_mode::bottom_right;
  s.Lq = GENERATE(1, 300), s.Lk = 3000;
  for (flashref::input_dtype dtype : kHalves) {
    for (half_path h : flashref::cpu::supported_half_paths(dtype)) {
      CAPTURE(s.describe(), flashref::to_string(dtype), flashref::cpu::to_string(h));
      flashref::attention_outputs first;
      for (int threads : {1, 2, 3, 7, 1}) {
        CAPTURE(threads);
        flashref::problem_data d = flashref::test::random_problem(s, 41);
        flashref::test::round_inputs(d, dtype);
        flashref::cpu::options opt = with_half(h);
        opt.threads = threads;
        flashref::cpu::attention(d.problem(), opt);
        if (first.o.size() == 0) {
          FLASHREF_REQUIRE_CONFORMS(check_against_naive(d, dtype));
          first = d;
        } else {
          REQUIRE(same_bits(d.o, first.o));
          REQUIRE(same_bits(d.lse, first.lse));
        }
      }
    }
  }
}

TEST_CASE("cpu: the bf16 dot-product paths take a block mask's visible key tiles together",
          "[cpu][half]") {
  // 128-key mask blocks narrow these paths' 256-key tile to 128; a product step then holds two
  // visible tiles, adjacent or not. Lk = 1000 ends in a tile of 104 keys (not a whole 32-key
  // step: it closes its step, and its Vᵀ and K go through the zero-padded copies), the causal
  // mask makes the diagonal tiles partial, and kv_len cuts the keys of batch entries.
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 520, s.Lk = 1000, s.D = 64, s.Dv = 48;
  s.block_q = 128, s.block_k = 128, s.block_density = GENERATE(0.3, 0.7);
  s.causal = GENERATE(causal_mode::none, causal_mode::bottom_right);
  s.use_kv_len = GENERATE(false, true);
  s.blhd = true;
  for (half_path h : flashref::cpu::supported_half_paths(flashref::input_dtype::bfloat16)) {
    CAPTURE(s.describe(), flashref::cpu::to_string(h));
    flashref::problem_data d = flashref::test::random_problem(s, 97);
    flashref::test::round_inputs(d, flashref::input_dtype::bfloat16);
    const bool dot = h == half_path::avx512_bf16 || h == half_path::amx;
    const flashref::cpu::plan pl = flashref::cpu::make_plan(d.problem(), with_half(h));
    CHECK(pl.step_k == (dot ? 2 * pl.tile_k : pl.tile_k));
    if (dot) CHECK(pl.tile_k == 128);
    CHECK(flashref::cpu::make_plan(d.problem(), with_half(h, 0, 128)).step_k == 128);

    flashref::cpu::attention(d.problem(), with_half(h));
    FLASHREF_REQUIRE_CONFORMS(check_against_naive(d, flashref::input_dtype::bfloat16));
    // One tile per step (an explicit key tile): the same rows within the half tolerances.
    flashref::problem_data one = flashref::test::random_problem(s, 97);
    flashref::test::round_inputs(one, flashref::input_dtype::bfloat16);
    flashref::cpu::attention(one.problem(), with_half(h, 0, 128));
    FLASHREF_REQUIRE_CONFORMS(check_against_naive(one, flashref::input_dtype::bfloat16));
  }
}

TEST_CASE("cpu: the bf16 dot-product paths run their own arithmetic", "[cpu][half]") {
  // P is rounded to bfloat16 before P·V on these paths and not on convert: the same problem
  // gives other bits, so a path that silently fell back to convert would show here.
  problem_shape s;
  s.Hq = 2, s.Lq = 64, s.Lk = 200, s.D = 64, s.Dv = 64;
  flashref::problem_data base = flashref::test::random_problem(s, 95);
  flashref::test::round_inputs(base, flashref::input_dtype::bfloat16);
  flashref::cpu::attention(base.problem(), with_half(half_path::convert));
  for (half_path h : flashref::cpu::supported_half_paths(flashref::input_dtype::bfloat16)) {
    if (h == half_path::convert) continue;
    CAPTURE(flashref::cpu::to_string(h));
    flashref::problem_data d = flashref::test::random_problem(s, 95);
    flashref::test::round_inputs(d, flashref::input_dtype::bfloat16);
    flashref::cpu::attention(d.problem(), with_half(h));
    FLASHREF_REQUIRE_CONFORMS(check_against_naive(d, flashref::input_dtype::bfloat16));
    REQUIRE(!same_bits(d.o, base.o));
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
