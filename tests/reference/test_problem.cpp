// Validation: each malformed problem throws problem_error naming the field, the expected and
// the actual value. Plus the online-softmax state's named steps and the mask helper.
#include <catch2/catch.hpp>

#include <limits>

#include "../common/problem.hpp"
#include "flashref/reference/mask.hpp"
#include "flashref/reference/naive.hpp"
#include "flashref/reference/online_softmax.hpp"

using flashref::problem_error;
using flashref::test::problem_shape;

namespace {
problem_shape base() {
  problem_shape s;
  s.B = 2, s.Hq = 4, s.Hk = 2, s.Lq = 64, s.Lk = 64, s.D = 8, s.Dv = 8;
  s.block_q = 4, s.block_k = 4;
  return s;
}
}  // namespace

TEST_CASE("validation names the field, the expected and the actual value", "[validate]") {
  flashref::problem_data d = flashref::test::random_problem(base(), 1);
  flashref::attention_problem p = d.problem();
  REQUIRE_NOTHROW(flashref::validate(p));

  SECTION("block mask shape") {
    p.block_mask.shape = {1, 4, 16, 8};
    REQUIRE_THROWS_WITH(flashref::validate(p),
                        "block_mask: expected shape [1, 4, 16, 16], got [1, 4, 16, 8]");
    p.block_mask.shape = {3, 4, 16, 16};
    REQUIRE_THROWS_WITH(flashref::validate(p),
                        "block_mask: expected shape [2, 4, 16, 16], got [3, 4, 16, 16]");
  }
  SECTION("block sizes near 2^63 (found by fuzzing: ceil_div overflowed)") {
    p.block_q = std::numeric_limits<std::int64_t>::max();
    REQUIRE_THROWS_WITH(flashref::validate(p),
                        "block_mask: expected shape [2, 4, 1, 16], got [2, 4, 16, 16]");
    p.block_q = 4, p.block_k = std::numeric_limits<std::int64_t>::max() - 1;
    REQUIRE_THROWS_WITH(flashref::validate(p),
                        "block_mask: expected shape [2, 4, 16, 1], got [2, 4, 16, 16]");
  }
  SECTION("block sizes") {
    p.block_q = 0;
    REQUIRE_THROWS_WITH(flashref::validate(p), "block_q: expected a positive block size, got 0");
    p.block_q = 4, p.block_k = -2;
    REQUIRE_THROWS_WITH(flashref::validate(p), "block_k: expected a positive block size, got -2");
  }
  SECTION("key shape") {
    p.k.shape[3] = 7;
    REQUIRE_THROWS_WITH(flashref::validate(p), "k: expected shape [2, *, *, 8], got [2, 2, 64, 7]");
  }
  SECTION("value shape") {
    p.v.shape[2] = 63;
    REQUIRE_THROWS_WITH(flashref::validate(p),
                        "v: expected shape [2, 2, 64, *], got [2, 2, 63, 8]");
  }
  SECTION("head counts") {
    p.k.shape[1] = 3, p.v.shape[1] = 3;
    REQUIRE_THROWS_WITH(flashref::validate(p),
                        "k: expected a head count dividing Hq = 4, got Hk = 3");
  }
  SECTION("output shape") {
    p.o.shape[3] = 4;
    REQUIRE_THROWS_WITH(flashref::validate(p),
                        "o: expected shape [2, 4, 64, 8], got [2, 4, 64, 4]");
    p.o.shape[3] = 8, p.lse.shape[2] = 1;
    REQUIRE_THROWS_WITH(flashref::validate(p), "lse: expected shape [2, 4, 64], got [2, 4, 1]");
  }
  SECTION("negative dimensions and missing data") {
    p.q.shape[2] = -1;
    REQUIRE_THROWS_WITH(flashref::validate(p),
                        "q: expected non-negative dimensions, got [2, 4, *, 8]");
    p.q.shape[2] = 64, p.v.data = nullptr;
    REQUIRE_THROWS_WITH(flashref::validate(p),
                        "v: expected a data pointer for 2048 elements, got null");
  }
  SECTION("scale, windows and kv_len") {
    p.scale = NAN;
    REQUIRE_THROWS_WITH(flashref::validate(p),
                        Catch::StartsWith("scale: expected a finite number"));
    p.scale.reset(), p.window_left = -2;
    REQUIRE_THROWS_WITH(flashref::validate(p), "window_left: expected >= -1 (-1 = off), got -2");
    p.window_left = -1, p.window_right = -5;
    REQUIRE_THROWS_WITH(flashref::validate(p), "window_right: expected >= -1 (-1 = off), got -5");
    p.window_right = -1;
    const std::int32_t lens[2] = {64, 65};
    p.kv_len = lens;
    REQUIRE_THROWS_WITH(flashref::validate(p), "kv_len[1]: expected a value in [0, 64], got 65");
  }
  SECTION("block sizes without a mask") {
    p.block_mask.data = nullptr;
    REQUIRE_THROWS_WITH(
        flashref::validate(p),
        Catch::StartsWith("block_mask: expected a mask when block_q/block_k are set"));
  }
  SECTION("element counts and offsets that overflow 64 bits") {
    // 2^22 * 2^22 * 2^22 elements of q: the count overflows int64, whatever the strides.
    p.q.shape = {std::int64_t(1) << 22, std::int64_t(1) << 22, std::int64_t(1) << 22, 8};
    REQUIRE_THROWS_WITH(flashref::validate(p),
                        "q: expected at most 2^63 - 1 elements, got [4194304, 4194304, 4194304, "
                        "8] (the count overflows)");
    // A count that fits, with strides that reach past 2^63.
    p.q.shape = {2, 4, 64, 8};
    p.k.stride = {0, 0, std::int64_t(1) << 60, 1};
    REQUIRE_THROWS_WITH(
        flashref::validate(p),
        "k: expected element offsets below 2^63, got shape [2, 2, 64, 8] with strides [0, 0, "
        "1152921504606846976, 1]");
    p.k.stride = {0, 0, std::numeric_limits<std::int64_t>::min(), 1};
    REQUIRE_THROWS_WITH(flashref::validate(p),
                        Catch::StartsWith("k: expected element offsets below 2^63"));
    // Broadcast (stride 0) and negative strides within range are offsets like any other.
    p.k.stride = {0, -8, 0, 1};
    p.k.data += 8;
    REQUIRE_NOTHROW(flashref::validate(p));
  }
  SECTION("the reference checks its own float64 storage against the memory budget") {
    // Every key of a [1, 1, 2^40, 8] K is the same row (stride 0): the descriptor is valid,
    // but one row of 2^40 float64 scores is more than any machine here holds.
    p.k.shape = {2, 2, std::int64_t(1) << 40, 8};
    p.k.stride = {0, 0, 0, 1};
    p.v.shape = {2, 2, std::int64_t(1) << 40, 8};
    p.v.stride = {0, 0, 0, 1};
    p.block_mask.data = nullptr, p.block_q = p.block_k = 0;
    REQUIRE_NOTHROW(flashref::validate(p));
    REQUIRE_THROWS_WITH(flashref::reference::naive_attention(p),
                        Catch::StartsWith("reference: golden O and LSE: expected at most"));
  }
  SECTION("the naive reference validates too") {
    p.block_q = 0;
    REQUIRE_THROWS_AS(flashref::reference::naive_attention(p), problem_error);
  }
}

