#include "flashref/testdata/check.hpp"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <map>
#include <tuple>
#include <utility>

namespace flashref::testdata {

namespace {

namespace fs = std::filesystem;

constexpr double kLn2 = 0.69314718055994530942;
// A result's values look like half precision only when this many non-zero values all are.
constexpr std::size_t kMinValuesForDtypeGuess = 16;

// printf into a string.
[[gnu::format(printf, 1, 2)]] std::string format(const char* fmt, ...) {
  std::va_list args, again;
  va_start(args, fmt);
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, fmt, args);
  va_end(args);
  std::string s(std::size_t(n) + 1, '\0');
  std::vsnprintf(s.data(), s.size(), fmt, again);
  va_end(again);
  s.resize(std::size_t(n));
  return s;
}

std::string index_of(const char* tensor, const failure_site& s) {
  std::string r = std::string(tensor) + "[" + std::to_string(s.b) + ", " + std::to_string(s.h) +
                  ", " + std::to_string(s.i);
  if (s.d >= 0) r += ", " + std::to_string(s.d);
  return r + "]";
}

// "O[b, h, i, d]" for an element of O, "LSE[b, h, i]" when the LSE is what fails.
std::string site_name(const failure_site& s) {
  return index_of(s.d >= 0 ? "O" : "LSE", s);
}

std::string plural(std::int64_t n, const char* one, const char* many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

std::string why_failed(const check_row& row, const reference::golden& g, const judged_values& x) {
  const conformance_report& r = row.rep;
  std::vector<std::string> parts;
  const auto value_at = [&](const failure_site& s) {
    const std::int64_t Hq = g.o_shape[1], Lq = g.o_shape[2], Dv = g.o_shape[3];
    const std::int64_t at = (s.b * Hq + s.h) * Lq + s.i;
    if (s.d >= 0) return std::pair{x.o[at * Dv + s.d], g.o[std::size_t(at * Dv + s.d)]};
    return std::pair{x.lse != nullptr ? x.lse[at] : g.lse[std::size_t(at)], g.lse[std::size_t(at)]};
  };
  if (r.nan_rows > 0) {
    parts.push_back(plural(r.nan_rows, "NaN row", "NaN rows") + ", first " +
                    site_name(*r.first_nan));
  }
  if (r.inf_rows > 0) {
    const auto [got, ref] = value_at(*r.first_inf);
    parts.push_back(plural(r.inf_rows, "inf row", "inf rows") + ", first " +
                    site_name(*r.first_inf) + " = " + number(got) + " (golden " + number(ref) +
                    ")");
  }
  if (r.empty_rows_bad > 0) {
    // How the empty rows fail: the choices other kernels make for rows that see no key.
    std::string how;
    auto detail = [&](std::int64_t n, const char* what) {
      if (n > 0) how += (how.empty() ? "" : ", ") + std::to_string(n) + " " + what;
    };
    detail(r.empty_o_nan, "O NaN");
    detail(r.empty_o_inf, "O inf");
    detail(r.empty_o_nonzero, "O != 0");
    detail(r.empty_lse_posinf, "LSE +inf");
    detail(r.empty_lse_zero, "LSE 0");
    detail(r.empty_lse_nan, "LSE NaN");
    detail(r.empty_lse_finite, "LSE finite");
    std::string s = std::to_string(r.empty_rows_bad) + "/" + std::to_string(r.empty_rows) +
                    " empty rows not (0, -inf) [" + how + "]";
    if (r.first_empty) {
      const auto [got, ref] = value_at(*r.first_empty);
      s += ", first " + site_name(*r.first_empty) + " = " + number(got);
    }
    parts.push_back(s);
  }
  if (r.bad_elements > 0) {
    const auto [got, ref] = value_at(*r.first_wrong);
    parts.push_back(plural(r.bad_elements, "value", "values") + " outside tolerance in " +
                    plural(r.wrong_rows, "row", "rows") + ", first " + site_name(*r.first_wrong) +
                    " = " + number(got) + " (golden " + number(ref) + ")");
  }
  if (!r.lse_judged) parts.push_back("no /lse: O judged alone");
  std::string s;
  for (const std::string& p : parts)
    s += (s.empty() ? "" : "; ") + p;
  for (const std::string& h : row.hints)
    s += "; " + h;
  return s;
}

// The two convention slips seen in other kernels' results, said in words when they explain a
// failure: an LSE in base 2, and O or LSE stored in half precision on a float32 fixture.
std::vector<std::string> recognise_slips(const check_row& row, const fixture& fx,
                                         const judged_values& x, const fs::path& fixture_file) {
  std::vector<std::string> hints;
  const conformance_report& r = row.rep;
  if (x.lse != nullptr && r.lse_err_ratio > 1.0) {
    std::vector<double> natural(x.lse, x.lse + fx.golden.lse.size());
    for (double& l : natural)
      l *= kLn2;  // log2(s) * ln 2 = ln(s); -inf stays -inf
    const conformance_report as_base2 =
        compare(fx.golden, x.o, natural.data(), fx.tol, std::size_t(0));
    if (as_base2.lse_err_ratio <= 1.0) {
      hints.push_back(
          "the LSE looks like base 2 (lse * ln 2 meets the tolerance): the contract's "
          "LSE is the natural log");
    }
  }
  if (fx.in.opt.dtype != input_dtype::float32 || r.bad_elements == 0) return hints;
  const auto half_values = [&](const double* v, std::size_t n) -> std::string {
    for (const input_dtype t : {input_dtype::bfloat16, input_dtype::float16}) {
      std::size_t nonzero = 0;
      bool all = true;
      for (std::size_t i = 0; i < n && all; ++i) {
        if (!std::isfinite(v[i]) || v[i] == 0.0) continue;
        ++nonzero;
        const float f = float(v[i]);
        all = double(f) == v[i] && round_to(t, f) == f;
      }
      if (all && nonzero >= kMinValuesForDtypeGuess) return to_string(t);
    }
    return "";
  };
  std::string stored;
  for (const auto& [name, dtype, values, n] :
       {std::tuple{"/o", row.o_dtype, x.o, x.o_size},
        std::tuple{"/lse", row.lse_dtype, x.lse, x.lse ? fx.golden.lse.size() : 0}}) {
    if (values == nullptr) continue;
    std::string half = dtype == "float16" || dtype == "bfloat16" ? dtype : "";
    if (half.empty()) half = half_values(values, n);
    if (!half.empty()) stored += std::string(stored.empty() ? "" : " and ") + name + " in " + half;
  }
  if (!stored.empty()) {
    std::string twin;
    for (const char* suffix : {"_bf16", "_fp16"}) {
      const fs::path t = fixture_file.parent_path() / (fx.name + suffix + ".h5");
      if (fs::exists(t)) twin += (twin.empty() ? "" : " or ") + t.stem().string();
    }
    hints.push_back("half-precision storage (" + stored +
                    ") cannot meet a float32 fixture's tolerance: store float32, or judge a "
                    "half-precision kernel on " +
                    (twin.empty() ? std::string("a half-precision fixture") : twin));
  }
  return hints;
}

std::string dtype_cell(const check_row& r) {
  if (r.v == verdict::error && r.o_dtype.empty()) return "-";
  if (r.lse_dtype == r.o_dtype) return r.o_dtype;
  return r.o_dtype + "/" + (r.lse_dtype.empty() ? "-" : r.lse_dtype);
}

std::string ratio_cell(double x, bool judged) {
  if (!judged) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", x);
  return buf;
}

// How a gradient failed, in the terms of SPEC §9: where an empty row (or a key no row sees)
// went wrong — a NaN gradient, a non-zero dQ, a non-zero dK/dV contribution — and values out
// of tolerance.
std::string why_gradient_failed(const char* name, const gradient_report& r, bool is_dq) {
  std::string s;
  auto add = [&](std::int64_t n, const std::string& what) {
    if (n > 0) s += (s.empty() ? "" : ", ") + std::to_string(n) + " " + what;
  };
  add(r.zero_rows_nan,
      is_dq ? "empty rows with a NaN gradient" : "keys no row sees with a NaN gradient");
  add(r.zero_rows_nonzero, is_dq ? std::string("empty rows with a non-zero dQ")
                                 : "keys no row sees with a non-zero " + std::string(name) +
                                       " (an empty row's contribution)");
  add(r.nonfinite, "NaN/inf values");
  add(r.bad_elements, "values outside tolerance");
  return s.empty() ? s : std::string(name) + ": " + s;
}

}  // namespace

std::string gradient_verdicts::judged() const {
  std::string s;
  for (auto [name, r] : {std::pair{"dq", &dq}, {"dk", &dk}, {"dv", &dv}})
    if (r->has_value()) s += std::string(s.empty() ? "" : ",") + name;
  return s.empty() ? "-" : s;
}

const char* to_string(verdict v) {
  return v == verdict::pass ? "pass" : v == verdict::fail ? "fail" : "error";
}

std::string number(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "+inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

check_row row_for(const fixture& fx, const std::string& stem) {
  check_row row;
  row.fixture = stem;
  row.fixture_dtype = to_string(fx.in.opt.dtype);
  row.tol = fx.tol;
  for (float x : fx.in.v)
    row.max_abs_v = std::max(row.max_abs_v, double(std::abs(x)));
  return row;
}

void judge(check_row& row, const fixture& fx, const judged_values& x, const fs::path& fixture_file,
           std::size_t keep_worst, const judged_gradients& g) {
  row.rep = compare(fx.golden, x.o, x.lse, fx.tol, keep_worst);
  if (fx.grads) {
    const reference::golden_gradients& gold = *fx.grads;
    const input_dtype dt = fx.in.opt.dtype;
    const std::int64_t D = gold.q_shape[3], Dv = gold.v_shape[3];
    if (g.dq) row.grads.dq = compare_gradient(gold.dq, g.dq, D, gold.row_empty, dt);
    if (g.dk) row.grads.dk = compare_gradient(gold.dk, g.dk, D, gold.key_unseen, dt);
    if (g.dv) row.grads.dv = compare_gradient(gold.dv, g.dv, Dv, gold.key_unseen, dt);
  }
  const bool forward_ok = row.rep.pass();
  row.v = forward_ok && row.grads.pass() ? verdict::pass : verdict::fail;
  if (!forward_ok) row.hints = recognise_slips(row, fx, x, fixture_file);
  if (!forward_ok || !row.rep.lse_judged) row.message = why_failed(row, fx.golden, x);
  for (auto [name, r] :
       {std::pair{"dq", &row.grads.dq}, {"dk", &row.grads.dk}, {"dv", &row.grads.dv}}) {
    if (!r->has_value() || (*r)->pass()) continue;
    row.message +=
        (row.message.empty() ? "" : "; ") + why_gradient_failed(name, **r, name[1] == 'q');
  }
}

std::string check_table(const std::vector<check_row>& rows) {
  std::string s;
  std::size_t w = 4;
  for (const check_row& r : rows)
    w = std::max(w, r.fixture.size());
  const int cw = int(w);
  s +=
      format("%-*s %-9s %-15s %9s %11s %5s %5s %6s %9s %-9s  %s\n", cw, "case", "judged", "dtype",
             "O err/tol", "LSE err/tol", "NaN", "inf", "wrong", "empty ok", "gradients", "verdict");
  for (const check_row& r : rows) {
    if (r.v == verdict::error) {
      s += format("%-*s %-9s %-15s %9s %11s %5s %5s %6s %9s %-9s  ERROR\n", cw, r.fixture.c_str(),
                  r.judged.c_str(), dtype_cell(r).c_str(), "-", "-", "-", "-", "-", "-", "-");
      continue;
    }
    const conformance_report& c = r.rep;
    const std::string empty =
        std::to_string(c.empty_rows - c.empty_rows_bad) + "/" + std::to_string(c.empty_rows);
    s += format(
        "%-*s %-9s %-15s %9s %11s %5lld %5lld %6lld %9s %-9s  %s%s%s\n", cw, r.fixture.c_str(),
        r.judged.c_str(), dtype_cell(r).c_str(), ratio_cell(c.o_err_ratio, true).c_str(),
        ratio_cell(c.lse_err_ratio, c.lse_judged).c_str(), (long long)c.nan_rows,
        (long long)c.inf_rows, (long long)c.wrong_rows, empty.c_str(), r.grads.judged().c_str(),
        r.v == verdict::pass ? "PASS" : "FAIL", r.message.empty() ? "" : ": ", r.message.c_str());
  }
  return s;
}

std::string tolerance_lines(const std::vector<check_row>& rows) {
  std::string s;
  struct group {
    double atol_per_v = 0, rtol = 0, atol_lse = 0, atol_min = INFINITY, atol_max = 0;
    std::size_t n = 0;
  };
  std::map<std::string, group> groups;
  for (const check_row& r : rows) {
    if (r.fixture_dtype.empty()) continue;
    group& g = groups[r.fixture_dtype];
    g.atol_per_v = r.tol.atol / std::max(r.max_abs_v, 1e-30);
    g.rtol = r.tol.rtol;
    g.atol_lse = r.tol.atol_lse;
    g.atol_min = std::min(g.atol_min, r.tol.atol);
    g.atol_max = std::max(g.atol_max, r.tol.atol);
    ++g.n;
  }
  if (groups.empty()) return s;
  s += "\ntolerances (each fixture's own): |o - ref| <= atol + rtol * |ref|, "
       "|lse - ref| <= atol_lse * max(1, |ref|)\n";
  for (const auto& [dtype, g] : groups) {
    const std::string atol = g.atol_min == g.atol_max
                                 ? number(g.atol_min)
                                 : number(g.atol_min) + " .. " + number(g.atol_max);
    s += format("  %-8s inputs: atol = %s * max|V| = %s, rtol = %s, atol_lse = %s\n", dtype.c_str(),
                number(g.atol_per_v).c_str(), atol.c_str(), number(g.rtol).c_str(),
                number(g.atol_lse).c_str());
  }
  s += "O err/tol, LSE err/tol: the largest error over what the rule allows there "
       "(<= 1 passes)\n";
  const bool gradients = std::any_of(rows.begin(), rows.end(), [](const check_row& r) {
    return r.grads.dq || r.grads.dk || r.grads.dv;
  });
  if (gradients) {
    s += "gradients (SPEC §9), per tensor X: |x - ref| <= rtol * max|ref| + rtol * |ref|, rtol = "
         "1e-4 (float32), 2^-5 (bfloat16), 2^-8 (float16); dQ of empty rows and dK, dV of keys no "
         "row sees exactly 0\n";
  }
  return s;
}

}  // namespace flashref::testdata
