// The golden backward: P materialised per (batch, query head) from a three-pass float64
// softmax, then the five products of SPEC §9 written out as plain loops. Like naive.cpp it
// restates the visibility rule instead of sharing mask.hpp, and it never reads the forward's
// stored O or LSE: Delta comes from Σ_j P_ij dP_ij, so the golden value does not inherit an
// error of the forward it checks.
#include <cmath>
#include <limits>

#include "flashref/reference/backward.hpp"

namespace flashref::reference {

namespace {

bool naive_visible(const attention_problem& p, std::int64_t b, std::int64_t h, std::int64_t i,
                   std::int64_t j) {
  // How far key j lies right of query i's bottom-right diagonal, compared with the window
  // sizes as a distance: added to them it overflowed for windows near 2^63 (found by fuzzing).
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

golden_gradients naive_attention_backward(const attention_problem& p,
                                          const strided<const float, 4>& d_o) {
  validate_inputs(p);
  const std::int64_t B = p.batch(), Hq = p.heads_q(), Hk = p.heads_k();
  const std::int64_t Lq = p.len_q(), Lk = p.len_k(), D = p.head_dim(), Dv = p.head_dim_v();
  if (d_o.shape != std::array<std::int64_t, 4>{B, Hq, Lq, Dv}) {
    throw problem_error("d_o: expected shape [" + std::to_string(B) + ", " + std::to_string(Hq) +
                        ", " + std::to_string(Lq) + ", " + std::to_string(Dv) + "], got [" +
                        std::to_string(d_o.shape[0]) + ", " + std::to_string(d_o.shape[1]) + ", " +
                        std::to_string(d_o.shape[2]) + ", " + std::to_string(d_o.shape[3]) + "]");
  }
  const std::int64_t group = p.group_size();
  const double scale = p.softmax_scale();
  const double kInf = std::numeric_limits<double>::infinity();

  golden_gradients g;
  g.q_shape = {B, Hq, Lq, D};
  g.k_shape = {B, Hk, Lk, D};
  g.v_shape = {B, Hk, Lk, Dv};
  g.dq.assign(std::size_t(B * Hq * Lq * D), 0.0);
  g.dk.assign(std::size_t(B * Hk * Lk * D), 0.0);
  g.dv.assign(std::size_t(B * Hk * Lk * Dv), 0.0);
  g.row_empty.assign(std::size_t(B * Hq * Lq), 1);
  g.key_unseen.assign(std::size_t(B * Hk * Lk), 1);

  std::vector<double> P(std::size_t(Lq * Lk));   // (Lq, Lk) softmax, 0 where masked
  std::vector<double> dS(std::size_t(Lq * Lk));  // (Lq, Lk)
  std::vector<char> vis(std::size_t(Lq * Lk));   // (Lq, Lk)

  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t hk = h / group;
      // P: scores, row max, exp-sum, normalise — the forward's three passes.
      for (std::int64_t i = 0; i < Lq; ++i) {
        double* prow = P.data() + i * Lk;
        char* vrow = vis.data() + i * Lk;
        double mx = -kInf;
        bool any = false;
        for (std::int64_t j = 0; j < Lk; ++j) {
          prow[j] = 0.0;
          vrow[j] = naive_visible(p, b, h, i, j);
          if (!vrow[j]) continue;
          double dot = 0.0;
          for (std::int64_t d = 0; d < D; ++d)
            dot += double(p.q(b, h, i, d)) * double(p.k(b, hk, j, d));
          prow[j] = scale * dot;
          if (!any || prow[j] > mx || std::isnan(prow[j])) mx = prow[j];
          any = true;
          g.key_unseen[std::size_t((b * Hk + hk) * Lk + j)] = 0;
        }
        if (!any) continue;  // empty row: P = 0
        g.row_empty[std::size_t((b * Hq + h) * Lq + i)] = 0;
        double sum = 0.0;
        for (std::int64_t j = 0; j < Lk; ++j)
          if (vrow[j]) sum += std::exp(prow[j] - mx);
        for (std::int64_t j = 0; j < Lk; ++j)
          prow[j] = vrow[j] ? std::exp(prow[j] - mx) / sum : 0.0;
      }
      // dP = dO V^T, Delta = Σ_j P dP, dS = P (dP - Delta) on the visible pairs.
      for (std::int64_t i = 0; i < Lq; ++i) {
        double delta = 0.0;
        for (std::int64_t j = 0; j < Lk; ++j) {
          double dp = 0.0;
          if (vis[std::size_t(i * Lk + j)]) {
            for (std::int64_t d = 0; d < Dv; ++d)
              dp += double(d_o(b, h, i, d)) * double(p.v(b, hk, j, d));
          }
          dS[std::size_t(i * Lk + j)] = dp;
          if (vis[std::size_t(i * Lk + j)]) delta += P[std::size_t(i * Lk + j)] * dp;
        }
        for (std::int64_t j = 0; j < Lk; ++j) {
          const std::size_t at = std::size_t(i * Lk + j);
          dS[at] = vis[at] ? P[at] * (dS[at] - delta) : 0.0;
        }
      }
      // dQ = scale dS K, dK += scale dS^T Q, dV += P^T dO (the group's heads summed).
      for (std::int64_t i = 0; i < Lq; ++i) {
        double* dq = g.dq.data() + ((b * Hq + h) * Lq + i) * D;
        for (std::int64_t j = 0; j < Lk; ++j) {
          const std::size_t at = std::size_t(i * Lk + j);
          if (!vis[at]) continue;
          double* dk = g.dk.data() + ((b * Hk + hk) * Lk + j) * D;
          double* dv = g.dv.data() + ((b * Hk + hk) * Lk + j) * Dv;
          for (std::int64_t d = 0; d < D; ++d) {
            dq[d] += scale * dS[at] * double(p.k(b, hk, j, d));
            dk[d] += scale * dS[at] * double(p.q(b, h, i, d));
          }
          for (std::int64_t d = 0; d < Dv; ++d)
            dv[d] += P[at] * double(d_o(b, h, i, d));
        }
      }
    }
  }
  return g;
}

}  // namespace flashref::reference
