// The backward pass of SPEC §9 in the reference: the naive float64 golden gradients checked
// against finite differences of the naive float64 forward, then the scalar tiled backward
// against the golden gradients: the backward catalogue's edge cases (tests/common/catalogue.hpp,
// every mask alone and combined) at several tiles, then random problems at random tiles.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "../common/backward_check.hpp"
#include "../common/catalogue.hpp"
#include "flashref/reference/backward.hpp"
#include "flashref/reference/naive.hpp"
#include "flashref/reference/online_softmax.hpp"
#include "flashref/reference/tiled.hpp"

using flashref::causal_mode;
using flashref::problem_data;
using flashref::test::add_upstream_gradient;
using flashref::test::catalogue_case;
using flashref::test::check_backward_against_naive;
using flashref::test::problem_shape;
using flashref::test::random_problem;

namespace {

// The forward (tiled reference, float32 O and LSE as a backend stores them), then the tiled
// backward from those stored values.
void tiled_forward(const flashref::attention_problem& p) {
  flashref::reference::tiled_attention(p);
}

flashref::test::backward_runner tiled_backward(flashref::reference::tile_shape tile) {
  return [tile](const flashref::attention_problem& p, const flashref::attention_gradients& g) {
    flashref::reference::tiled_attention_backward(p, g, tile);
  };
}

// One problem through the two, judged against the golden gradients.
void run_and_check(const problem_shape& s, std::uint64_t seed,
                   flashref::reference::tile_shape tile = {}) {
  CAPTURE(s.describe(), seed, tile.q, tile.k);
  problem_data d = random_problem(s, seed);
  tiled_forward(d.problem());
  add_upstream_gradient(d, seed);
  tiled_backward(tile)(d.problem(), d.gradients());
  FLASHREF_REQUIRE_GRADIENTS_CONFORM(check_backward_against_naive(d));
}

// f = Σ O ∘ dO in float64 from the naive forward.
double loss(problem_data& d) {
  const flashref::reference::golden g = flashref::reference::naive_attention(d.inputs());
  const flashref::strided<const float, 4> d_o = d.gradients().d_o;
  double f = 0.0;
  std::size_t n = 0;
  for (std::int64_t b = 0; b < d_o.shape[0]; ++b)
    for (std::int64_t h = 0; h < d_o.shape[1]; ++h)
      for (std::int64_t i = 0; i < d_o.shape[2]; ++i)
        for (std::int64_t x = 0; x < d_o.shape[3]; ++x)
          f += g.o[n++] * double(d_o(b, h, i, x));
  return f;
}

// Central differences of the float64 forward against the golden gradient of one input
// (row-major storage, the problem's views point into it). The step is a power of two, so
// x ± h is exact in float32 for the |x| < 2^10 used here.
void check_finite_differences(problem_data& d, xt::xtensor<float, 4>& x,
                              const std::vector<double>& grad, const char* name) {
  constexpr double kStep = 0x1p-10;
  double max_grad = 0.0;
  for (double gval : grad)
    max_grad = std::max(max_grad, std::abs(gval));
  for (std::size_t n = 0; n < x.size(); ++n) {
    float& at = x.data()[n];
    const float x0 = at;
    at = float(double(x0) + kStep);
    const double up = loss(d);
    at = float(double(x0) - kStep);
    const double down = loss(d);
    at = x0;
    const double fd = (up - down) / (2.0 * kStep);
    CAPTURE(name, n, fd, grad[n]);
    // Truncation error of a central difference is O(h^2 f'''): ~1e-6 at these magnitudes.
    REQUIRE(std::abs(fd - grad[n]) <= 1e-5 * (1.0 + max_grad));
  }
}

}  // namespace

TEST_CASE("golden backward: the recomputation goes through the state's guard", "[backward]") {
  using state = flashref::online_softmax<double>;
  // An empty row: LSE = -inf and every score masked to -inf. Unguarded, exp(-inf - (-inf)).
  REQUIRE(std::isnan(std::exp(-INFINITY - -INFINITY)));
  REQUIRE(state::from_lse(-INFINITY).prob(-INFINITY) == 0.0);
  // A finished row: Σ_j exp(S_j - LSE) = 1.
  const double s0 = 0.3, s1 = -1.2, lse = std::log(std::exp(s0) + std::exp(s1));
  const state row = state::from_lse(lse);
  REQUIRE(row.prob(s0) + row.prob(s1) == Approx(1.0).epsilon(1e-15));
  REQUIRE(row.prob(-INFINITY) == 0.0);
}

