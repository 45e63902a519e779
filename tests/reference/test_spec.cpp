// The spec function (SPEC §4) against the one-shot softmax, the reviewer's four cases, and
// the two broken twins failing exactly where SPEC §1 says they do.
#include <catch2/catch.hpp>

#include <cmath>

#include "flashref/reference/spec.hpp"
#include "flashref/testdata/random.hpp"

using flashref::reference::one_shot_softmax_dot;
using flashref::reference::spec_result;
using flashref::reference::tiled_softmax_dot;
namespace teaching = flashref::reference::teaching;

namespace {

struct inputs {
  xt::xtensor<double, 1> q;
  xt::xtensor<double, 2> K, V;
};

inputs random_inputs(std::uint64_t seed, std::size_t Lk, std::size_t D, std::size_t Dv) {
  const flashref::testdata::counter_rng r(seed, 7);
  std::uint64_t n = 0;
  inputs in{xt::zeros<double>({D}), xt::zeros<double>({Lk, D}), xt::zeros<double>({Lk, Dv})};
  for (auto& x : in.q)
    x = r.normal(n++);
  for (auto& x : in.K)
    x = r.normal(n++);
  for (auto& x : in.V)
    x = r.normal(n++);
  return in;
}

bool has_nan(const spec_result& r) {
  bool nan = std::isnan(r.lse);
  for (double x : r.out)
    nan = nan || std::isnan(x);
  return nan;
}

void require_close(const spec_result& got, const spec_result& want) {
  REQUIRE_FALSE(has_nan(got));
  REQUIRE(got.out.size() == want.out.size());
  for (std::size_t d = 0; d < got.out.size(); ++d) {
    CAPTURE(d);
    REQUIRE(got.out(d) == Approx(want.out(d)).margin(1e-12));
  }
  if (want.lse == -INFINITY) {
    REQUIRE(got.lse == -INFINITY);
  } else {
    REQUIRE(got.lse == Approx(want.lse).margin(1e-12));
  }
}

}  // namespace

TEST_CASE("spec function equals one-shot softmax on random inputs", "[spec]") {
  const std::int64_t tile = GENERATE(1, 2, 3, 4, 5, 8, 64);
  const std::size_t Lk = GENERATE(0, 1, 3, 4, 7, 17, 33);
  const std::uint64_t seed = GENERATE(range(0, 6));
  CAPTURE(tile, Lk, seed);
  const inputs in = random_inputs(seed, Lk, 5, 3);
  require_close(tiled_softmax_dot(in.q, in.K, in.V, tile), one_shot_softmax_dot(in.q, in.K, in.V));
}

TEST_CASE("spec function equals one-shot softmax with random key masks", "[spec]") {
  const std::int64_t tile = GENERATE(1, 3, 4, 6);
  const std::uint64_t seed = GENERATE(range(0, 20));
  CAPTURE(tile, seed);
  const std::size_t Lk = 23;
  const inputs in = random_inputs(seed, Lk, 4, 4);
  const flashref::testdata::counter_rng r(seed, 8);
  xt::xtensor<std::uint8_t, 1> mask = xt::zeros<std::uint8_t>({Lk});
  for (std::size_t j = 0; j < Lk; ++j)
    mask(j) = r.uniform(j) < 0.3;
  require_close(tiled_softmax_dot(in.q, in.K, in.V, tile, mask),
                one_shot_softmax_dot(in.q, in.K, in.V, mask));
}

TEST_CASE("reviewer check: later tiles below the running max keep exp_old == 1", "[spec]") {
  // Tile 0 holds the largest score; every later score is lower, so the max never moves.
  inputs in = random_inputs(3, 12, 2, 2);
  in.q = {1.0, 0.0};
  for (std::size_t j = 0; j < 12; ++j)
    in.K(j, 0) = j == 1 ? 5.0 : -double(j) / 4.0;
  const spec_result r = tiled_softmax_dot(in.q, in.K, in.V, 4);
  REQUIRE(r.trace.size() == 3);
  REQUIRE(r.trace[0].exp_old == 0.0);  // the first visible tile keeps nothing
  REQUIRE(r.trace[1].exp_old == 1.0);
  REQUIRE(r.trace[2].exp_old == 1.0);
  require_close(r, one_shot_softmax_dot(in.q, in.K, in.V));
}