TEST_CASE("online softmax: the named steps", "[online_softmax]") {
  flashref::online_softmax<double> st;
  REQUIRE(st.finalize().out_scale == 0.0);
  REQUIRE(st.finalize().lse == -INFINITY);
  // A fully masked block before any visible key: nothing changes, nothing is NaN.
  REQUIRE(st.update_max(-INFINITY) == 0.0);
  REQUIRE(st.prob(-INFINITY) == 0.0);
  REQUIRE(st.m == -INFINITY);
  REQUIRE(st.s == 0.0);
  // First visible block: exp_old = 0, not 1.
  REQUIRE(st.update_max(2.0) == 0.0);
  st.absorb(st.prob(2.0) + st.prob(1.0));
  // A lower block: exp_old = 1. A higher one: exp_old = exp(2 - 3).
  REQUIRE(st.update_max(0.5) == 1.0);
  const double e = st.update_max(3.0);
  REQUIRE(e == Approx(std::exp(-1.0)));
  st.rescale(e);
  st.absorb(st.prob(3.0));
  REQUIRE(st.finalize().lse == Approx(std::log(std::exp(2.0) + std::exp(1.0) + std::exp(3.0))));
}

TEST_CASE("mask_spec classifies tiles exactly where it claims to", "[mask]") {
  const std::uint64_t seed = GENERATE(range(0, 25));
  problem_shape s = flashref::test::random_shape(seed);
  s.Lq = std::max<std::int64_t>(s.Lq, 1), s.Lk = std::max<std::int64_t>(s.Lk, 1);
  CAPTURE(seed, s.describe());
  const flashref::problem_data d = flashref::test::random_problem(s, seed);
  const flashref::mask_spec m = flashref::make_mask_spec(d.inputs());
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.Hq; ++h)
      for (std::int64_t q0 = 0; q0 < s.Lq; q0 += 7)
        for (std::int64_t k0 = 0; k0 < s.Lk; k0 += 11) {
          const std::int64_t q1 = std::min(q0 + 7, s.Lq), k1 = std::min(k0 + 11, s.Lk);
          std::int64_t vis = 0;
          for (std::int64_t i = q0; i < q1; ++i)
            for (std::int64_t j = k0; j < k1; ++j)
              vis += m.visible(b, h, i, j);
          const auto c = m.classify(b, h, q0, q1, k0, k1);
          if (c == flashref::tile_class::empty) REQUIRE(vis == 0);
          if (c == flashref::tile_class::full) REQUIRE(vis == (q1 - q0) * (k1 - k0));
        }
}

