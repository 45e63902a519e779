// flashref run — O and LSE of a problem file; flashref check — conformance of a result (ours
// or any other kernel's) against the golden fixtures, with each fixture's own tolerances.

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "flashref/flashref.hpp"
#include "flashref/reference/conformance.hpp"
#include "flashref/testdata/fixture.hpp"
#include "io.hpp"

namespace flashref::cli {

namespace {

namespace fs = std::filesystem;
namespace h5 = testdata::h5;
using json = nlohmann::ordered_json;

constexpr double kLn2 = 0.69314718055994530942;
// Failing rows kept per check for --json unless --rows says otherwise.
constexpr std::size_t kDefaultWorstRows = 5;
// A result's values look like half precision only when this many non-zero values all are.
constexpr std::size_t kMinValuesForDtypeGuess = 16;

struct run_options {
  std::string problem;
  std::string out;
  std::string backend = "automatic";
  bool backward = false;  // also /dq, /dk, /dv from /inputs/do
};

std::string shape_str(const xt::xtensor<float, 4>& x) {
  return "[" + std::to_string(x.shape(0)) + ", " + std::to_string(x.shape(1)) + ", " +
         std::to_string(x.shape(2)) + ", " + std::to_string(x.shape(3)) + "]";
}

int run_problem(const run_options& opt) {
  const backend chosen = resolve(parse_backend(opt.backend));  // bad backend: before any I/O
  const h5::file f = h5::file::open(opt.problem);
  problem_data in = testdata::read_problem(f);
  // The fixture a result belongs to, when the problem file names it: check refuses the result
  // against any other fixture.
  const std::string case_name =
      h5::has_attr(f, "/", "case") ? h5::read_string_attr(f, "/", "case") : "";
  const std::string digest = testdata::inputs_digest(in);
  if (opt.backward && in.d_o.size() == 0 && in.q.shape(0) * in.q.shape(2) * in.v.shape(3) > 0) {
    throw problem_error(opt.problem +
                        ": /inputs/do: expected the upstream gradient for --backward, got nothing");
  }
  const backend used = attention(in.problem(), chosen);
  std::string used_names = to_string(used);
  if (opt.backward) {  // the gradients of the forward just run, P from its own LSE
    const backend used_bwd = attention_backward(in.problem(), in.gradients(), chosen);
    if (used_bwd != used) used_names += std::string(" (backward ") + to_string(used_bwd) + ")";
  }
  const auto& o = in.o;
  const auto& lse = in.lse;
  testdata::write_result(opt.out, in, used_names, opt.backward, case_name, digest);
  std::printf("%s: wrote /o %s and /lse [%zu, %zu, %zu]", opt.out.c_str(), shape_str(o).c_str(),
              lse.shape(0), lse.shape(1), lse.shape(2));
  if (opt.backward) {
    std::printf(", /dq %s, /dk %s, /dv %s", shape_str(in.dq).c_str(), shape_str(in.dk).c_str(),
                shape_str(in.dv).c_str());
  }
  std::printf(" (float32, backend %s)\n", used_names.c_str());
  return 0;
}

struct check_options {
  std::string target;                 // a fixture or a folder of fixtures
  std::string candidate;              // a result file, or a folder of <case>.h5 results
  std::vector<std::string> backends;  // empty (and no candidate): every available backend
  std::string json;                   // also write the rows as JSON to this file ("-": stdout)
  std::vector<std::string> cases;     // only these fixtures of the folder
  bool skip_missing = false;          // a case without a candidate file is skipped, not an error
  std::size_t worst_rows = kDefaultWorstRows;  // failing rows per check in --json
};

enum class verdict { pass, fail, error };

const char* to_string(verdict v) {
  return v == verdict::pass ? "pass" : v == verdict::fail ? "fail" : "error";
}

// The judged result, flat and row-major: O (B, Hq, Lq, Dv) and LSE (B, Hq, Lq) or none.
struct judged_values {
  const double* o = nullptr;
  const double* lse = nullptr;
  std::size_t o_size = 0;
};

// The backward's gradients judged for one row: each tensor present (SPEC §9).
struct gradient_verdicts {
  std::optional<gradient_report> dq, dk, dv;
  std::string judged() const {
    std::string s;
    for (auto [name, r] : {std::pair{"dq", &dq}, {"dk", &dk}, {"dv", &dv}})
      if (r->has_value()) s += std::string(s.empty() ? "" : ",") + name;
    return s.empty() ? "-" : s;
  }
  bool pass() const { return (!dq || dq->pass()) && (!dk || dk->pass()) && (!dv || dv->pass()); }
};

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

// The gradients a result holds, row-major like the fixture's golden ones.
struct judged_gradients {
  const float* dq = nullptr;
  const float* dk = nullptr;
  const float* dv = nullptr;
};

struct check_row {
  std::string fixture;  // the case: file name without .h5
  std::string judged;   // the backend, or "candidate"
  std::string fixture_dtype;
  std::string o_dtype, lse_dtype;  // how the judged result is stored ("" for no /lse)
  tolerance tol;
  double max_abs_v = 0;  // the fixture's max|V| (atol = its multiple)
  conformance_report rep;
  verdict v = verdict::error;
  std::string message;             // why FAIL or ERROR
  std::vector<std::string> hints;  // a convention slip recognised in a failing result
  gradient_verdicts grads;         // the backward's, when the result holds gradients
};

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

std::string number(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "+inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
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
std::vector<std::string> recognise_slips(const check_row& row, const testdata::fixture& fx,
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
        all = double(f) == v[i] && testdata::round_to(t, f) == f;
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

void judge(check_row& row, const testdata::fixture& fx, const judged_values& x,
           const fs::path& fixture_file, std::size_t keep_worst, const judged_gradients& g = {}) {
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

std::vector<float> as_floats(const std::optional<xt::xtensor<double, 4>>& x) {
  return x ? std::vector<float>(x->begin(), x->end()) : std::vector<float>{};
}

std::vector<fs::path> fixtures_in(const fs::path& target, const std::vector<std::string>& only) {
  std::vector<fs::path> files;
  if (!fs::is_directory(target)) {
    if (!fs::exists(target)) {
      throw problem_error(target.string() +
                          ": expected a fixture file or folder, got no such path");
    }
    files.push_back(target);
  } else {
    for (const auto& e : fs::directory_iterator(target))
      if (e.is_regular_file() && e.path().extension() == ".h5") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    if (files.empty()) throw problem_error(target.string() + ": expected *.h5 fixtures, got none");
  }
  if (only.empty()) return files;
  std::vector<fs::path> chosen;
  for (const std::string& name : only) {
    const auto it = std::find_if(files.begin(), files.end(),
                                 [&](const fs::path& f) { return f.stem().string() == name; });
    if (it == files.end()) {
      throw problem_error("--cases: expected fixtures of " + target.string() + " (e.g. " +
                          files.front().stem().string() + "), got '" + name + "'");
    }
    if (std::find(chosen.begin(), chosen.end(), *it) == chosen.end()) chosen.push_back(*it);
  }
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

// --json FILE must be writable before any check runs: a typo is reported at once.
void check_json_path(const std::string& path) {
  if (path.empty() || path == "-") return;
  const fs::path p(path);
  const fs::path folder = p.has_parent_path() ? p.parent_path() : fs::path(".");
  std::string got;
  if (fs::is_directory(p)) {
    got = "a folder";
  } else if (!fs::is_directory(folder)) {
    got = "no folder " + folder.string();
  } else if (::access(folder.c_str(), W_OK) != 0) {
    got = "a folder without write permission";
  } else {
    return;
  }
  throw problem_error(
      "--json: expected a file in an existing, writable folder (or - for standard "
      "output), got " +
      got + " at " + path);
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

void print_table(const std::vector<check_row>& rows) {
  std::size_t w = 4;
  for (const check_row& r : rows)
    w = std::max(w, r.fixture.size());
  const int cw = int(w);
  std::printf("%-*s %-9s %-15s %9s %11s %5s %5s %6s %9s %-9s  %s\n", cw, "case", "judged", "dtype",
              "O err/tol", "LSE err/tol", "NaN", "inf", "wrong", "empty ok", "gradients",
              "verdict");
  for (const check_row& r : rows) {
    if (r.v == verdict::error) {
      std::printf("%-*s %-9s %-15s %9s %11s %5s %5s %6s %9s %-9s  ERROR\n", cw, r.fixture.c_str(),
                  r.judged.c_str(), dtype_cell(r).c_str(), "-", "-", "-", "-", "-", "-", "-");
      continue;
    }
    const conformance_report& c = r.rep;
    const std::string empty =
        std::to_string(c.empty_rows - c.empty_rows_bad) + "/" + std::to_string(c.empty_rows);
    std::printf(
        "%-*s %-9s %-15s %9s %11s %5lld %5lld %6lld %9s %-9s  %s%s%s\n", cw, r.fixture.c_str(),
        r.judged.c_str(), dtype_cell(r).c_str(), ratio_cell(c.o_err_ratio, true).c_str(),
        ratio_cell(c.lse_err_ratio, c.lse_judged).c_str(), (long long)c.nan_rows,
        (long long)c.inf_rows, (long long)c.wrong_rows, empty.c_str(), r.grads.judged().c_str(),
        r.v == verdict::pass ? "PASS" : "FAIL", r.message.empty() ? "" : ": ", r.message.c_str());
  }
}

// The rule and the tolerances the table applied, one line per input dtype of the fixtures.
void print_tolerances(const std::vector<check_row>& rows) {
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
  if (groups.empty()) return;
  std::printf(
      "\ntolerances (each fixture's own): |o - ref| <= atol + rtol * |ref|, "
      "|lse - ref| <= atol_lse * max(1, |ref|)\n");
  for (const auto& [dtype, g] : groups) {
    const std::string atol = g.atol_min == g.atol_max
                                 ? number(g.atol_min)
                                 : number(g.atol_min) + " .. " + number(g.atol_max);
    std::printf("  %-8s inputs: atol = %s * max|V| = %s, rtol = %s, atol_lse = %s\n", dtype.c_str(),
                number(g.atol_per_v).c_str(), atol.c_str(), number(g.rtol).c_str(),
                number(g.atol_lse).c_str());
  }
  std::printf(
      "O err/tol, LSE err/tol: the largest error over what the rule allows there "
      "(<= 1 passes)\n");
  const bool gradients = std::any_of(rows.begin(), rows.end(), [](const check_row& r) {
    return r.grads.dq || r.grads.dk || r.grads.dv;
  });
  if (gradients) {
    std::printf(
        "gradients (SPEC §9), per tensor X: |x - ref| <= rtol * max|ref| + rtol * |ref|, rtol = "
        "1e-4 (float32), 2^-5 (bfloat16), 2^-8 (float16); dQ of empty rows and dK, dV of keys no "
        "row sees exactly 0\n");
  }
}

// Numbers for JSON: NaN and ±inf as the strings "nan", "+inf", "-inf" (JSON has no such
// numbers).
json num(double x) {
  if (std::isfinite(x)) return x;
  return number(x);
}

json site_json(const std::optional<failure_site>& s) {
  if (!s) return nullptr;
  json j = {{"b", s->b}, {"h", s->h}, {"i", s->i}};
  if (s->d >= 0) j["d"] = s->d;
  return j;
}

json row_json(const check_row& r) {
  json j = {{"case", r.fixture},
            {"judged", r.judged},
            {"verdict", to_string(r.v)},
            {"message", r.message}};
  if (r.v == verdict::error) return j;  // nothing was measured
  const conformance_report& c = r.rep;
  j["fixture_dtype"] = r.fixture_dtype;
  j["o_dtype"] = r.o_dtype;
  j["lse_dtype"] = r.lse_dtype.empty() ? json(nullptr) : json(r.lse_dtype);
  j["tolerance"] = {{"atol", r.tol.atol},
                    {"rtol", r.tol.rtol},
                    {"atol_lse", r.tol.atol_lse},
                    {"max_abs_v", r.max_abs_v}};
  j["lse_judged"] = c.lse_judged;
  j["o_err_ratio"] = num(c.o_err_ratio);
  j["lse_err_ratio"] = c.lse_judged ? num(c.lse_err_ratio) : json(nullptr);
  j["max_abs_err"] = num(c.max_abs_err);
  j["max_rel_err"] = num(c.max_rel_err);
  j["max_lse_err"] = c.lse_judged ? num(c.max_lse_err) : json(nullptr);
  j["max_lse_rel_err"] = c.lse_judged ? num(c.max_lse_rel_err) : json(nullptr);
  j["rows"] = c.rows;
  j["nan_rows"] = c.nan_rows;
  j["inf_rows"] = c.inf_rows;
  j["wrong_rows"] = c.wrong_rows;
  j["bad_elements"] = c.bad_elements;
  j["empty_rows"] = c.empty_rows;
  j["empty_rows_bad"] = c.empty_rows_bad;
  j["empty_o_nan"] = c.empty_o_nan;
  j["empty_o_inf"] = c.empty_o_inf;
  j["empty_o_nonzero"] = c.empty_o_nonzero;
  j["empty_lse_posinf"] = c.empty_lse_posinf;
  j["empty_lse_zero"] = c.empty_lse_zero;
  j["empty_lse_nan"] = c.empty_lse_nan;
  j["empty_lse_finite"] = c.empty_lse_finite;
  j["first"] = {{"nan", site_json(c.first_nan)},
                {"inf", site_json(c.first_inf)},
                {"empty", site_json(c.first_empty)},
                {"wrong", site_json(c.first_wrong)}};
  json worst = json::array();
  for (const failing_row& f : c.worst) {
    json w = {{"kind", to_string(f.kind)}, {"b", f.at.b}, {"h", f.at.h}, {"i", f.at.i}};
    if (f.at.d >= 0) {
      w["d"] = f.at.d;
      w["o"] = num(f.o);
      w["golden_o"] = num(f.golden_o);
    }
    w["lse"] = c.lse_judged ? num(f.lse) : json(nullptr);
    w["golden_lse"] = num(f.golden_lse);
    w["err_ratio"] = num(f.err_ratio);
    worst.push_back(w);
  }
  j["worst"] = worst;
  j["hints"] = r.hints;
  j["gradients_judged"] = r.grads.judged();
  for (auto [name, g] : {std::pair{"dq", &r.grads.dq}, {"dk", &r.grads.dk}, {"dv", &r.grads.dv}}) {
    if (!g->has_value()) continue;
    const gradient_report& x = **g;
    j["gradients"][name] = {{"pass", x.pass()},
                            {"bad_elements", x.bad_elements},
                            {"nonfinite", x.nonfinite},
                            {"max_abs_err", num(x.max_abs_err)},
                            {"max_ref", num(x.max_ref)},
                            {"zero_rows", x.zero_rows},
                            {"zero_rows_nan", x.zero_rows_nan},
                            {"zero_rows_nonzero", x.zero_rows_nonzero}};
  }
  return j;
}

int run_check(const check_options& opt) {
  if (!opt.candidate.empty() && !opt.backends.empty())  // one thing is judged at a time
    throw problem_error("--candidate/--backend: expected one of them, got both");
  check_json_path(opt.json);
  const bool single = !fs::is_directory(opt.target);
  if (single && !opt.cases.empty())
    throw problem_error("--cases: expected a folder of fixtures, got the file " + opt.target);
  const std::vector<fs::path> files = fixtures_in(opt.target, opt.cases);
  const bool candidate_dir = !opt.candidate.empty() && fs::is_directory(opt.candidate);
  if (!opt.candidate.empty() && !single && !candidate_dir) {
    throw problem_error(
        "--candidate: expected a folder of <case>.h5 results when checking a folder of "
        "fixtures, got " +
        std::string(fs::exists(opt.candidate) ? "the file " : "no such path ") + opt.candidate);
  }
  if (opt.skip_missing && !candidate_dir)
    throw problem_error("--skip-missing: expected --candidate with a folder of results, got none");
  std::vector<backend> chosen;
  if (opt.candidate.empty()) {
    if (opt.backends.empty()) {
      for (const backend_info& info : backends())
        if (info.available) chosen.push_back(info.id);
    } else {
      for (const std::string& s : opt.backends)
        chosen.push_back(resolve(parse_backend(s)));
    }
  }

  std::vector<check_row> rows;
  std::vector<std::string> errors, skipped, unmatched;
  for (const fs::path& file : files) {
    const std::string name = file.filename().string(), stem = file.stem().string();
    const fs::path cand = candidate_dir ? fs::path(opt.candidate) / name : fs::path(opt.candidate);
    if (opt.skip_missing && !fs::exists(cand)) {
      skipped.push_back(stem);
      continue;
    }
    testdata::fixture fx;
    try {
      fx = testdata::read_fixture(file);
    } catch (const problem_error& e) {
      if (single) throw;  // nothing to tabulate: one line, exit 2
      check_row row;
      row.fixture = stem;
      row.judged = opt.candidate.empty() ? "-" : "candidate";
      row.message = e.what();
      rows.push_back(row);
      errors.push_back(e.what());
      continue;
    }
    check_row base;
    base.fixture = stem;
    base.fixture_dtype = to_string(fx.in.opt.dtype);
    base.tol = fx.tol;
    for (float x : fx.in.v)
      base.max_abs_v = std::max(base.max_abs_v, double(std::abs(x)));
    if (!opt.candidate.empty()) {
      check_row row = base;
      row.judged = "candidate";
      try {
        const testdata::result_info info = testdata::read_result_info(cand);
        row.o_dtype = info.o_dtype;
        row.lse_dtype = info.lse_dtype;
        // A result names the fixture it was computed for: judged against another one it would
        // give misleading errors.
        if (info.case_name && *info.case_name != fx.name) {
          throw problem_error(cand.string() + ": / attribute 'case': expected '" + fx.name +
                              "' (the fixture " + name + "), got '" + *info.case_name +
                              "': a result of another case");
        }
        if (info.inputs_digest) {
          const std::string want = testdata::inputs_digest(fx.in);
          if (*info.inputs_digest != want) {
            throw problem_error(cand.string() + ": / attribute 'inputs_digest': expected " + want +
                                " (the inputs of " + name + "), got " + *info.inputs_digest +
                                ": a result of other inputs");
          }
        }
        const testdata::result r =
            testdata::read_result(cand, fx.golden, fx.grads ? &*fx.grads : nullptr);
        const std::vector<float> dq = as_floats(r.dq), dk = as_floats(r.dk), dv = as_floats(r.dv);
        judge(row, fx, {r.o.data(), r.has_lse ? r.lse.data() : nullptr, r.o.size()}, file,
              opt.worst_rows,
              {r.dq ? dq.data() : nullptr, r.dk ? dk.data() : nullptr, r.dv ? dv.data() : nullptr});
      } catch (const problem_error& e) {
        row.v = verdict::error;
        row.message = e.what();
        errors.push_back(e.what());
      }
      rows.push_back(row);
      continue;
    }
    for (const backend be : chosen) {
      check_row row = base;
      row.judged = to_string(be);
      try {
        problem_data d = fx.in;
        attention(d.problem(), be);
        row.o_dtype = row.lse_dtype = "float32";
        const xt::xtensor<double, 4> o64 = xt::cast<double>(d.o);
        const xt::xtensor<double, 3> lse64 = xt::cast<double>(d.lse);
        bool has_backward = false;
        for (const backend_info& info : backends())
          has_backward = has_backward || (info.id == be && info.backward);
        if (fx.grads && has_backward) {  // the backward too, from the forward just run
          attention_backward(d.problem(), d.gradients(), be);
          // Stored [B, H, L, X] as the fixture's golden gradients: row-major already.
          judge(row, fx, {o64.data(), lse64.data(), o64.size()}, file, opt.worst_rows,
                {d.dq.data(), d.dk.data(), d.dv.data()});
        } else {
          judge(row, fx, {o64.data(), lse64.data(), o64.size()}, file, opt.worst_rows);
        }
      } catch (const problem_error& e) {  // e.g. a head dim this backend does not support
        row.v = verdict::error;
        row.message = std::string(to_string(be)) + " on " + name + ": " + e.what();
        errors.push_back(row.message);
      }
      rows.push_back(row);
    }
  }
  if (candidate_dir) {  // results that no fixture of the folder asked for
    std::set<std::string> stems;
    if (fs::is_directory(opt.target)) {
      for (const auto& e : fs::directory_iterator(opt.target))
        if (e.path().extension() == ".h5") stems.insert(e.path().stem().string());
    } else {
      stems.insert(fs::path(opt.target).stem().string());
    }
    for (const auto& e : fs::directory_iterator(opt.candidate)) {
      if (e.path().extension() == ".h5" && stems.count(e.path().stem().string()) == 0)
        unmatched.push_back(e.path().filename().string());
    }
    std::sort(unmatched.begin(), unmatched.end());
    if (rows.empty()) {
      throw problem_error("--candidate: expected <case>.h5 results for the fixtures of " +
                          opt.target + ", got none in " + opt.candidate);
    }
  }

  const auto count = [&](verdict v) {
    return std::count_if(rows.begin(), rows.end(), [v](const check_row& r) { return r.v == v; });
  };
  const auto n_pass = count(verdict::pass), n_fail = count(verdict::fail),
             n_error = count(verdict::error);
  const bool json_stdout = opt.json == "-";
  if (!json_stdout) {  // with --json -, standard output carries the JSON alone
    if (!opt.candidate.empty()) std::printf("candidate: %s\n", opt.candidate.c_str());
    print_table(rows);
    print_tolerances(rows);
    std::printf("\n%zu check%s: %lld pass, %lld fail, %lld could not be run", rows.size(),
                rows.size() == 1 ? "" : "s", (long long)n_pass, (long long)n_fail,
                (long long)n_error);
    if (!skipped.empty()) std::printf("; %zu skipped (no candidate)", skipped.size());
    std::printf("\n");
    const auto list = [](const char* what, const std::vector<std::string>& names) {
      if (names.empty()) return;
      std::string s;
      for (const std::string& n : names)
        s += (s.empty() ? "" : ", ") + n;
      std::printf("%s: %s\n", what, s.c_str());
    };
    list("skipped, no candidate file (--skip-missing)", skipped);
    list("candidate files that match no fixture (not judged)", unmatched);
  }
  // Exit 2 leaves no report behind: a JSON file is written only for a complete verdict.
  if (!opt.json.empty() && n_error == 0) {
    json rows_j = json::array();
    for (const check_row& r : rows)
      rows_j.push_back(row_json(r));
    const json report = {{"fixtures", opt.target},
                         {"candidate", opt.candidate.empty() ? json(nullptr) : json(opt.candidate)},
                         {"summary",
                          {{"checks", rows.size()},
                           {"pass", n_pass},
                           {"fail", n_fail},
                           {"skipped", skipped.size()}}},
                         {"rows", rows_j},
                         {"skipped", skipped},
                         {"unmatched_candidates", unmatched}};
    const std::string text = report.dump(1) + "\n";
    if (json_stdout) {
      std::fwrite(text.data(), 1, text.size(), stdout);
    } else {
      write_text_atomically(opt.json, text);
    }
  }
  for (const std::string& e : errors)
    std::fprintf(stderr, "flashref: %s\n", e.c_str());
  if (n_error > 0) return 2;
  return n_fail > 0 ? 1 : 0;
}

}  // namespace

void add_run(CLI::App& app, exit_slot status) {
  auto opt = std::make_shared<run_options>();
  CLI::App* cmd = app.add_subcommand(
      "run",
      "Compute /o and /lse (float32) of a problem file, with --backward also /dq, /dk, /dv, and "
      "write them atomically");
  cmd->add_option("--problem", opt->problem, "Problem file (the fixture layout, /golden optional)")
      ->required();
  cmd->add_option("--out", opt->out, "Result file to write")->required();
  cmd->add_option("--backend", opt->backend, "reference, cpu, cuda or automatic")
      ->capture_default_str();
  cmd->add_flag("--backward", opt->backward,
                "Also the backward pass: needs /inputs/do, writes /dq, /dk, /dv (float32)");
  cmd->callback([opt, status] { *status = run_problem(*opt); });
}

void add_check(CLI::App& app, exit_slot status) {
  auto opt = std::make_shared<check_options>();
  CLI::App* cmd = app.add_subcommand(
      "check", "Judge a result file or our backends against golden fixtures (exit 1 on a failure)");
  cmd->add_option("fixtures", opt->target, "A fixture file or a folder of fixtures")->required();
  cmd->add_option("--candidate", opt->candidate,
                  "Result file (/o, /lse) to judge, or a folder of <case>.h5 results");
  cmd->add_option("--backend", opt->backends,
                  "Backends to judge (reference, cpu, cuda, automatic); default: every available "
                  "one");
  cmd->add_option("--cases", opt->cases, "Only these cases of the fixtures folder (a,b,...)")
      ->delimiter(',');
  cmd->add_flag("--skip-missing", opt->skip_missing,
                "Skip the cases without a file in the --candidate folder instead of failing");
  cmd->add_option("--json", opt->json,
                  "Also write the verdicts as JSON to this file (- for standard output)");
  cmd->add_option("--rows", opt->worst_rows, "Failing rows per check listed in --json")
      ->capture_default_str();
  cmd->callback([opt, status] { *status = run_check(*opt); });
}

}  // namespace flashref::cli
