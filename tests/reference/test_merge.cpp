// merge_partials (SPEC §5): splitting the keys anywhere and merging equals the unsplit result;
// (0, -inf) is the identity; two empty parts merge to (0, -inf).
#include <catch2/catch.hpp>

#include <cmath>

#include "flashref/reference/merge.hpp"
#include "flashref/reference/spec.hpp"
#include "flashref/testdata/random.hpp"

using flashref::reference::one_shot_softmax_dot;
using flashref::reference::spec_result;

namespace {

spec_result part(const xt::xtensor<double, 1>& q, const xt::xtensor<double, 2>& K,
                 const xt::xtensor<double, 2>& V, const xt::xtensor<std::uint8_t, 1>& mask,
                 std::size_t k0, std::size_t k1) {
  const std::size_t Lk = K.shape(0);
  xt::xtensor<std::uint8_t, 1> sub = xt::zeros<std::uint8_t>({Lk});
  for (std::size_t j = k0; j < k1; ++j)
    sub(j) = mask(j);
  return one_shot_softmax_dot(q, K, V, sub);
}

}  // namespace

TEST_CASE("merge: splitting keys at random points and merging equals unsplit", "[merge]") {
  const std::uint64_t seed = GENERATE(range(0, 40));
  CAPTURE(seed);
  const flashref::testdata::counter_rng r(seed, 30);
  std::uint64_t n = 0;
  const std::size_t Lk = 1 + std::size_t(r.uniform(n++) * 40), D = 4, Dv = 3;
  xt::xtensor<double, 1> q = xt::zeros<double>({D});
  xt::xtensor<double, 2> K = xt::zeros<double>({Lk, D}), V = xt::zeros<double>({Lk, Dv});
  for (auto& x : q)
    x = r.normal(n++);
  for (auto& x : K)
    x = 3.0 * r.normal(n++);
  for (auto& x : V)
    x = r.normal(n++);
  xt::xtensor<std::uint8_t, 1> mask = xt::zeros<std::uint8_t>({Lk});
  const double density = r.uniform(n++);
  for (auto& m : mask)
    m = r.uniform(n++) < density;

  const spec_result whole = one_shot_softmax_dot(q, K, V, mask);
  // Three cut points: four parts, merged left to right and in a tree; both must agree.
  std::size_t cut[5] = {0, 0, 0, 0, Lk};
  for (int c = 1; c < 4; ++c)
    cut[c] = std::size_t(r.uniform(n++) * double(Lk + 1));
  std::sort(cut, cut + 5);
  std::vector<spec_result> parts;
  for (int c = 0; c < 4; ++c)
    parts.push_back(part(q, K, V, mask, cut[c], cut[c + 1]));

  std::vector<double> o(parts[0].out.begin(), parts[0].out.end());
  double lse = parts[0].lse;
  for (int c = 1; c < 4; ++c)
    lse = flashref::merge_partials(o.data(), lse, parts[c].out.data(), parts[c].lse, Dv, o.data());

  std::vector<double> left(Dv), right(Dv), tree(Dv);
  const double l = flashref::merge_partials(parts[0].out.data(), parts[0].lse, parts[1].out.data(),
                                            parts[1].lse, Dv, left.data());
  const double rr = flashref::merge_partials(parts[2].out.data(), parts[2].lse, parts[3].out.data(),
                                             parts[3].lse, Dv, right.data());
  const double t = flashref::merge_partials(left.data(), l, right.data(), rr, Dv, tree.data());

  if (whole.lse == -INFINITY) {
    REQUIRE(lse == -INFINITY);
    REQUIRE(t == -INFINITY);
  } else {
    REQUIRE(lse == Approx(whole.lse).margin(1e-12));
    REQUIRE(t == Approx(whole.lse).margin(1e-12));
  }
  for (std::size_t d = 0; d < Dv; ++d) {
    REQUIRE(o[d] == Approx(whole.out(d)).margin(1e-12));
    REQUIRE(tree[d] == Approx(whole.out(d)).margin(1e-12));
  }
}

TEST_CASE("merge: (0, -inf) is the identity", "[merge]") {
  const double oa[3] = {0.25, -1.5, 3.0};
  const double empty[3] = {0, 0, 0};
  double o[3];
  REQUIRE(flashref::merge_partials(oa, 1.75, empty, -INFINITY, 3, o) == 1.75);
  for (int d = 0; d < 3; ++d)
    REQUIRE(o[d] == oa[d]);
  REQUIRE(flashref::merge_partials(empty, -INFINITY, oa, 1.75, 3, o) == 1.75);
  for (int d = 0; d < 3; ++d)
    REQUIRE(o[d] == oa[d]);
}

TEST_CASE("merge: two empty parts give (0, -inf), never NaN", "[merge]") {
  const float e[2] = {0, 0};
  float o[2] = {NAN, NAN};
  REQUIRE(flashref::merge_partials(e, -INFINITY, e, -INFINITY, 2, o) == -INFINITY);
  REQUIRE(o[0] == 0.0f);
  REQUIRE(o[1] == 0.0f);
}

TEST_CASE("merge: extreme LSE gaps do not overflow", "[merge]") {
  const double a[1] = {1.0}, b[1] = {2.0};
  double o[1];
  const double lse = flashref::merge_partials(a, 1e4, b, -1e4, 1, o);
  REQUIRE(lse == Approx(1e4));
  REQUIRE(o[0] == Approx(1.0));
}

TEST_CASE("merge: whole tensors, and shape errors name the field", "[merge]") {
  flashref::partial_result<float> a{xt::ones<float>({1, 2, 3, 4}), xt::zeros<float>({1, 2, 3})};
  flashref::partial_result<float> b{xt::zeros<float>({1, 2, 3, 4}), xt::zeros<float>({1, 2, 3})};
  b.lse(0, 1, 2) = -INFINITY;
  const auto m = flashref::merge_partials(a, b);
  REQUIRE(m.o(0, 0, 0, 0) == Approx(0.5f));
  REQUIRE(m.lse(0, 0, 0) == Approx(std::log(2.0f)));
  REQUIRE(m.o(0, 1, 2, 3) == 1.0f);  // merged with an empty part: unchanged
  REQUIRE(m.lse(0, 1, 2) == 0.0f);
  flashref::partial_result<float> c{xt::zeros<float>({1, 2, 3, 5}), xt::zeros<float>({1, 2, 3})};
  REQUIRE_THROWS_WITH(flashref::merge_partials(a, c),
                      "o: expected shape [1, 2, 3, 4], got [1, 2, 3, 5]");
}