TEST_CASE("golden backward: finite differences of the float64 forward", "[backward]") {
  problem_shape s;
  s.B = 2, s.Hq = 2, s.Hk = 1, s.Lq = 5, s.Lk = 6, s.D = 3, s.Dv = 2;
  SECTION("dense, GQA, Dv != D") {}
  SECTION("causal with empty rows") {
    s.Lq = 7, s.Lk = 4, s.causal = causal_mode::bottom_right;
  }
  SECTION("block mask, window and kv_len") {
    s.block_q = 2, s.block_k = 3, s.block_density = 0.6, s.window_left = 3;
    s.use_kv_len = true;
  }
  SECTION("[B, L, H, D] layout") {
    s.blhd = true, s.causal = causal_mode::top_left;
  }
  CAPTURE(s.describe());
  problem_data d = random_problem(s, 21);
  add_upstream_gradient(d, 21);
  const flashref::reference::golden_gradients gold =
      flashref::reference::naive_attention_backward(d.problem(), d.gradients().d_o);
  // The views of a [B, L, H, D] problem are not row-major: perturb storage, map gradients.
  auto storage_order = [&](const std::vector<double>& grad, std::int64_t H, std::int64_t L,
                           std::int64_t X) {
    if (!s.blhd) return grad;
    std::vector<double> out(grad.size());
    for (std::int64_t b = 0; b < s.B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < L; ++i)
          for (std::int64_t x = 0; x < X; ++x)
            out[std::size_t(((b * L + i) * H + h) * X + x)] =
                grad[std::size_t(((b * H + h) * L + i) * X + x)];
    return out;
  };
  check_finite_differences(d, d.q, storage_order(gold.dq, s.Hq, s.Lq, s.D), "dq");
  check_finite_differences(d, d.k, storage_order(gold.dk, s.Hk, s.Lk, s.D), "dk");
  check_finite_differences(d, d.v, storage_order(gold.dv, s.Hk, s.Lk, s.Dv), "dv");
}

TEST_CASE("golden backward: empty rows and unseen keys are exactly zero", "[backward]") {
  problem_shape s;
  s.B = 2, s.Lq = 9, s.Lk = 4, s.causal = causal_mode::bottom_right, s.use_kv_len = true;
  problem_data d = random_problem(s, 22);
  add_upstream_gradient(d, 22);
  const auto gold = flashref::reference::naive_attention_backward(d.problem(), d.gradients().d_o);
  // Batch entry 0 has kv_len = 0: every row empty, every key unseen.
  std::int64_t empty = 0, unseen = 0;
  for (std::size_t r = 0; r < gold.row_empty.size(); ++r) {
    if (!gold.row_empty[r]) continue;
    ++empty;
    for (std::int64_t x = 0; x < s.D; ++x)
      REQUIRE(gold.dq[r * std::size_t(s.D) + std::size_t(x)] == 0.0);
  }
  for (std::size_t j = 0; j < gold.key_unseen.size(); ++j) {
    if (!gold.key_unseen[j]) continue;
    ++unseen;
    for (std::int64_t x = 0; x < s.D; ++x)
      REQUIRE(gold.dk[j * std::size_t(s.D) + std::size_t(x)] == 0.0);
    for (std::int64_t x = 0; x < s.Dv; ++x)
      REQUIRE(gold.dv[j * std::size_t(s.Dv) + std::size_t(x)] == 0.0);
  }
  REQUIRE(empty >= s.Lq + (s.Lq - s.Lk));  // all of batch 0, the top rows of batch 1
  REQUIRE(unseen >= s.Lk);
}

TEST_CASE("golden backward: windows as wide as 2^63 - 1 are no window (found by fuzzing)",
          "[backward]") {
  // The golden backward's visibility test once added the window to the row's diagonal, which
  // overflowed for windows near 2^63 and hid every key on one side.
  for (const bool taller : {false, true}) {  // Lq > Lk puts the diagonal left of key 0
    problem_shape s;
    s.B = 1, s.Hq = 2, s.Hk = 1, s.Lq = taller ? 23 : 9, s.Lk = taller ? 9 : 23, s.D = 4, s.Dv = 3;
    problem_data d = random_problem(s, 5);
    add_upstream_gradient(d, 5);
    flashref::attention_problem p = d.problem();
    const auto a = flashref::reference::naive_attention_backward(p, d.gradients().d_o);
    p.window_left = INT64_MAX;
    p.window_right = INT64_MAX - 1;
    const auto b = flashref::reference::naive_attention_backward(p, d.gradients().d_o);
    CAPTURE(taller);
    REQUIRE(b.row_empty == a.row_empty);
    REQUIRE(b.key_unseen == a.key_unseen);
    REQUIRE(b.dq == a.dq);
    REQUIRE(b.dk == a.dk);
    REQUIRE(b.dv == a.dv);
    REQUIRE(std::count(a.row_empty.begin(), a.row_empty.end(), 1) == 0);
  }
}

TEST_CASE("tiled backward: the backward catalogue's edge cases at several tiles", "[backward]") {
  // Tiles smaller than, straddling and larger than the cases' mask blocks and lengths.
  std::vector<flashref::test::backward_variant> variants;
  for (flashref::reference::tile_shape tile :
       {flashref::reference::tile_shape{}, {16, 4}, {4, 8}, {3, 5}, {8, 8}, {8, 16}, {16, 16}}) {
    variants.push_back({"tiles " + std::to_string(tile.q) + " x " + std::to_string(tile.k),
                        tiled_forward, tiled_backward(tile)});
  }
  for (const catalogue_case& c : flashref::test::backward_edge_cases())
    flashref::test::check_backward_case(c, variants);
}

