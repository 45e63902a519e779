// flashref explain — the teaching trace of SPEC §4: the spec function stepped block by block,
// with the invariant checked (computed, not asserted) after every block, the broken twins side
// by side, and figures of the trace and of a problem's mask.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "commands.hpp"
#include "explain.hpp"
#include "flashref/reference/mask.hpp"
#include "flashref/reference/online_softmax.hpp"
#include "flashref/reference/spec.hpp"
#include "flashref/testdata/fixture.hpp"
#include "io.hpp"
#include "svg.hpp"

namespace flashref::cli {

namespace {

using reference::spec_result;
using reference::spec_step;

std::string num(double x, int prec = 4) {
  if (std::isnan(x)) return "NaN";
  if (x == INFINITY) return "+inf";
  if (x == -INFINITY) return "-inf";
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*g", prec, x);
  return buf;
}

// Numbers separated by single spaces.
template <class It>
std::string join(It first, It last, int prec) {
  std::string s;
  for (It it = first; it != last; ++it) {
    if (it != first) s += ' ';
    s += num(*it, prec);
  }
  return s;
}

std::vector<double> parse_list(const std::string& field, const std::string& s) {
  std::vector<double> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      std::size_t used = 0;
      out.push_back(std::stod(item, &used));
      if (item.find_first_not_of(" \t", used) != std::string::npos)
        throw std::invalid_argument(item);
    } catch (const std::exception&) {
      throw problem_error(field + ": expected comma-separated numbers, got '" + item + "'");
    }
  }
  return out;
}

// "1,0;0,1;2,2" -> rows of numbers, all of one length.
xt::xtensor<double, 2> parse_matrix(const std::string& field, const std::string& s) {
  std::vector<std::vector<double>> rows;
  std::stringstream ss(s);
  std::string row;
  while (std::getline(ss, row, ';'))
    rows.push_back(parse_list(field, row));
  const std::size_t cols = rows.empty() ? 0 : rows[0].size();
  xt::xtensor<double, 2> m = xt::zeros<double>({rows.size(), cols});
  for (std::size_t r = 0; r < rows.size(); ++r) {
    if (rows[r].size() != cols)
      throw problem_error(field + ": expected " + std::to_string(cols) + " numbers in row " +
                          std::to_string(r) + ", got " + std::to_string(rows[r].size()));
    for (std::size_t c = 0; c < cols; ++c)
      m(r, c) = rows[r][c];
  }
  return m;
}

spec_result run_variant(const explain_inputs& in, const std::string& variant) {
  if (variant == "guarded")
    return reference::tiled_softmax_dot(in.q, in.K, in.V, in.tile, in.key_mask, in.scale);
  if (variant == "unguarded")
    return reference::teaching::tiled_softmax_dot_unguarded(in.q, in.K, in.V, in.tile, in.key_mask,
                                                            in.scale);
  return reference::teaching::tiled_softmax_dot_patched(in.q, in.K, in.V, in.tile, in.key_mask,
                                                        in.scale);
}

}  // namespace

// The invariant after a block, checked from scratch: with m the running max, the state must
// hold s == Σ exp(score_j - m) and out == Σ exp(score_j - m) v_j over the visible keys seen so
// far. Returns the largest relative deviation, or NaN when the state holds a NaN.
double invariant_deviation(const explain_inputs& in, const spec_step& step) {
  if (std::isnan(step.s) || std::isnan(step.m_new)) return NAN;
  for (double x : step.out)
    if (std::isnan(x)) return NAN;
  const double base = online_softmax<double>::exp_base(step.m_new);
  double s = 0;
  std::vector<double> out(in.V.shape(1), 0.0);
  for (std::int64_t j = 0; j < step.k1; ++j) {
    if (in.key_mask.size() && in.key_mask(std::size_t(j)) == 0) continue;
    double dot = 0;
    for (std::size_t d = 0; d < in.q.size(); ++d)
      dot += in.q(d) * in.K(std::size_t(j), d);
    const double p = std::exp(in.scale * dot - base);
    s += p;
    for (std::size_t d = 0; d < out.size(); ++d)
      out[d] += p * in.V(std::size_t(j), d);
  }
  double dev = std::abs(step.s - s) / std::max(1.0, std::abs(s));
  for (std::size_t d = 0; d < out.size(); ++d)
    dev = std::max(dev, std::abs(step.out[d] - out[d]) / std::max(1.0, std::abs(out[d])));
  return dev;
}

