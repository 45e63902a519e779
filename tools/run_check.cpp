// flashref run — O and LSE of a problem file; flashref check — conformance of a result (ours
// or any other kernel's) against the golden fixtures, with each fixture's own tolerances.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "commands.hpp"
#include "flashref/flashref.hpp"
#include "flashref/reference/conformance.hpp"
#include "flashref/testdata/fixture.hpp"
#include "io.hpp"

namespace flashref::cli {

namespace {

namespace fs = std::filesystem;

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
  problem_data in = testdata::read_problem(opt.problem);
  if (opt.backward && in.d_o.size() == 0 && in.q.shape(2) * in.v.shape(3) * in.q.shape(0) > 0)
    throw problem_error(opt.problem +
                        ": /inputs/do: expected the upstream gradient for --backward, got nothing");
  const backend used = attention(in.problem(), chosen);
  std::string used_names = to_string(used);
  if (opt.backward) {
    const backend used_bwd = attention_backward(in.problem(), in.gradients(), chosen);
    if (used_bwd != used) used_names += std::string(" (backward ") + to_string(used_bwd) + ")";
  }
  const auto& o = in.o;
  const auto& lse = in.lse;
  testdata::write_result(opt.out, in, used_names, opt.backward);
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
  std::string json;                   // also write the rows as JSON to this file
};

enum class verdict { pass, fail, error };

// The backward's gradients judged for one row: each present tensor (SPEC §9).
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

struct check_row {
  std::string fixture;  // file name without .h5
  std::string judged;   // the backend, or "candidate"
  std::string dtype;
  conformance_report rep;
  verdict v = verdict::error;
  std::string message;  // why FAIL or ERROR
  gradient_verdicts grads;
};

// How a gradient failed, in the terms of SPEC §9: where an empty row (or a key no row sees)
// went wrong — NaN, a non-zero dQ, a non-zero dK/dV contribution — and values out of tolerance.
std::string why_gradient_failed(const char* name, const gradient_report& r, bool is_dq) {
  std::string s;
  auto add = [&](std::int64_t n, const std::string& what) {
    if (n > 0) s += (s.empty() ? "" : ", ") + std::to_string(n) + " " + what;
  };
  const std::string zero_rows = is_dq ? "empty rows" : "keys no row sees";
  add(r.zero_rows_nan, zero_rows + " with a NaN gradient");
  add(r.zero_rows_nonzero, is_dq ? std::string("empty rows with a non-zero dQ")
                                 : "keys no row sees with a non-zero " + std::string(name) +
                                       " (an empty row's contribution)");
  add(r.nonfinite, "NaN/inf values");
  add(r.bad_elements, "values outside tolerance");
  return s.empty() ? s : std::string(name) + ": " + s;
}

std::string why_failed(const conformance_report& r) {
  std::string s;
  auto add = [&](std::int64_t n, const char* what) {
    if (n == 0) return;
    if (!s.empty()) s += ", ";
    s += std::to_string(n) + " " + what;
  };
  add(r.nan_rows, "NaN/inf rows");
  if (r.empty_rows_bad > 0) {
    // How the empty rows fail: the choices other kernels make for rows that see no key.
    std::string how;
    auto detail = [&](std::int64_t n, const char* what) {
      if (n > 0) how += (how.empty() ? "" : ", ") + std::to_string(n) + " " + what;
    };
    detail(r.empty_o_nonzero, "O != 0");
    detail(r.empty_lse_posinf, "LSE +inf");
    detail(r.empty_lse_zero, "LSE 0");
    detail(r.empty_lse_nan, "LSE NaN");
    detail(r.empty_lse_finite, "LSE finite");
    add(r.empty_rows_bad, ("empty rows not (0, -inf) [" + how + "]").c_str());
  }
  add(r.bad_elements, "values outside tolerance");
  if (!r.lse_judged) s += std::string(s.empty() ? "" : "; ") + "no /lse: O judged alone";
  return s;
}

// The gradients present (as row-major (B, H, L, X) values) against the fixture's golden ones.
struct gradients_in {
  const float* dq = nullptr;
  const float* dk = nullptr;
  const float* dv = nullptr;
};

template <class T>
void judge(check_row& row, const testdata::fixture& fx, const T* o, const T* lse,
           const gradients_in& g = {}) {
  row.rep = compare(fx.golden, o, lse, fx.tol);
  if (fx.grads) {
    const reference::golden_gradients& gold = *fx.grads;
    const input_dtype dt = fx.in.opt.dtype;
    const std::int64_t D = gold.q_shape[3], Dv = gold.v_shape[3];
    if (g.dq) row.grads.dq = compare_gradient(gold.dq, g.dq, D, gold.row_empty, dt);
    if (g.dk) row.grads.dk = compare_gradient(gold.dk, g.dk, D, gold.key_unseen, dt);
    if (g.dv) row.grads.dv = compare_gradient(gold.dv, g.dv, Dv, gold.key_unseen, dt);
  }
  row.v = row.rep.pass() && row.grads.pass() ? verdict::pass : verdict::fail;
  if (!row.rep.pass() || !row.rep.lse_judged) row.message = why_failed(row.rep);
  for (auto [name, r] :
       {std::pair{"dq", &row.grads.dq}, {"dk", &row.grads.dk}, {"dv", &row.grads.dv}}) {
    if (!r->has_value() || (*r)->pass()) continue;
    const std::string why = why_gradient_failed(name, **r, name[1] == 'q');
    row.message += (row.message.empty() ? "" : "; ") + why;
  }
}

std::vector<float> as_floats(const std::optional<xt::xtensor<double, 4>>& x) {
  return x ? std::vector<float>(x->begin(), x->end()) : std::vector<float>{};
}

std::vector<float> row_major(const xt::xtensor<float, 4>& x) {
  return {x.begin(), x.end()};
}

std::vector<fs::path> fixtures_in(const fs::path& target) {
  if (!fs::is_directory(target)) {
    if (!fs::exists(target)) {
      throw problem_error(target.string() +
                          ": expected a fixture file or folder, got no such path");
    }
    return {target};
  }
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(target))
    if (e.is_regular_file() && e.path().extension() == ".h5") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  if (files.empty()) throw problem_error(target.string() + ": expected *.h5 fixtures, got none");
  return files;
}