TEST_CASE("tiled backward: a one-key window gives exactly zero dQ and dK", "[backward]") {
  // Each row sees one key: P = 1, O = V_j, Delta = dO · V_j = dP_j, so dS = 0. The reference
  // forms Delta in float64 from the stored O and returns the exact zeros (a float32 backward
  // returns rounding noise here; the catalogue widens this window to (0, 1)).
  problem_shape s;
  s.Lq = 30, s.Lk = 20, s.window_left = 0, s.window_right = 0;
  run_and_check(s, 7, {8, 8});
}

TEST_CASE("tiled backward: random problems at random tiles", "[backward]") {
  for (const catalogue_case& c : flashref::test::random_cases(0, 60)) {
    const flashref::reference::tile_shape tile{1 + std::int64_t(c.seed % 17),
                                               1 + std::int64_t((c.seed * 7) % 33)};
    CAPTURE(tile.q, tile.k);
    flashref::test::check_backward_case(flashref::test::for_backward(c), tiled_forward,
                                        tiled_backward(tile));
  }
}

TEST_CASE("tiled backward: results do not depend on its tile sizes", "[backward]") {
  problem_shape s;
  s.B = 1, s.Hq = 2, s.Lq = 41, s.Lk = 67, s.D = 8, s.Dv = 8, s.block_q = 5, s.block_k = 13;
  s.causal = causal_mode::bottom_right;
  problem_data a = random_problem(s, 11);
  flashref::reference::tiled_attention(a.problem());
  add_upstream_gradient(a, 11);
  problem_data b = a;
  flashref::reference::tiled_attention_backward(a.problem(), a.gradients(), {1, 1});
  flashref::reference::tiled_attention_backward(b.problem(), b.gradients(), {64, 64});
  for (std::size_t n = 0; n < a.dq.size(); ++n)
    REQUIRE(a.dq.data()[n] == Approx(b.dq.data()[n]).margin(1e-6));
  for (std::size_t n = 0; n < a.dk.size(); ++n)
    REQUIRE(a.dk.data()[n] == Approx(b.dk.data()[n]).margin(1e-6));
  for (std::size_t n = 0; n < a.dv.size(); ++n)
    REQUIRE(a.dv.data()[n] == Approx(b.dv.data()[n]).margin(1e-6));
}

TEST_CASE("tiled backward: a wrong dQ, an empty row's dQ or an unseen key's dK is caught",
          "[backward]") {
  problem_shape s;
  s.Lq = 10, s.Lk = 6, s.causal = causal_mode::bottom_right;
  problem_data d = random_problem(s, 13);
  flashref::reference::tiled_attention(d.problem());
  add_upstream_gradient(d, 13);
  flashref::reference::tiled_attention_backward(d.problem(), d.gradients());
  REQUIRE(check_backward_against_naive(d).pass());
  SECTION("a finite error in a visible row") {
    d.dq.data()[9 * 4] += 1e-2f;
    const auto r = check_backward_against_naive(d);
    REQUIRE(r.dq.bad_elements == 1);
    REQUIRE(r.dk.pass());
  }
  SECTION("NaN in an empty row (unguarded exp(-inf - (-inf)))") {
    d.dq.data()[0] = NAN;  // row 0 is empty: Lq - Lk = 4 top rows see nothing
    const auto r = check_backward_against_naive(d);
    REQUIRE(r.dq.zero_rows == 4);
    REQUIRE(r.dq.zero_rows_nan == 1);
  }
  SECTION("a non-zero dQ in an empty row") {
    d.dq.data()[1] = 1e-30f;
    REQUIRE(check_backward_against_naive(d).dq.zero_rows_nonzero == 1);
  }
  SECTION("an empty row's contribution to dK of a key it cannot see") {
    problem_shape t = s;
    t.Lq = 3, t.Lk = 8;
    t.causal = causal_mode::top_left;  // row i sees keys j <= i: keys 3..7 are seen by no row
    problem_data e = random_problem(t, 14);
    flashref::reference::tiled_attention(e.problem());
    add_upstream_gradient(e, 14);
    flashref::reference::tiled_attention_backward(e.problem(), e.gradients());
    REQUIRE(check_backward_against_naive(e).pass());
    e.dk.data()[7 * 4 + 2] = 1e-20f;
    const auto r = check_backward_against_naive(e);
    REQUIRE(r.dk.zero_rows == 5);
    REQUIRE(r.dk.zero_rows_nonzero == 1);
  }
}

TEST_CASE("backward: validation names the field", "[backward]") {
  problem_shape s;
  problem_data d = random_problem(s, 15);
  add_upstream_gradient(d, 15);
  flashref::attention_gradients g = d.gradients();
  g.dk.shape[2] = 7;
  REQUIRE_THROWS_WITH(flashref::reference::tiled_attention_backward(d.problem(), g),
                      "dk: expected shape [1, 1, 8, 4], got [1, 1, 7, 4]");
  flashref::attention_problem p = d.problem();
  p.lse.data = nullptr;
  REQUIRE_THROWS_WITH(flashref::reference::tiled_attention_backward(p, d.gradients()),
                      Catch::Contains("lse: expected the forward's LSE"));
}
