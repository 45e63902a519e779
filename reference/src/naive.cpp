#include "flashref/reference/naive.hpp"

#include <cmath>
#include <limits>

#include "flashref/reference/limits.hpp"

namespace flashref::reference {

namespace {

// SPEC §2's visibility rule, restated here on purpose rather than shared with mask.hpp: the
// golden reference must not inherit a bug of the tiled paths.
bool naive_visible(const attention_problem& p, std::int64_t b, std::int64_t h, std::int64_t i,
                   std::int64_t j) {
  // How far key j lies right of query i's bottom-right diagonal. Compared with the window
  // sizes as a distance, never added to them: a window may be as wide as 2^63 - 1.
  const std::int64_t past_diagonal = j - i - (p.len_k() - p.len_q());
  if (p.causal == causal_mode::bottom_right && past_diagonal > 0) return false;
  if (p.causal == causal_mode::top_left && j > i) return false;
  if (p.window_left >= 0 && past_diagonal < -p.window_left) return false;
  if (p.window_right >= 0 && past_diagonal > p.window_right) return false;
  if (p.kv_len != nullptr && j >= p.kv_len[b]) return false;
  if (p.has_block_mask()) {
    const std::int64_t mb = p.block_mask.shape[0] == 1 ? 0 : b;
    const std::int64_t mh = p.block_mask.shape[1] == 1 ? 0 : h;
    if (p.block_mask(mb, mh, i / p.block_q, j / p.block_k) == 0) return false;
  }
  return true;
}

}  // namespace

golden naive_attention(const attention_problem& p) {
  validate_inputs(p);
  const std::int64_t B = p.batch(), Hq = p.heads_q(), Lq = p.len_q(), Lk = p.len_k();
  const std::int64_t D = p.head_dim(), Dv = p.head_dim_v();
  const std::int64_t group = p.group_size();
  const double scale = p.softmax_scale();
  const double kInf = std::numeric_limits<double>::infinity();

  // Golden O and LSE in float64, and one row's scores and visibility: checked before allocated.
  const auto o_lse = checked_product(
      {std::uint64_t(B), std::uint64_t(Hq), std::uint64_t(Lq), std::uint64_t(Dv) + 1, 8});
  const auto scores = checked_product({std::uint64_t(Lk), 9});
  check_allocation("reference: golden O and LSE",
                   o_lse && scores ? checked_sum({*o_lse, *scores}) : std::nullopt,
                   "float64 O (B, Hq, Lq, Dv), LSE (B, Hq, Lq) and a row of Lk scores");
  golden g;
  g.o_shape = {B, Hq, Lq, Dv};
  g.o.assign(std::size_t(B * Hq * Lq * Dv), 0.0);
  g.lse.assign(std::size_t(B * Hq * Lq), -kInf);
  std::vector<double> score(static_cast<std::size_t>(Lk));
  std::vector<char> vis(static_cast<std::size_t>(Lk));

  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t hk = h / group;
      for (std::int64_t i = 0; i < Lq; ++i) {
        const std::size_t row = std::size_t((b * Hq + h) * Lq + i);
        double* out = g.o.data() + row * std::size_t(Dv);
        // Pass 1: scores of the visible keys and their max.
        double mx = -kInf;
        bool any = false, nan = false;
        for (std::int64_t j = 0; j < Lk; ++j) {
          vis[j] = naive_visible(p, b, h, i, j);
          if (!vis[j]) continue;
          double dot = 0.0;
          for (std::int64_t d = 0; d < D; ++d)
            dot += double(p.q(b, h, i, d)) * double(p.k(b, hk, j, d));
          score[j] = scale * dot;
          any = true;
          if (std::isnan(score[j])) nan = true;
          if (score[j] > mx) mx = score[j];
        }
        if (!any) continue;  // no visible key: O = 0, LSE = -inf (already set)
        if (nan) {
          const double qnan = std::numeric_limits<double>::quiet_NaN();
          for (std::int64_t d = 0; d < Dv; ++d)
            out[d] = qnan;
          g.lse[row] = qnan;
          continue;
        }
        // Pass 2: the sum of exponentials relative to the max.
        double sum = 0.0;
        for (std::int64_t j = 0; j < Lk; ++j)
          if (vis[j]) sum += std::exp(score[j] - mx);
        // Pass 3: normalise and weight V.
        for (std::int64_t j = 0; j < Lk; ++j) {
          if (!vis[j]) continue;
          const double pj = std::exp(score[j] - mx) / sum;
          for (std::int64_t d = 0; d < Dv; ++d)
            out[d] += pj * double(p.v(b, hk, j, d));
        }
        g.lse[row] = mx + std::log(sum);
      }
    }
  }
  return g;
}

}  // namespace flashref::reference