TEST_CASE("reviewer check: later tiles above the running max shrink earlier terms", "[spec]") {
  inputs in = random_inputs(4, 12, 2, 2);
  in.q = {1.0, 0.0};
  for (std::size_t j = 0; j < 12; ++j)
    in.K(j, 0) = double(j);  // every tile raises the max
  const spec_result r = tiled_softmax_dot(in.q, in.K, in.V, 4);
  REQUIRE(r.trace.size() == 3);
  for (std::size_t t = 1; t < 3; ++t) {
    CAPTURE(t);
    REQUIRE(r.trace[t].exp_old < 1.0);
    REQUIRE(r.trace[t].exp_old == Approx(std::exp(r.trace[t].m_old - r.trace[t].m_new)));
    REQUIRE(r.trace[t].m_new > r.trace[t].m_old);
  }
  require_close(r, one_shot_softmax_dot(in.q, in.K, in.V));
}

TEST_CASE("reviewer check: a fully masked first tile gives no NaN", "[spec]") {
  const inputs in = random_inputs(5, 10, 3, 3);
  xt::xtensor<std::uint8_t, 1> mask = xt::ones<std::uint8_t>({10});
  for (std::size_t j = 0; j < 4; ++j)
    mask(j) = 0;
  const spec_result r = tiled_softmax_dot(in.q, in.K, in.V, 4, mask);
  REQUIRE(r.trace[0].all_masked);
  REQUIRE(r.trace[0].m_new == -INFINITY);
  REQUIRE(r.trace[0].s == 0.0);
  require_close(r, one_shot_softmax_dot(in.q, in.K, in.V, mask));
}

TEST_CASE("no visible key gives O = 0 and LSE = -inf", "[spec]") {
  const std::size_t Lk = GENERATE(0, 1, 4, 9);
  CAPTURE(Lk);
  const inputs in = random_inputs(6, Lk, 3, 2);
  const xt::xtensor<std::uint8_t, 1> none = xt::zeros<std::uint8_t>({Lk});
  for (const spec_result& r : {tiled_softmax_dot(in.q, in.K, in.V, 4, none),
                               one_shot_softmax_dot(in.q, in.K, in.V, none)}) {
    REQUIRE(r.lse == -INFINITY);
    REQUIRE(r.out(0) == 0.0);
    REQUIRE(r.out(1) == 0.0);
  }
}

TEST_CASE("extreme scores do not overflow", "[spec]") {
  inputs in = random_inputs(7, 9, 2, 2);
  in.q = {1.0, 1.0};
  for (std::size_t j = 0; j < 9; ++j)
    in.K(j, 0) = 1000.0 * double(j);  // scores up to 8e3
  require_close(tiled_softmax_dot(in.q, in.K, in.V, 2), one_shot_softmax_dot(in.q, in.K, in.V));
}

TEST_CASE("teaching twins: correct when the first tile has a visible key", "[spec][teaching]") {
  const inputs in = random_inputs(8, 11, 3, 3);
  const spec_result want = one_shot_softmax_dot(in.q, in.K, in.V);
  require_close(teaching::tiled_softmax_dot_unguarded(in.q, in.K, in.V, 4), want);
  require_close(teaching::tiled_softmax_dot_patched(in.q, in.K, in.V, 4), want);
  // A masked tile after a visible one is harmless too: the max is already finite.
  xt::xtensor<std::uint8_t, 1> mask = xt::ones<std::uint8_t>({11});
  for (std::size_t j = 4; j < 8; ++j)
    mask(j) = 0;
  require_close(teaching::tiled_softmax_dot_unguarded(in.q, in.K, in.V, 4, mask),
                one_shot_softmax_dot(in.q, in.K, in.V, mask));
}