void print_table(const std::vector<check_row>& rows) {
  std::printf("%-26s %-12s %-8s %10s %10s %10s %8s %9s %-9s  %s\n", "case", "judged", "dtype",
              "max|err|", "max rel", "max lse", "NaN rows", "empty ok", "gradients", "verdict");
  for (const check_row& r : rows) {
    if (r.v == verdict::error) {
      std::printf("%-26s %-12s %-8s %10s %10s %10s %8s %9s %-9s  ERROR\n", r.fixture.c_str(),
                  r.judged.c_str(), r.dtype.c_str(), "-", "-", "-", "-", "-", "-");
      continue;
    }
    const std::string empty = std::to_string(r.rep.empty_rows - r.rep.empty_rows_bad) + "/" +
                              std::to_string(r.rep.empty_rows);
    std::printf("%-26s %-12s %-8s %10.3e %10.3e %10.3e %8lld %9s %-9s  %s%s%s\n", r.fixture.c_str(),
                r.judged.c_str(), r.dtype.c_str(), r.rep.max_abs_err, r.rep.max_rel_err,
                r.rep.max_lse_err, (long long)r.rep.nan_rows, empty.c_str(),
                r.grads.judged().c_str(), r.v == verdict::pass ? "PASS" : "FAIL",
                r.message.empty() ? "" : ": ", r.message.c_str());
  }
}

std::string json_string(const std::string& s) {
  std::string r = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') r += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    r += c;
  }
  return r + "\"";
}