TEST_CASE("mask_spec::classify_in_blocks with block sizes clamped to the lengths is classify",
          "[mask]") {
  // The GPU walker that forms a tile's mask blocks in 32 bits (cuda/src/common.cuh, kNarrow)
  // divides by the block sizes clamped to [1, L]: the same quotients for indices below L, so
  // the same class for every tile, block sizes longer than the lengths included.
  const std::uint64_t seed = GENERATE(range(0, 40));
  problem_shape s = flashref::test::random_shape(seed);
  s.Lq = std::max<std::int64_t>(s.Lq, 1), s.Lk = std::max<std::int64_t>(s.Lk, 1);
  if (s.block_q == 0)
    s.block_q = 1 + std::int64_t(seed % 13), s.block_k = 1 + std::int64_t(seed % 17);
  if (seed % 4 == 1) s.block_q = s.Lq + std::int64_t(seed % 3);  // as long as Lq, or longer
  if (seed % 4 == 2) s.block_k = s.Lk + std::int64_t(seed % 5);
  if (s.block_density <= 0.0) s.block_density = 0.5;
  CAPTURE(seed, s.describe());
  const flashref::problem_data d = flashref::test::random_problem(s, seed);
  const flashref::mask_spec m = flashref::make_mask_spec(d.inputs());
  REQUIRE(m.block_mask != nullptr);
  const auto clamp = [](std::int64_t size, std::int64_t len) {
    return std::max<std::int64_t>(std::min(size, len), 1);
  };
  const std::int64_t bq = clamp(m.block_q, s.Lq), bk = clamp(m.block_k, s.Lk);
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.Hq; ++h)
      for (std::int64_t q0 = 0; q0 < s.Lq; q0 += 5)
        for (std::int64_t k0 = 0; k0 < s.Lk; k0 += 9) {
          const std::int64_t q1 = std::min(q0 + 5, s.Lq), k1 = std::min(k0 + 9, s.Lk);
          CAPTURE(b, h, q0, k0);
          REQUIRE(m.classify_in_blocks(b, h, q0, q1, k0, k1, {q0 / bq, (q1 - 1) / bq},
                                       {k0 / bk, (k1 - 1) / bk}) ==
                  m.classify(b, h, q0, q1, k0, k1));
        }
}

TEST_CASE("mask_spec::key_end is where a batch's keys end: no row sees a key past it", "[mask]") {
  // The kernels load no key at or past key_end(b) (min(Lk, kv_len[b])) and zero-fill the tile
  // that straddles it: every visible key lies below it, and with kv_len the last key below it
  // is visible to a row that sees everything.
  const std::uint64_t seed = GENERATE(range(0, 30));
  problem_shape s = flashref::test::random_shape(seed);
  s.Lq = std::max<std::int64_t>(s.Lq, 1), s.Lk = std::max<std::int64_t>(s.Lk, 1);
  if (seed % 2 == 0) s.use_kv_len = true;
  CAPTURE(seed, s.describe());
  const flashref::problem_data d = flashref::test::random_problem(s, seed);
  const flashref::attention_problem p = d.inputs();
  const flashref::mask_spec m = flashref::make_mask_spec(p);
  for (std::int64_t b = 0; b < s.B; ++b) {
    const std::int64_t end = m.key_end(b);
    CAPTURE(b, end);
    REQUIRE(end == (p.kv_len != nullptr ? std::min<std::int64_t>(p.kv_len[b], s.Lk) : s.Lk));
    for (std::int64_t i = 0; i < s.Lq; ++i)
      REQUIRE(m.row_range(b, i).hi <= end);
    flashref::mask_spec open = m;  // no causal, window or block mask: kv_len alone
    open.causal = flashref::causal_mode::none;
    open.window_left = open.window_right = -1;
    open.block_mask = nullptr;
    REQUIRE(open.row_range(b, 0).hi == end);
  }
}