TEST_CASE("teaching twins: failure case 1, a fully masked first tile, NaNs both",
          "[spec][teaching]") {
  const inputs in = random_inputs(9, 10, 3, 3);
  xt::xtensor<std::uint8_t, 1> mask = xt::ones<std::uint8_t>({10});
  for (std::size_t j = 0; j < 4; ++j)
    mask(j) = 0;
  for (const spec_result& r : {teaching::tiled_softmax_dot_unguarded(in.q, in.K, in.V, 4, mask),
                               teaching::tiled_softmax_dot_patched(in.q, in.K, in.V, 4, mask)}) {
    // exp(-inf - (-inf)) = NaN on the first tile, and it never leaves s.
    REQUIRE(std::isnan(r.trace[0].exp_old));
    REQUIRE(std::isnan(r.trace[0].s));
    REQUIRE(std::isnan(r.trace.back().s));
    REQUIRE(has_nan(r));
  }
  REQUIRE_FALSE(has_nan(tiled_softmax_dot(in.q, in.K, in.V, 4, mask)));
}

TEST_CASE("teaching twins: failure case 2, an empty sum", "[spec][teaching]") {
  // No tile at all (Lk = 0): s == 0 exactly. The unguarded division gives 0/0 = NaN; the
  // patch catches exactly this.
  const inputs none = random_inputs(10, 0, 3, 3);
  REQUIRE(has_nan(teaching::tiled_softmax_dot_unguarded(none.q, none.K, none.V, 4)));
  const spec_result patched = teaching::tiled_softmax_dot_patched(none.q, none.K, none.V, 4);
  REQUIRE_FALSE(has_nan(patched));
  REQUIRE(patched.lse == -INFINITY);
  // Every key masked (Lk > 0): the first tile is fully masked, so s is NaN before the
  // patch's check runs — the patch does not help (failure case 1 inside case 2).
  const inputs in = random_inputs(11, 8, 3, 3);
  const xt::xtensor<std::uint8_t, 1> mask = xt::zeros<std::uint8_t>({8});
  REQUIRE(has_nan(teaching::tiled_softmax_dot_unguarded(in.q, in.K, in.V, 4, mask)));
  REQUIRE(has_nan(teaching::tiled_softmax_dot_patched(in.q, in.K, in.V, 4, mask)));
  const spec_result guarded = tiled_softmax_dot(in.q, in.K, in.V, 4, mask);
  REQUIRE_FALSE(has_nan(guarded));
  REQUIRE(guarded.lse == -INFINITY);
}

TEST_CASE("spec function rejects malformed inputs with the field named", "[spec]") {
  const inputs in = random_inputs(12, 6, 3, 2);
  const xt::xtensor<double, 2> K_bad = xt::zeros<double>({6, 4});
  REQUIRE_THROWS_WITH(tiled_softmax_dot(in.q, K_bad, in.V),
                      Catch::StartsWith("K: expected 3 columns"));
  const xt::xtensor<double, 2> V_bad = xt::zeros<double>({5, 2});
  REQUIRE_THROWS_WITH(tiled_softmax_dot(in.q, in.K, V_bad),
                      Catch::StartsWith("V: expected 6 rows"));
  REQUIRE_THROWS_WITH(tiled_softmax_dot(in.q, in.K, in.V, 0),
                      Catch::StartsWith("tile: expected a positive"));
  const xt::xtensor<std::uint8_t, 1> m_bad = xt::zeros<std::uint8_t>({5});
  REQUIRE_THROWS_WITH(tiled_softmax_dot(in.q, in.K, in.V, 2, m_bad),
                      Catch::StartsWith("key_mask: expected 6"));
}