namespace {

// Why a step holds NaN, in the loop's own terms.
std::string nan_reason(const spec_step& step, bool earlier_nan) {
  if (earlier_nan) return "NaN carried in s and out from an earlier block";
  if (std::isnan(step.exp_old) && step.m_old == -INFINITY && step.m_new == -INFINITY)
    return "all keys masked while m = -inf: exp_old = exp(-inf - (-inf)) = NaN";
  return "NaN formed in this block";
}

constexpr double kInvariantTol = 1e-12;  // float64 rounding over a handful of keys

std::string invariant_cell(double dev) {
  if (std::isnan(dev)) return "NaN";
  return dev <= kInvariantTol ? "ok" : "VIOLATED";
}

void print_detail(const explain_inputs& in, const std::string& variant, const spec_result& r,
                  const spec_result& one_shot) {
  std::printf("variant %s\n", variant.c_str());
  std::printf("%-5s %-9s %-34s %8s %8s %8s %9s  %-28s %s\n", "block", "keys", "scores", "m_old",
              "m_new", "exp_old", "s", "out (unnormalised)", "invariant");
  bool nan_seen = false;
  for (const spec_step& st : r.trace) {
    const std::string scores = join(st.scores.begin(), st.scores.end(), 3);
    std::string out =
        join(st.out.begin(),
             st.out.begin() + std::min<std::ptrdiff_t>(3, std::ptrdiff_t(st.out.size())), 4);
    if (st.out.size() > 3) out += " ...";
    char keys[32];
    std::snprintf(keys, sizeof keys, "[%lld,%lld)", (long long)st.k0, (long long)st.k1);
    const double dev = invariant_deviation(in, st);
    std::string inv = invariant_cell(dev);
    if (std::isnan(dev)) {
      inv += " (" + nan_reason(st, nan_seen) + ")";
      nan_seen = true;
    } else if (st.all_masked) {
      inv += " (masked block: state unchanged)";
    }
    std::printf("%-5lld %-9s %-34s %8s %8s %8s %9s  %-28s %s\n", (long long)st.tile, keys,
                scores.c_str(), num(st.m_old).c_str(), num(st.m_new).c_str(),
                num(st.exp_old).c_str(), num(st.s).c_str(), out.c_str(), inv.c_str());
  }
  const std::string o = join(r.out.begin(), r.out.end(), 6);
  const std::string w = join(one_shot.out.begin(), one_shot.out.end(), 6);
  std::printf("final: out = [%s], lse = %s\n", o.c_str(), num(r.lse, 6).c_str());
  std::printf("one-shot softmax: out = [%s], lse = %s\n\n", w.c_str(),
              num(one_shot.lse, 6).c_str());
}

// Does the variant's result equal the one-shot softmax (no NaN, within float64 rounding)?
bool matches(const spec_result& r, const spec_result& want) {
  if (std::isnan(r.lse)) return false;
  if (want.lse == -INFINITY ? r.lse != -INFINITY : std::abs(r.lse - want.lse) > 1e-12) return false;
  for (std::size_t d = 0; d < r.out.size(); ++d)
    if (!(std::abs(r.out(d) - want.out(d)) <= 1e-12)) return false;
  return true;
}

void draw_trace(const std::string& path, const explain_inputs& in,
                const std::vector<std::pair<std::string, spec_result>>& runs) {
  const std::size_t nb = runs.front().second.trace.size();
  const double left = 70, right = 20, top = 60, panel_h = 120, gap = 40;
  const double width = left + right + std::max<double>(520, 80.0 * double(nb));
  const double height = top + 3 * (panel_h + gap) + 20;
  svg g(width, height);
  g.text(left, 20, "flashref explain: " + in.name + " (tile " + std::to_string(in.tile) + ")", 14);
  const char* colors[] = {"#1b7837", "#c51b7d", "#2166ac"};
  const double bw = (width - left - right) / double(std::max<std::size_t>(nb, 1));
  const char* panels[] = {"running max m", "running sum s", "exp_old"};
  for (int pnl = 0; pnl < 3; ++pnl) {
    const double y0 = top + pnl * (panel_h + gap);
    // Range over the finite values of every variant.
    double lo = INFINITY, hi = -INFINITY;
    for (const auto& run : runs)
      for (const spec_step& st : run.second.trace) {
        const double v = pnl == 0 ? st.m_new : pnl == 1 ? st.s : st.exp_old;
        if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
      }
    if (!(lo < hi)) lo = std::isfinite(lo) ? lo - 1 : 0, hi = std::isfinite(hi) ? hi + 1 : 1;
    const double pad = 0.1 * (hi - lo);
    lo -= pad, hi += pad;
    auto ymap = [&](double v) { return y0 + panel_h - (v - lo) / (hi - lo) * panel_h; };
    for (std::size_t t = 0; t < nb; ++t)
      if (runs.front().second.trace[t].all_masked)
        g.rect(left + double(t) * bw, y0, bw, panel_h, "#dddddd");
    g.rect(left, y0, width - left - right, panel_h, "none", "stroke='#888'");
    g.text(left, y0 - 6, panels[pnl], 12);
    g.text(left - 6, y0 + 10, num(hi, 3), 10, "end");
    g.text(left - 6, y0 + panel_h, num(lo, 3), 10, "end");
    for (std::size_t v = 0; v < runs.size(); ++v) {
      std::string pts;
      for (std::size_t t = 0; t < nb; ++t) {
        const spec_step& st = runs[v].second.trace[t];
        const double val = pnl == 0 ? st.m_new : pnl == 1 ? st.s : st.exp_old;
        const double x = left + (double(t) + 0.5) * bw + double(v) * 3.0;
        if (std::isnan(val) ||
            val == -INFINITY) {  // off the axis: a label, and a break in the line
          if (!pts.empty()) g.polyline(pts, colors[v], 1.5);
          pts.clear();
          g.text(x, y0 + 14 + 12.0 * double(v), std::isnan(val) ? "NaN" : "-inf", 10, "middle",
                 colors[v]);
          continue;
        }
        const double y = ymap(val);
        pts += std::to_string(x) + "," + std::to_string(y) + " ";
        g.circle(x, y, 3, colors[v]);
      }
      if (!pts.empty()) g.polyline(pts, colors[v], 1.5);
    }
    for (std::size_t t = 0; t < nb; ++t)
      g.text(left + (double(t) + 0.5) * bw, y0 + panel_h + 14, std::to_string(t), 10, "middle");
  }
  double lx = left;
  for (std::size_t v = 0; v < runs.size(); ++v) {
    g.rect(lx, height - 22, 10, 10, colors[v]);
    g.text(lx + 14, height - 13, runs[v].first, 11);
    lx += 100;
  }
  g.rect(lx, height - 22, 10, 10, "#dddddd");
  g.text(lx + 14, height - 13, "fully masked block", 11);
  write_text_atomically(path, g.str());
}

}  // namespace

