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
#include "flashref/testdata/check.hpp"
#include "flashref/testdata/fixture.hpp"
#include "io.hpp"

namespace flashref::cli {

namespace {

namespace fs = std::filesystem;
namespace h5 = testdata::h5;
using json = nlohmann::ordered_json;
using testdata::check_row;
using testdata::judge;
using testdata::number;
using testdata::verdict;

// Failing rows kept per check for --json unless --rows says otherwise.
constexpr std::size_t kDefaultWorstRows = 5;

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
    const check_row base = testdata::row_for(fx, stem);
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
    std::fputs(testdata::check_table(rows).c_str(), stdout);
    std::fputs(testdata::tolerance_lines(rows).c_str(), stdout);
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