TEST_CASE("mask_spec::query_range is row_range transposed", "[mask]") {
  // The dK, dV passes test a key's rows against this interval instead of calling row_range per
  // row: for every key, exactly the rows whose interval holds it, windows of every width
  // (up to 2^63 - 1) included.
  const std::uint64_t seed = GENERATE(range(0, 60));
  problem_shape s = flashref::test::random_shape(seed);
  s.Lq = std::max<std::int64_t>(s.Lq, 1), s.Lk = std::max<std::int64_t>(s.Lk, 1);
  if (seed % 3 == 0) s.window_left = INT64_MAX;
  if (seed % 5 == 0) s.window_right = INT64_MAX - 1;
  CAPTURE(seed, s.describe());
  const flashref::problem_data d = flashref::test::random_problem(s, seed);
  const flashref::mask_spec m = flashref::make_mask_spec(d.inputs());
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t j = -1; j <= s.Lk; ++j) {
      const flashref::key_range q = m.query_range(b, j);
      CAPTURE(b, j, q.lo, q.hi);
      for (std::int64_t i = 0; i < s.Lq; ++i) {
        const flashref::key_range r = m.row_range(b, i);
        CAPTURE(i, r.lo, r.hi);
        REQUIRE((i >= q.lo && i < q.hi) == (j >= 0 && j >= r.lo && j < r.hi));
      }
    }
}

TEST_CASE("mask_spec::key_tiles names the tiles that hold a visible key, and the full ones",
          "[mask]") {
  // The Hopper kernel's walk over a mask without a block mask takes this span instead of
  // classifying every tile: it must visit every tile that holds a visible key, with
  // classify()'s class.
  const std::uint64_t seed = GENERATE(range(0, 40));
  problem_shape s = flashref::test::random_shape(seed);
  s.Lq = std::max<std::int64_t>(s.Lq, 1), s.Lk = std::max<std::int64_t>(s.Lk, 1);
  s.block_q = s.block_k = 0;
  CAPTURE(seed, s.describe());
  const flashref::problem_data d = flashref::test::random_problem(s, seed);
  const flashref::mask_spec m = flashref::make_mask_spec(d.inputs());
  REQUIRE(m.block_mask == nullptr);
  for (const std::int64_t tile_q : {1, 5, 64, 192})
    for (const std::int64_t tile_k : {1, 3, 16, 128})
      for (std::int64_t b = 0; b < s.B; ++b)
        for (std::int64_t q0 = 0; q0 < s.Lq; q0 += tile_q) {
          const std::int64_t q1 = std::min(q0 + tile_q, s.Lq);
          const flashref::mask_spec::tile_span span = m.key_tiles(b, q0, q1, tile_k);
          CAPTURE(tile_q, tile_k, b, q0, span.tile_begin, span.tile_end);
          REQUIRE(span.tile_begin <= span.tile_end);
          for (std::int64_t t = 0; t * tile_k < s.Lk; ++t) {
            const std::int64_t k0 = t * tile_k, k1 = std::min(k0 + tile_k, s.Lk);
            CAPTURE(t);
            const auto c = m.classify(b, 0, q0, q1, k0, k1);
            const bool in_span = t >= span.tile_begin && t < span.tile_end;
            if (in_span) REQUIRE(c != flashref::tile_class::empty);
            if (!in_span && c != flashref::tile_class::empty) {
              // classify() is conservative: a tile it keeps that the span skips has no visible
              // key (every row's interval empty there).
              for (std::int64_t i = q0; i < q1; ++i)
                for (std::int64_t j = k0; j < k1; ++j)
                  REQUIRE_FALSE(m.visible(b, 0, i, j));
            }
            // Full as the walkers treat it: classify's full, and no key past len_k.
            const bool walk_full = c == flashref::tile_class::full && k0 + tile_k <= s.Lk;
            if (in_span)
              REQUIRE(flashref::mask_spec::tile_full(span, k0, k0 + tile_k) == walk_full);
          }
        }
}
