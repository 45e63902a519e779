// flashref explain --backward — one row of a fixture through the backward pass (SPEC §9): P
// recomputed from the stored LSE, Delta as a row sum over dO ∘ O, dS, and the row's dQ against
// the golden one; for an empty row, what each stored-LSE convention (-inf, +inf, 0) does to the
// recomputation exp(S - LSE).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "explain.hpp"
#include "flashref/reference/mask.hpp"
#include "flashref/reference/online_softmax.hpp"
#include "flashref/testdata/fixture.hpp"

namespace flashref::cli {

namespace {

std::string fmt(double x) {
  if (std::isnan(x)) return "NaN";
  if (x == INFINITY) return "+inf";
  if (x == -INFINITY) return "-inf";
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

// exp(s - lse) with no guard: what a kernel computes that trusts the stored LSE blindly.
double unguarded(double s, double lse) {
  return std::exp(s - lse);
}

}  // namespace

int run_explain_backward(const testdata::fixture& fx, std::int64_t b, std::int64_t h,
                         std::int64_t i) {
  if (!fx.grads)
    throw problem_error("--backward: expected a case with /inputs/do and /golden/dq, got " +
                        fx.name + " (" + fx.description + ")");
  problem_data in = fx.in;
  const attention_problem p = in.inputs();
  const testdata::spec_row row = testdata::spec_row_of(p, b, h, i);  // checks the row exists
  const attention_gradients g = in.gradients();
  const std::int64_t Lk = p.len_k(), D = p.head_dim(), Dv = p.head_dim_v();
  const std::int64_t Hq = p.heads_q(), Lq = p.len_q();
  const std::size_t r = std::size_t((b * Hq + h) * Lq + i);
  const double lse = fx.golden.lse[r];
  const double scale = row.scale;

  std::printf(
      "flashref explain --backward: %s row (%lld, %lld, %lld); %lld keys, D = %lld, "
      "Dv = %lld, scale %s\n",
      fx.name.c_str(), (long long)b, (long long)h, (long long)i, (long long)Lk, (long long)D,
      (long long)Dv, fmt(scale).c_str());
  std::printf(
      "stored LSE = %s: the finished row is the state m = LSE, s = 1, and P_j = "
      "exp(S_j - LSE) is its prob(S_j)\n\n",
      fmt(lse).c_str());

  // Scores as the forward saw them (masked keys at -inf) and the raw dot products.
  const std::size_t n = std::size_t(Lk);
  std::vector<double> s(n), raw(n), dp(n);
  for (std::int64_t j = 0; j < Lk; ++j) {
    double dot = 0.0;
    for (std::int64_t d = 0; d < D; ++d)
      dot += row.q(std::size_t(d)) * row.K(std::size_t(j), std::size_t(d));
    raw[std::size_t(j)] = scale * dot;
    s[std::size_t(j)] = row.key_mask(std::size_t(j)) ? raw[std::size_t(j)] : -INFINITY;
    double x = 0.0;  // dP_j = dO_i · V_j
    for (std::int64_t d = 0; d < Dv; ++d)
      x += double(g.d_o(b, h, i, d)) * row.V(std::size_t(j), std::size_t(d));
    dp[std::size_t(j)] = x;
  }

  if (lse == -INFINITY) {
    std::printf(
        "the row sees no key: every score is masked to -inf, its golden dQ is 0 and it "
        "adds nothing to dK, dV.\n");
    std::printf(
        "P_j = exp(S_j - LSE) under each convention for the stored LSE of an empty row "
        "(S masked: -inf; S raw: the unmasked scale q.k_j):\n\n");
    std::printf("%4s %10s | %-22s %-22s %-22s %s\n", "key", "S raw", "LSE -inf, unguarded",
                "LSE -inf, guarded", "LSE +inf (FA2)", "LSE 0 (torch CPU)");
    const double guard = online_softmax<double>::exp_base(-INFINITY);  // 0
    const std::int64_t shown = std::min<std::int64_t>(Lk, 6);
    for (std::int64_t j = 0; j < shown; ++j) {
      const double sr = raw[std::size_t(j)];
      auto both = [&](double lse_conv, bool guarded) {
        const double base = guarded ? guard : lse_conv;
        return fmt(unguarded(-INFINITY, base)) + " / " + fmt(unguarded(sr, base));
      };
      std::printf("%4lld %10s | %-22s %-22s %-22s %s\n", (long long)j, fmt(sr).c_str(),
                  both(-INFINITY, false).c_str(), both(-INFINITY, true).c_str(),
                  both(INFINITY, false).c_str(), both(0.0, false).c_str());
    }
    std::printf("(each cell: P from the masked score / P from the raw score)\n\n");
    std::printf(
        "-inf unguarded: NaN even on masked scores, so dQ is NaN and the row's NaN dS "
        "reaches dK of every key it is multiplied with.\n");
    std::printf("-inf guarded:   0 on masked scores; a raw score must still be masked first.\n");
    std::printf(
        "+inf:           0 on both, so a kernel that stores +inf needs no guard in its "
        "backward, but its LSE fails the forward's contract.\n");
    std::printf(
        "0:              0 on masked scores, exp(S) on raw ones: a kernel that "
        "recomputes P before masking gets a non-zero P, hence a non-zero dQ and a dK, dV "
        "contribution from a row that sees nothing.\n");
    double worst = 0.0;
    for (std::int64_t d = 0; d < D; ++d)
      worst = std::max(worst, std::abs(fx.grads->dq[r * std::size_t(D) + std::size_t(d)]));
    std::printf("\ngolden dQ of the row: max |dQ| = %s\n", fmt(worst).c_str());
    return 0;
  }

  // P through the state's guard, Delta both ways, dS.
  const online_softmax<double> fin = online_softmax<double>::from_lse(lse);
  std::vector<double> prob(n), ds(n);
  double p_sum = 0.0, delta_p = 0.0;
  for (std::int64_t j = 0; j < Lk; ++j) {
    prob[std::size_t(j)] = fin.prob(s[std::size_t(j)]);
    p_sum += prob[std::size_t(j)];
    delta_p += prob[std::size_t(j)] * dp[std::size_t(j)];
  }
  double delta_o = 0.0;  // Delta = Σ_d dO_d O_d, O from the golden forward
  for (std::int64_t d = 0; d < Dv; ++d)
    delta_o += double(g.d_o(b, h, i, d)) * fx.golden.o[r * std::size_t(Dv) + std::size_t(d)];
  for (std::int64_t j = 0; j < Lk; ++j)  // dS_j = P_j (dP_j - Delta), exactly 0 when masked
    ds[std::size_t(j)] =
        row.key_mask(std::size_t(j)) ? prob[std::size_t(j)] * (dp[std::size_t(j)] - delta_o) : 0.0;

  std::printf("%4s %8s %12s %14s %12s %14s\n", "key", "visible", "S_j", "P_j", "dP_j", "dS_j");
  for (std::int64_t j = 0; j < Lk; ++j) {
    std::printf("%4lld %8s %12s %14s %12s %14s\n", (long long)j,
                row.key_mask(std::size_t(j)) ? "yes" : "no", fmt(s[std::size_t(j)]).c_str(),
                fmt(prob[std::size_t(j)]).c_str(), fmt(dp[std::size_t(j)]).c_str(),
                fmt(ds[std::size_t(j)]).c_str());
  }
  std::printf("\nsum_j P_j = %s: P needs no max and no sum of its own, only the stored LSE\n",
              fmt(p_sum).c_str());
  std::printf(
      "Delta = sum_d dO_d O_d = %s;  sum_j P_j dP_j = %s  (equal, because O = sum_j P_j "
      "V_j: one dot product of length Dv instead of a pass over the keys)\n",
      fmt(delta_o).c_str(), fmt(delta_p).c_str());
  double max_diff = 0.0, max_ref = 0.0;
  std::printf("\n%4s %14s %14s\n", "d", "dQ_d", "golden dQ_d");
  for (std::int64_t d = 0; d < D; ++d) {
    double x = 0.0;  // dQ_d = scale Σ_j dS_j K_jd
    for (std::int64_t j = 0; j < Lk; ++j)
      x += ds[std::size_t(j)] * row.K(std::size_t(j), std::size_t(d));
    x *= scale;
    const double ref = fx.grads->dq[r * std::size_t(D) + std::size_t(d)];
    max_diff = std::max(max_diff, std::abs(x - ref));
    max_ref = std::max(max_ref, std::abs(ref));
    if (d < 4) std::printf("%4lld %14s %14s\n", (long long)d, fmt(x).c_str(), fmt(ref).c_str());
  }
  std::printf("max |dQ - golden| over the row's %lld elements: %s (max |golden| %s)\n",
              (long long)D, fmt(max_diff).c_str(), fmt(max_ref).c_str());
  return max_diff <= 1e-9 * std::max(1.0, max_ref) ? 0 : 1;
}

}  // namespace flashref::cli
