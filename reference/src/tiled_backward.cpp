// The scalar tiled backward in the FlashAttention-2 order (Dao 2023, Algorithm 2): Delta for
// every row first, then for each key tile the query tiles that see it. P is never stored: each
// (query tile, key tile) pair recomputes it from the stored LSE, through the online-softmax
// state's guard (a finished row is the state m = LSE, s = 1).
#include <algorithm>
#include <cmath>
#include <vector>

#include "flashref/reference/backward.hpp"
#include "flashref/reference/mask.hpp"
#include "flashref/reference/online_softmax.hpp"

namespace flashref::reference {

void tiled_attention_backward(const attention_problem& p, const attention_gradients& g,
                              tile_shape tile) {
  validate_backward(p, g);
  if (tile.q <= 0 || tile.k <= 0) {
    throw problem_error("tile: expected positive sizes, got [" + std::to_string(tile.q) + ", " +
                        std::to_string(tile.k) + "]");
  }
  const std::int64_t B = p.batch(), Hq = p.heads_q(), Hk = p.heads_k();
  const std::int64_t Lq = p.len_q(), Lk = p.len_k(), D = p.head_dim(), Dv = p.head_dim_v();
  const std::int64_t group = p.group_size();
  const double scale = p.softmax_scale();
  const mask_spec mask = make_mask_spec(p);

  // Delta_i = Σ_d dO_id O_id: one dot product per row instead of Σ_j P_ij dP_ij over keys.
  std::vector<double> delta(std::size_t(B * Hq * Lq));  // (B, Hq, Lq)
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t i = 0; i < Lq; ++i) {
        double s = 0.0;
        for (std::int64_t d = 0; d < Dv; ++d)
          s += double(g.d_o(b, h, i, d)) * double(p.o(b, h, i, d));
        delta[std::size_t((b * Hq + h) * Lq + i)] = s;
      }

  std::vector<double> dq(std::size_t(B * Hq * Lq * D), 0.0);  // (B, Hq, Lq, D)
  std::vector<double> dk(std::size_t(tile.k * D));            // (tile.k, D)
  std::vector<double> dv(std::size_t(tile.k * Dv));           // (tile.k, Dv)

  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t hk = 0; hk < Hk; ++hk) {
      for (std::int64_t k0 = 0; k0 < Lk; k0 += tile.k) {
        const std::int64_t k1 = std::min(k0 + tile.k, Lk), nk = k1 - k0;
        std::fill(dk.begin(), dk.end(), 0.0);
        std::fill(dv.begin(), dv.end(), 0.0);
        // GQA/MQA: every query head of the group adds to this key tile's dK, dV.
        for (std::int64_t h = hk * group; h < (hk + 1) * group; ++h) {
          for (std::int64_t q0 = 0; q0 < Lq; q0 += tile.q) {
            const std::int64_t q1 = std::min(q0 + tile.q, Lq);
            const tile_class cls = mask.classify(b, h, q0, q1, k0, k1);
            if (cls == tile_class::empty) continue;  // no query of the tile sees a key of it
            const bool element_mask = cls == tile_class::partial;
            for (std::int64_t i = q0; i < q1; ++i) {
              // The finished row i: P_ij = exp(S_ij - LSE_i), 0 for a masked key.
              const online_softmax<double> row = online_softmax<double>::from_lse(p.lse(b, h, i));
              const double delta_i = delta[std::size_t((b * Hq + h) * Lq + i)];
              double* dq_i = dq.data() + ((b * Hq + h) * Lq + i) * D;
              for (std::int64_t j = k0; j < k1; ++j) {
                if (element_mask && !mask.visible(b, h, i, j)) continue;  // P_ij = 0 exactly
                double s = 0.0;
                for (std::int64_t d = 0; d < D; ++d)
                  s += double(p.q(b, h, i, d)) * double(p.k(b, hk, j, d));
                const double p_ij = row.prob(scale * s);
                double dp = 0.0;  // dP_ij = dO_i · V_j
                for (std::int64_t d = 0; d < Dv; ++d)
                  dp += double(g.d_o(b, h, i, d)) * double(p.v(b, hk, j, d));
                const double ds = p_ij * (dp - delta_i);  // dS_ij = P_ij (dP_ij - Delta_i)
                double* dk_j = dk.data() + (j - k0) * D;
                double* dv_j = dv.data() + (j - k0) * Dv;
                for (std::int64_t d = 0; d < D; ++d) {
                  dq_i[d] += ds * double(p.k(b, hk, j, d));  // dQ_i += dS_ij K_j
                  dk_j[d] += ds * double(p.q(b, h, i, d));   // dK_j += dS_ij Q_i
                }
                for (std::int64_t d = 0; d < Dv; ++d)
                  dv_j[d] += p_ij * double(g.d_o(b, h, i, d));  // dV_j += P_ij dO_i
              }
            }
          }
        }
        // The key tile is finished: every query that sees it has been visited.
        for (std::int64_t c = 0; c < nk; ++c) {
          for (std::int64_t d = 0; d < D; ++d)
            g.dk(b, hk, k0 + c, d) = float(scale * dk[std::size_t(c * D + d)]);
          for (std::int64_t d = 0; d < Dv; ++d)
            g.dv(b, hk, k0 + c, d) = float(dv[std::size_t(c * Dv + d)]);
        }
      }
    }
  }
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t i = 0; i < Lq; ++i)
        for (std::int64_t d = 0; d < D; ++d)
          g.dq(b, h, i, d) = float(scale * dq[std::size_t(((b * Hq + h) * Lq + i) * D + d)]);
}

}  // namespace flashref::reference
