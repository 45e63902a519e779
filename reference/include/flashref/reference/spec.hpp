#pragma once
// The spec function of SPEC §4: one query against K and V in tiles, in the lesson's shape —
// a running max m, a running sum s, an unnormalised output, the rescale factor exp_old and one
// final division. It returns softmax(scale * q K^T) V on any input, including a fully masked
// first tile and a row with no visible key.
//
// Next to it, in namespace teaching, live its two broken twins. They are teaching material,
// kept so that the walkthrough and the tests can show exactly where each one fails.

#include <cstdint>
#include <vector>

#include <xtensor/xtensor.hpp>

namespace flashref::reference {

// What one tile did to the state (recorded for the teaching trace and the fixtures).
struct spec_step {
  std::int64_t tile = 0;        // tile index
  std::int64_t k0 = 0, k1 = 0;  // keys [k0, k1)
  std::vector<double> scores;   // scale * q.k_j, -inf where masked
  bool all_masked = false;      // no visible key in this tile
  double m_old = 0, m_new = 0;  // running max before and after the tile
  double exp_old = 0;           // exp(m_old - m_new): the factor applied to s and out
  double s = 0;                 // running sum after the tile
  std::vector<double> out;      // unnormalised output after the tile, relative to m_new
};

struct spec_result {
  xt::xtensor<double, 1> out;  // (Dv)
  double lse = 0;              // natural log; -inf when no key is visible
  std::vector<spec_step> trace;
};

// q: (D), K: (Lk, D), V: (Lk, Dv), key_mask: (Lk) non-zero = visible, or empty = all visible.
spec_result tiled_softmax_dot(const xt::xtensor<double, 1>& q, const xt::xtensor<double, 2>& K,
                              const xt::xtensor<double, 2>& V, std::int64_t tile = 4,
                              const xt::xtensor<std::uint8_t, 1>& key_mask = {},
                              double scale = 1.0);

// The one-shot softmax(scale * q K^T) V over the visible keys, in float64 (no tiles).
spec_result one_shot_softmax_dot(const xt::xtensor<double, 1>& q, const xt::xtensor<double, 2>& K,
                                 const xt::xtensor<double, 2>& V,
                                 const xt::xtensor<std::uint8_t, 1>& key_mask = {},
                                 double scale = 1.0);

namespace teaching {

// BROKEN ON PURPOSE. The loop without the -inf guard: a fully masked first tile makes
// m_new = -inf and exp(-inf - (-inf)) = NaN, which poisons s and out for the rest of the row;
// a row with no tile at all ends in 0 / 0 = NaN.
spec_result tiled_softmax_dot_unguarded(const xt::xtensor<double, 1>& q,
                                        const xt::xtensor<double, 2>& K,
                                        const xt::xtensor<double, 2>& V, std::int64_t tile = 4,
                                        const xt::xtensor<std::uint8_t, 1>& key_mask = {},
                                        double scale = 1.0);

// BROKEN ON PURPOSE. The unguarded loop plus the patch "divide only if s != 0, else write 0".
// It mends the row whose sum is exactly 0 (no tile was visited), but not a fully masked tile
// seen before the max is finite: by the time the check runs, s is already NaN.
spec_result tiled_softmax_dot_patched(const xt::xtensor<double, 1>& q,
                                      const xt::xtensor<double, 2>& K,
                                      const xt::xtensor<double, 2>& V, std::int64_t tile = 4,
                                      const xt::xtensor<std::uint8_t, 1>& key_mask = {},
                                      double scale = 1.0);

}  // namespace teaching
}  // namespace flashref::reference