// A problem's visibility at block granularity for one (batch, head): each cell a tile of
// block_q x block_k (the mask's own blocks, or 64 x 64 without a block mask), coloured by
// the fraction of visible pairs; q-block rows with no visible key are outlined in red, rows
// whose first k-block is masked although a later one is visible in orange.
std::string mask_map_svg(const attention_problem& p, std::int64_t b, std::int64_t h,
                         const std::string& title) {
  const mask_spec m = make_mask_spec(p);
  const std::int64_t bq = p.has_block_mask() ? p.block_q : 64,
                     bk = p.has_block_mask() ? p.block_k : 64;
  const std::int64_t nqb = (p.len_q() + bq - 1) / bq, nkb = (p.len_k() + bk - 1) / bk;
  const double cell = std::clamp(480.0 / double(std::max<std::int64_t>({nqb, nkb, 1})), 4.0, 28.0);
  const double left = 60, top = 50;
  svg g(std::max(left + cell * double(nkb) + 200, 620.0), top + cell * double(nqb) + 40);
  g.text(left, 20, title, 14);
  g.text(left, 38,
         "rows: query blocks of " + std::to_string(bq) + ", columns: key blocks of " +
             std::to_string(bk),
         11);
  for (std::int64_t qb = 0; qb < nqb; ++qb) {
    std::int64_t vis_row = 0;
    bool first_visible = false;
    for (std::int64_t kb = 0; kb < nkb; ++kb) {
      std::int64_t vis = 0, total = 0;
      for (std::int64_t i = qb * bq; i < std::min((qb + 1) * bq, p.len_q()); ++i)
        for (std::int64_t j = kb * bk; j < std::min((kb + 1) * bk, p.len_k()); ++j, ++total)
          vis += m.visible(b, h, i, j);
      vis_row += vis;
      if (kb == 0) first_visible = vis > 0;
      const double f = total ? double(vis) / double(total) : 0;
      const int shade = int(235 - 200 * f);
      char fill[48];
      std::snprintf(fill, sizeof fill, "rgb(%d,%d,%d)", shade, shade, 255 - int(80 * f));
      g.rect(left + cell * double(kb), top + cell * double(qb), cell - 1, cell - 1,
             vis ? fill : "#f4f4f4");
    }
    const char* outline = vis_row == 0 ? "#d73027" : (!first_visible ? "#fc8d59" : nullptr);
    if (outline)
      g.rect(left - 2, top + cell * double(qb) - 1, cell * double(nkb) + 2, cell + 1, "none",
             std::string("stroke='") + outline + "' stroke-width='2'");
    if (nqb <= 64) g.text(left - 6, top + cell * (double(qb) + 0.75), std::to_string(qb), 9, "end");
  }
  const double lx = left + cell * double(nkb) + 16;
  g.rect(lx, top, 12, 12, "rgb(35,35,175)");
  g.text(lx + 16, top + 10, "all pairs visible", 11);
  g.rect(lx, top + 18, 12, 12, "#f4f4f4");
  g.text(lx + 16, top + 28, "no pair visible", 11);
  g.rect(lx, top + 36, 12, 12, "none", "stroke='#d73027' stroke-width='2'");
  g.text(lx + 16, top + 46, "empty q-block row", 11);
  g.rect(lx, top + 54, 12, 12, "none", "stroke='#fc8d59' stroke-width='2'");
  g.text(lx + 16, top + 64, "first k-block masked", 11);
  return g.str();
}

