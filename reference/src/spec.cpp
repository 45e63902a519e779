#include "flashref/reference/spec.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "flashref/reference/online_softmax.hpp"
#include "flashref/reference/problem.hpp"

namespace flashref::reference {

namespace {

// Preconditions shared by the spec function, its one-shot twin and the teaching variants.
void check_inputs(const xt::xtensor<double, 1>& q, const xt::xtensor<double, 2>& K,
                  const xt::xtensor<double, 2>& V, std::int64_t tile,
                  const xt::xtensor<std::uint8_t, 1>& key_mask) {
  auto n = [](std::size_t x) { return std::to_string(x); };
  if (K.shape(1) != q.shape(0))  // q.k needs matching head dims
    throw problem_error("K: expected " + n(q.shape(0)) + " columns (the size of q), got " +
                        n(K.shape(1)));
  if (V.shape(0) != K.shape(0))  // one value row per key
    throw problem_error("V: expected " + n(K.shape(0)) + " rows (one per key), got " +
                        n(V.shape(0)));
  if (key_mask.size() != 0 && key_mask.size() != K.shape(0))  // one flag per key, or none
    throw problem_error("key_mask: expected " + n(K.shape(0)) + " entries (or none), got " +
                        n(key_mask.size()));
  if (tile <= 0) throw problem_error("tile: expected a positive size, got " + std::to_string(tile));
}

// scale * q.K[j], or -inf when key j is masked.
double score_of(const xt::xtensor<double, 1>& q, const xt::xtensor<double, 2>& K,
                const xt::xtensor<std::uint8_t, 1>& key_mask, std::size_t j, double scale) {
  if (key_mask.size() != 0 && key_mask(j) == 0) return -INFINITY;
  double dot = 0.0;
  for (std::size_t d = 0; d < q.shape(0); ++d)
    dot += q(d) * K(j, d);
  return scale * dot;
}

// out += p * V[j] (a plain loop: the spec function runs once per row in the demo).
void add_scaled_row(xt::xtensor<double, 1>& out, double p, const xt::xtensor<double, 2>& V,
                    std::size_t j) {
  for (std::size_t d = 0; d < out.size(); ++d)
    out(d) += p * V(j, d);
}

}  // namespace

spec_result tiled_softmax_dot(const xt::xtensor<double, 1>& q, const xt::xtensor<double, 2>& K,
                              const xt::xtensor<double, 2>& V, std::int64_t tile,
                              const xt::xtensor<std::uint8_t, 1>& key_mask, double scale) {
  check_inputs(q, K, V, tile, key_mask);
  const std::size_t Lk = K.shape(0), Dv = V.shape(1);
  spec_result res;
  online_softmax<double> st;                             // running m and s
  xt::xtensor<double, 1> out = xt::zeros<double>({Dv});  // Σ exp(score_j - m) v_j

  for (std::size_t k0 = 0, t = 0; k0 < Lk; k0 += std::size_t(tile), ++t) {
    const std::size_t k1 = std::min(k0 + std::size_t(tile), Lk);
    spec_step step;
    step.tile = std::int64_t(t);
    step.k0 = std::int64_t(k0);
    step.k1 = std::int64_t(k1);
    double block_max = -INFINITY;
    for (std::size_t j = k0; j < k1; ++j) {
      step.scores.push_back(score_of(q, K, key_mask, j, scale));
      block_max = std::max(block_max, step.scores.back());
    }
    step.all_masked = block_max == -INFINITY;

    step.m_old = st.m;
    const double exp_old =
        st.update_max(block_max);  // exp(m_old - m_new); 0 on the first visible tile
    out *= exp_old;                // earlier terms, re-expressed against m_new
    st.rescale(exp_old);
    double p_sum = 0.0;
    for (std::size_t j = k0; j < k1; ++j) {
      if (step.scores[j - k0] == -INFINITY) continue;  // masked: its value is never read
      const double p = st.prob(step.scores[j - k0]);   // exp(score_j - m_new)
      p_sum += p;
      add_scaled_row(out, p, V, j);  // out += p * V[j]
    }
    st.absorb(p_sum);

    step.m_new = st.m;
    step.exp_old = exp_old;
    step.s = st.s;
    step.out.assign(out.begin(), out.end());
    res.trace.push_back(std::move(step));
  }
  const finalized<double> fin = st.finalize();  // the one final division: out / s, or 0
  res.out = out * fin.out_scale;
  res.lse = fin.lse;
  return res;
}

spec_result one_shot_softmax_dot(const xt::xtensor<double, 1>& q, const xt::xtensor<double, 2>& K,
                                 const xt::xtensor<double, 2>& V,
                                 const xt::xtensor<std::uint8_t, 1>& key_mask, double scale) {
  check_inputs(q, K, V, 1, key_mask);
  const std::size_t Lk = K.shape(0), Dv = V.shape(1);
  std::vector<double> scores(Lk);
  double mx = -INFINITY;
  for (std::size_t j = 0; j < Lk; ++j) {
    scores[j] = score_of(q, K, key_mask, j, scale);
    mx = std::max(mx, scores[j]);
  }
  spec_result res;
  res.out = xt::zeros<double>({Dv});
  if (mx == -INFINITY) {  // no visible key
    res.lse = -INFINITY;
    return res;
  }
  double sum = 0.0;
  for (std::size_t j = 0; j < Lk; ++j)
    sum += std::exp(scores[j] - mx);
  for (std::size_t j = 0; j < Lk; ++j) {
    add_scaled_row(res.out, std::exp(scores[j] - mx) / sum, V, j);
  }
  res.lse = mx + std::log(sum);
  return res;
}

namespace teaching {

namespace {

// The lesson's loop exactly as first written: no guard. With patch_division, the final
// division is skipped when s == 0 (the popular patch).
spec_result broken_loop(const xt::xtensor<double, 1>& q, const xt::xtensor<double, 2>& K,
                        const xt::xtensor<double, 2>& V, std::int64_t tile,
                        const xt::xtensor<std::uint8_t, 1>& key_mask, double scale,
                        bool patch_division) {
  check_inputs(q, K, V, tile, key_mask);
  const std::size_t Lk = K.shape(0), Dv = V.shape(1);
  spec_result res;
  double m = -INFINITY, s = 0.0;
  xt::xtensor<double, 1> out = xt::zeros<double>({Dv});
  for (std::size_t k0 = 0, t = 0; k0 < Lk; k0 += std::size_t(tile), ++t) {
    const std::size_t k1 = std::min(k0 + std::size_t(tile), Lk);
    spec_step step;
    step.tile = std::int64_t(t);
    step.k0 = std::int64_t(k0);
    step.k1 = std::int64_t(k1);
    double m_new = m;
    for (std::size_t j = k0; j < k1; ++j) {
      step.scores.push_back(score_of(q, K, key_mask, j, scale));
      m_new = std::max(m_new, step.scores.back());
    }
    step.all_masked = std::all_of(step.scores.begin(), step.scores.end(),
                                  [](double x) { return x == -INFINITY; });
    const double exp_old = std::exp(m - m_new);  // NaN when m == m_new == -inf
    s *= exp_old;
    out *= exp_old;
    for (std::size_t j = k0; j < k1; ++j) {
      const double p = std::exp(step.scores[j - k0] - m_new);  // NaN when both are -inf
      s += p;
      add_scaled_row(out, p, V, j);  // out += p * V[j]
    }
    step.m_old = m;
    step.m_new = m_new;
    step.exp_old = exp_old;
    step.s = s;
    step.out.assign(out.begin(), out.end());
    res.trace.push_back(std::move(step));
    m = m_new;
  }
  if (patch_division && s == 0.0) {
    res.out = xt::zeros<double>({Dv});  // the patch: "if s == 0 write 0"
    res.lse = -INFINITY;
  } else {
    res.out = out / s;  // 0 / 0 = NaN for an empty sum
    res.lse = m + std::log(s);
  }
  return res;
}

}  // namespace

spec_result tiled_softmax_dot_unguarded(const xt::xtensor<double, 1>& q,
                                        const xt::xtensor<double, 2>& K,
                                        const xt::xtensor<double, 2>& V, std::int64_t tile,
                                        const xt::xtensor<std::uint8_t, 1>& key_mask,
                                        double scale) {
  return broken_loop(q, K, V, tile, key_mask, scale, /*patch_division=*/false);
}

spec_result tiled_softmax_dot_patched(const xt::xtensor<double, 1>& q,
                                      const xt::xtensor<double, 2>& K,
                                      const xt::xtensor<double, 2>& V, std::int64_t tile,
                                      const xt::xtensor<std::uint8_t, 1>& key_mask, double scale) {
  return broken_loop(q, K, V, tile, key_mask, scale, /*patch_division=*/true);
}

}  // namespace teaching
}  // namespace flashref::reference