std::string json_number(double x) {
  if (!std::isfinite(x)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

// One object per row, for scripts that tabulate many kernels (the conformance report).
std::string rows_json(const std::vector<check_row>& rows) {
  std::string out = "[\n";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const check_row& r = rows[i];
    const conformance_report& c = r.rep;
    const char* v = r.v == verdict::pass ? "pass" : r.v == verdict::fail ? "fail" : "error";
    out += "  {\"case\": " + json_string(r.fixture) + ", \"judged\": " + json_string(r.judged) +
           ", \"dtype\": " + json_string(r.dtype) + ", \"verdict\": \"" + v +
           "\", \"message\": " + json_string(r.message) +
           ", \"max_abs_err\": " + json_number(c.max_abs_err) +
           ", \"max_rel_err\": " + json_number(c.max_rel_err) +
           ", \"max_lse_err\": " + json_number(c.max_lse_err) +
           ", \"lse_judged\": " + (c.lse_judged ? "true" : "false") +
           ", \"gradients_judged\": " + json_string(r.grads.judged()) +
           ", \"rows\": " + std::to_string(c.rows) +
           ", \"nan_rows\": " + std::to_string(c.nan_rows) +
           ", \"bad_elements\": " + std::to_string(c.bad_elements) +
           ", \"empty_rows\": " + std::to_string(c.empty_rows) +
           ", \"empty_rows_bad\": " + std::to_string(c.empty_rows_bad) +
           ", \"empty_o_nonzero\": " + std::to_string(c.empty_o_nonzero) +
           ", \"empty_lse_posinf\": " + std::to_string(c.empty_lse_posinf) +
           ", \"empty_lse_zero\": " + std::to_string(c.empty_lse_zero) +
           ", \"empty_lse_nan\": " + std::to_string(c.empty_lse_nan) +
           ", \"empty_lse_finite\": " + std::to_string(c.empty_lse_finite) + "}" +
           (i + 1 < rows.size() ? ",\n" : "\n");
  }
  return out + "]\n";
}

int run_check(const check_options& opt) {
  if (!opt.candidate.empty() && !opt.backends.empty())  // one thing is judged at a time
    throw problem_error("--candidate/--backend: expected one of them, got both");
  const std::vector<fs::path> files = fixtures_in(opt.target);
  const bool single = !fs::is_directory(opt.target);
  const bool candidate_dir = !opt.candidate.empty() && fs::is_directory(opt.candidate);
  if (!opt.candidate.empty() && !single && !candidate_dir) {
    throw problem_error(
        "--candidate: expected a folder of <case>.h5 results when checking a "
        "folder of fixtures, got the file " +
        opt.candidate);
  }
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
  std::vector<std::string> errors;
  for (const fs::path& file : files) {
    const std::string name = file.filename().string(), stem = file.stem().string();
    testdata::fixture fx;
    try {
      fx = testdata::read_fixture(file);
    } catch (const problem_error& e) {
      if (single) throw;  // nothing to tabulate: one line, exit 2
      rows.push_back({stem, "-", "-", {}, verdict::error, e.what(), {}});
      errors.push_back(e.what());
      continue;
    }
    const std::string dtype = to_string(fx.in.opt.dtype);
    if (!opt.candidate.empty()) {
      const fs::path cand =
          candidate_dir ? fs::path(opt.candidate) / name : fs::path(opt.candidate);
      check_row row{stem, "candidate", dtype, {}, verdict::error, "", {}};
      try {
        const testdata::result r =
            testdata::read_result(cand, fx.golden, fx.grads ? &*fx.grads : nullptr);
        const std::vector<float> dq = as_floats(r.dq), dk = as_floats(r.dk), dv = as_floats(r.dv);
        judge(row, fx, r.o.data(), r.has_lse ? r.lse.data() : nullptr,
              {r.dq ? dq.data() : nullptr, r.dk ? dk.data() : nullptr, r.dv ? dv.data() : nullptr});
      } catch (const problem_error& e) {
        row.message = e.what();
        errors.push_back(e.what());
      }
      rows.push_back(row);
      continue;
    }
    for (const backend be : chosen) {
      check_row row{stem, to_string(be), dtype, {}, verdict::error, "", {}};
      try {
        problem_data d = fx.in;
        attention(d.problem(), be);
        bool has_backward = false;
        for (const backend_info& info : backends())
          has_backward = has_backward || (info.id == be && info.backward);
        if (fx.grads && has_backward) {  // the backward too, from the forward just run
          attention_backward(d.problem(), d.gradients(), be);
          // Gradients stored [B, H, L, X] as in the fixture: row-major already.
          const std::vector<float> dq = row_major(d.dq), dk = row_major(d.dk), dv = row_major(d.dv);
          judge(row, fx, d.o.data(), d.lse.data(), {dq.data(), dk.data(), dv.data()});
        } else {
          judge(row, fx, d.o.data(), d.lse.data());
        }
      } catch (const problem_error& e) {  // e.g. a head dim this backend does not support
        row.message = std::string(to_string(be)) + " on " + name + ": " + e.what();
        errors.push_back(row.message);
      }
      rows.push_back(row);
    }
  }

  if (!opt.candidate.empty()) std::printf("candidate: %s\n", opt.candidate.c_str());
  print_table(rows);
  const auto count = [&](verdict v) {
    return std::count_if(rows.begin(), rows.end(), [v](const check_row& r) { return r.v == v; });
  };
  const auto n_fail = count(verdict::fail), n_error = count(verdict::error);
  std::printf("\n%zu checks: %lld pass, %lld fail, %lld could not be run\n", rows.size(),
              (long long)count(verdict::pass), (long long)n_fail, (long long)n_error);
  if (!opt.json.empty()) write_text_atomically(opt.json, rows_json(rows));
  for (const std::string& e : errors)
    std::fprintf(stderr, "flashref: %s\n", e.c_str());
  if (n_fail > 0) return 1;
  return n_error > 0 ? 2 : 0;
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
  cmd->add_option("--json", opt->json, "Also write the verdict rows as JSON to this file");
  cmd->callback([opt, status] { *status = run_check(*opt); });
}

}  // namespace flashref::cli