explain_inputs inline_inputs(const explain_options& opt) {
  explain_inputs in;
  in.name = "inline input";
  const std::vector<double> q = parse_list("q", opt.q);
  in.q = xt::zeros<double>({q.size()});
  for (std::size_t d = 0; d < q.size(); ++d)
    in.q(d) = q[d];
  in.K = parse_matrix("k", opt.k);
  if (in.K.shape(0) == 0) in.K = xt::zeros<double>({std::size_t(0), q.size()});  // no key at all
  in.V = opt.v.empty() ? in.K : parse_matrix("v", opt.v);
  if (in.V.shape(0) == 0) in.V = xt::zeros<double>({std::size_t(0), in.K.shape(1)});
  if (!opt.mask.empty()) {
    const std::vector<double> m = parse_list("mask", opt.mask);
    in.key_mask = xt::zeros<std::uint8_t>({m.size()});
    for (std::size_t j = 0; j < m.size(); ++j)
      in.key_mask(j) = m[j] != 0;
  }
  in.scale = opt.scale.value_or(1.0);
  in.tile = opt.tile.value_or(4);
  return in;
}

int run_explain(const explain_inputs& in, const explain_options& opt) {
  const spec_result one_shot =
      reference::one_shot_softmax_dot(in.q, in.K, in.V, in.key_mask, in.scale);
  std::vector<std::string> variants;
  if (opt.variant == "all") {
    variants = {"guarded", "unguarded", "patched"};
  } else if (opt.variant == "guarded" || opt.variant == "unguarded" || opt.variant == "patched") {
    variants = {opt.variant};
  } else {
    throw problem_error("--variant: expected guarded, unguarded, patched or all, got '" +
                        opt.variant + "'");
  }
  std::printf("flashref explain: %s; tile %lld, %zu keys, D = %zu, Dv = %zu, scale %s\n",
              in.name.c_str(), (long long)in.tile, in.K.shape(0), in.q.size(), in.V.shape(1),
              num(in.scale, 6).c_str());
  std::printf(
      "invariant after each block: s == sum exp(score_j - m) and out == sum exp(score_j - m) v_j "
      "over the visible keys seen so far (checked to %g)\n\n",
      kInvariantTol);
  std::vector<std::pair<std::string, spec_result>> runs;
  for (const std::string& v : variants)
    runs.emplace_back(v, run_variant(in, v));
  for (const auto& run : runs)
    print_detail(in, run.first, run.second, one_shot);
  if (runs.size() > 1) {  // the variants side by side: where the broken ones turn to NaN
    std::printf("%-5s", "block");
    for (const auto& run : runs)
      std::printf(" | %-10s %8s %8s %9s", run.first.c_str(), "m", "exp_old", "s");
    std::printf("\n");
    for (std::size_t t = 0; t < runs.front().second.trace.size(); ++t) {
      std::printf("%-5zu", t);
      for (const auto& run : runs) {
        const spec_step& st = run.second.trace[t];
        std::printf(" | %-10s %8s %8s %9s", st.all_masked ? "(masked)" : "", num(st.m_new).c_str(),
                    num(st.exp_old).c_str(), num(st.s).c_str());
      }
      std::printf("\n");
    }
    std::printf("%-5s", "lse");
    for (const auto& run : runs)
      std::printf(" | %-10s %8s %8s %9s", "", "", "", num(run.second.lse).c_str());
    std::printf("\n\n");
  }

  bool guarded_ok = true;
  for (const auto& run : runs) {
    const spec_result& r = run.second;
    std::size_t first_nan = r.trace.size();
    bool violated = false;
    for (std::size_t t = 0; t < r.trace.size(); ++t) {
      const double dev = invariant_deviation(in, r.trace[t]);
      if (std::isnan(dev) && first_nan == r.trace.size()) first_nan = t;
      if (!std::isnan(dev) && dev > kInvariantTol) violated = true;
    }
    const bool ok = matches(r, one_shot) && !violated;
    if (run.first == "guarded") guarded_ok = ok;
    std::string why;
    if (first_nan < r.trace.size()) {
      why = "NaN from block " + std::to_string(first_nan) + " on";
    } else if (!ok && (std::isnan(r.lse) || std::any_of(r.out.begin(), r.out.end(),
                                                        [](double x) { return std::isnan(x); }))) {
      why = "NaN in the final division: out / s with s = " +
            num(r.trace.empty() ? 0.0 : r.trace.back().s) + " (0/0)";
    } else if (!ok) {
      why = "differs from the one-shot softmax";
    } else {
      why = "equals the one-shot softmax";
    }
    std::printf("%-10s %s: %s\n", run.first.c_str(), ok ? "PASS" : "FAIL", why.c_str());
  }
  if (!opt.svg.empty()) {
    draw_trace(opt.svg, in, runs);
    std::printf("wrote %s\n", opt.svg.c_str());
  }
  return guarded_ok ? 0 : 1;
}

}  // namespace flashref::cli

