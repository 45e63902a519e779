#include "flashref/reference/tiled.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "flashref/reference/mask.hpp"
#include "flashref/reference/online_softmax.hpp"

namespace flashref::reference {

void tiled_attention(const attention_problem& p, tile_shape tile) {
  validate(p);
  if (tile.q <= 0 || tile.k <= 0) {
    throw problem_error("tile: expected positive sizes, got [" + std::to_string(tile.q) + ", " +
                        std::to_string(tile.k) + "]");
  }
  const std::int64_t B = p.batch(), Hq = p.heads_q(), Lq = p.len_q(), Lk = p.len_k();
  const std::int64_t D = p.head_dim(), Dv = p.head_dim_v();
  const double scale = p.softmax_scale();
  const mask_spec mask = make_mask_spec(p);

  std::vector<online_softmax<double>> state(std::size_t(tile.q));  // (tile.q)
  std::vector<double> acc(std::size_t(tile.q * Dv));               // (tile.q, Dv)
  std::vector<double> score(std::size_t(tile.q * tile.k));         // (tile.q, tile.k)

  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t hk = h / p.group_size();
      for (std::int64_t q0 = 0; q0 < Lq; q0 += tile.q) {
        const std::int64_t q1 = std::min(q0 + tile.q, Lq);
        const std::int64_t nq = q1 - q0;
        std::fill(state.begin(), state.end(), online_softmax<double>{});
        std::fill(acc.begin(), acc.end(), 0.0);

        for (std::int64_t k0 = 0; k0 < Lk; k0 += tile.k) {
          const std::int64_t k1 = std::min(k0 + tile.k, Lk);
          const std::int64_t nk = k1 - k0;
          const tile_class cls = mask.classify(b, h, q0, q1, k0, k1);
          if (cls == tile_class::empty) continue;  // skip: no visible key in this tile
          const bool element_mask = cls == tile_class::partial;

          for (std::int64_t r = 0; r < nq; ++r) {
            const std::int64_t i = q0 + r;
            double* s_row = score.data() + r * tile.k;  // (nk)
            // S = scale * Q K^T, masked keys at -inf.
            double block_max = -INFINITY;
            for (std::int64_t c = 0; c < nk; ++c) {
              const std::int64_t j = k0 + c;
              if (element_mask && !mask.visible(b, h, i, j)) {
                s_row[c] = -INFINITY;
                continue;
              }
              double dot = 0.0;
              for (std::int64_t d = 0; d < D; ++d)
                dot += double(p.q(b, h, i, d)) * double(p.k(b, hk, j, d));
              s_row[c] = scale * dot;
              block_max = std::max(block_max, s_row[c]);
            }
            // acc = acc * exp(m_old - m_new) + Σ_j exp(s_j - m_new) v_j
            online_softmax<double>& st = state[std::size_t(r)];
            double* a_row = acc.data() + r * Dv;
            const double exp_old = st.update_max(block_max);
            for (std::int64_t d = 0; d < Dv; ++d)
              a_row[d] *= exp_old;
            st.rescale(exp_old);
            double p_sum = 0.0;
            for (std::int64_t c = 0; c < nk; ++c) {
              if (s_row[c] == -INFINITY) continue;  // masked: its value is never read
              const double pj = st.prob(s_row[c]);
              p_sum += pj;
              for (std::int64_t d = 0; d < Dv; ++d)
                a_row[d] += pj * double(p.v(b, hk, k0 + c, d));
            }
            st.absorb(p_sum);
          }
        }
        for (std::int64_t r = 0; r < nq; ++r) {
          const finalized<double> fin = state[std::size_t(r)].finalize();
          for (std::int64_t d = 0; d < Dv; ++d) {
            p.o(b, h, q0 + r, d) = float(acc[std::size_t(r * Dv + d)] * fin.out_scale);
          }
          if (p.lse.data != nullptr) p.lse(b, h, q0 + r) = float(fin.lse);
        }
      }
    }
  }
}

}  // namespace flashref::reference