namespace flashref::cli {

void add_explain(CLI::App& app, exit_slot status) {
  auto opt = std::make_shared<explain_options>();
  auto row = std::make_shared<std::vector<std::int64_t>>();
  CLI::App* cmd = app.add_subcommand(
      "explain", "Step the spec function block by block, checking the online-softmax invariant");
  cmd->add_option("--case", opt->case_name,
                  "A fixture case (default spec_masked_first_block when no --q/--k is given)");
  cmd->add_option("--dir", opt->dir, "Fixture folder")->capture_default_str();
  cmd->add_option("--row", *row, "The row b,h,i of a multi-row case (default 0,0,0)")
      ->delimiter(',')
      ->expected(3);
  cmd->add_option("--q", opt->q, "Inline query, e.g. 1,0.5");
  cmd->add_option("--k", opt->k, "Inline keys, rows separated by ';', e.g. '1,0;0,1'");
  cmd->add_option("--v", opt->v, "Inline values, rows separated by ';' (default: the keys)");
  cmd->add_option("--mask", opt->mask, "Inline per-key mask, e.g. 0,0,1,1 (1 = visible)");
  cmd->add_option("--scale", opt->scale, "Score scale (inline default 1; a case's own scale)");
  cmd->add_option("--tile", opt->tile, "Keys per block (default 4)");
  cmd->add_option("--variant", opt->variant, "guarded, unguarded, patched or all")
      ->capture_default_str();
  cmd->add_option("--svg", opt->svg, "Draw m, s and exp_old across blocks into this SVG file");
  cmd->add_flag("--backward", opt->backward,
                "The row through the backward pass: P from the stored LSE, Delta, dS, dQ; for an "
                "empty row, each LSE convention");
  cmd->add_option("--mask-map", opt->mask_map,
                  "Draw the case's visibility per block (its head --row b,h) into this SVG file");
  opt->dir = FLASHREF_TESTDATA_DIR;
  cmd->callback([opt, row, status] {
    if (!row->empty()) opt->b = (*row)[0], opt->h = (*row)[1], opt->i = (*row)[2];
    const bool inline_given = !opt->q.empty() || !opt->k.empty();
    if (inline_given && !opt->case_name.empty())
      throw problem_error("--case: expected either a case or inline --q/--k, got both");
    if (opt->backward && inline_given)
      throw problem_error("--backward: expected a --case, got inline inputs");
    if (inline_given) {
      if (!opt->mask_map.empty())
        throw problem_error("--mask-map: expected a --case to draw, got inline inputs");
      *status = run_explain(inline_inputs(*opt), *opt);
      return;
    }
    if (opt->case_name.empty()) opt->case_name = "spec_masked_first_block";
    const std::filesystem::path file = std::filesystem::path(opt->dir) / (opt->case_name + ".h5");
    if (opt->backward) {
      *status = run_explain_backward(testdata::read_fixture(file), opt->b, opt->h, opt->i);
      return;
    }
    const problem_data pin = testdata::read_problem(file);
    const attention_problem p = pin.inputs();
    if (!opt->mask_map.empty()) {
      if (opt->b < 0 || opt->b >= p.batch() || opt->h < 0 || opt->h >= p.heads_q())
        throw problem_error("--row: expected b < " + std::to_string(p.batch()) + " and h < " +
                            std::to_string(p.heads_q()) + ", got " + std::to_string(opt->b) + "," +
                            std::to_string(opt->h));
      write_text_atomically(
          opt->mask_map,
          mask_map_svg(p, opt->b, opt->h,
                       "flashref: visibility of " + opt->case_name + ", batch " +
                           std::to_string(opt->b) + ", head " + std::to_string(opt->h)));
      std::printf("wrote %s\n", opt->mask_map.c_str());
      if (row->empty() && opt->svg.empty()) return;  // only the map was asked for
    }
    const testdata::spec_row r = testdata::spec_row_of(p, opt->b, opt->h, opt->i);
    explain_inputs in{opt->case_name + " row (" + std::to_string(opt->b) + ", " +
                          std::to_string(opt->h) + ", " + std::to_string(opt->i) + ")",
                      r.q,
                      r.K,
                      r.V,
                      r.key_mask,
                      opt->scale.value_or(r.scale),
                      opt->tile.value_or(testdata::kSpecTile)};
    *status = run_explain(in, *opt);
  });
}

}  // namespace flashref::cli
