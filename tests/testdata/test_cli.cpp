// The CLI's fixture commands as a user runs them: exit statuses (0 pass, 1 a failing candidate
// or a changed fixture, 2 bad input), one line on stderr for bad input, no output file left.

#include <sys/wait.h>
#include <fstream>
#include <iterator>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <tuple>

#include <nlohmann/json.hpp>

#include "flashref/flashref.hpp"
#include "flashref/testdata/cases.hpp"
#include "helpers.hpp"

namespace h5 = flashref::testdata::h5;
namespace td = flashref::testdata;
using Catch::Matchers::Contains;
using flashref::test::read_text;
using flashref::test::temp_dir;
using flashref::test::testdata_dir;

namespace {

struct outcome {
  int rc = -1;
  std::string out, err;
};

std::string quoted(const std::filesystem::path& p) {
  return "'" + p.string() + "'";
}

// Runs `flashref <args>` and collects its exit status, stdout and stderr.
outcome cli(const std::string& args, const std::string& env = "") {
  const temp_dir logs;
  const std::string cmd = (env.empty() ? "" : env + " ") + quoted(FLASHREF_CLI) + " " + args +
                          " >" + quoted(logs / "out") + " 2>" + quoted(logs / "err");
  const int status = std::system(cmd.c_str());
  outcome o;
  o.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  o.out = read_text(logs / "out");
  o.err = read_text(logs / "err");
  return o;
}

std::string fixture_path(const std::string& name) {
  return quoted(testdata_dir() / (name + ".h5"));
}

// Bad input: exit status 2 and exactly one line on stderr that contains `what`.
void require_bad_input(const outcome& o, const std::string& what) {
  CAPTURE(o.out, o.err);
  CHECK(o.rc == 2);
  CHECK_THAT(o.err, Contains(what));
  REQUIRE_FALSE(o.err.empty());
  CHECK(o.err.find('\n') == o.err.size() - 1);  // one line
}

// Overwrites one element of a float64 dataset in place.
void poke(const std::filesystem::path& file, const char* path, std::size_t index, double value) {
  const hid_t f = H5Fopen(file.string().c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  REQUIRE(f >= 0);
  const hid_t d = H5Dopen2(f, path, H5P_DEFAULT);
  const hid_t space = H5Dget_space(d);
  std::vector<double> x(std::size_t(H5Sget_simple_extent_npoints(space)));
  REQUIRE(H5Dread(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, x.data()) >= 0);
  x.at(index) = value;
  REQUIRE(H5Dwrite(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, x.data()) >= 0);
  H5Sclose(space);
  H5Dclose(d);
  H5Fclose(f);
}

}  // namespace

// The reference's result of a fixture, as float32 tensors to break by hand.
struct float_result {
  td::fixture fx;
  xt::xtensor<float, 4> o;
  xt::xtensor<float, 3> lse;
  std::size_t Dv() const { return o.shape(3); }
  std::size_t row(std::size_t b, std::size_t h, std::size_t i) const {
    return (b * o.shape(1) + h) * o.shape(2) + i;
  }
  std::size_t first_empty_row() const {
    std::size_t r = 0;
    while (fx.golden.lse[r] != -INFINITY)
      ++r;
    return r;
  }
  std::size_t first_full_row() const {
    std::size_t r = 0;
    while (fx.golden.lse[r] == -INFINITY)
      ++r;
    return r;
  }
};

float_result reference_result(const std::string& name, const temp_dir& dir) {
  const auto file = dir / (name + "-reference.h5");
  REQUIRE(cli("run --backend reference --problem " + fixture_path(name) + " --out " + quoted(file))
              .rc == 0);
  float_result r{td::read_fixture(testdata_dir() / (name + ".h5")), {}, {}};
  const td::result got = td::read_result(file, r.fx.golden);
  r.o = xt::cast<float>(got.o);
  r.lse = xt::cast<float>(got.lse);
  return r;
}

nlohmann::json read_json(const std::filesystem::path& p) {
  return nlohmann::json::parse(read_text(p));
}

outcome check_candidate(const std::string& name, const std::filesystem::path& cand,
                        const std::string& extra = "") {
  return cli("check " + fixture_path(name) + " --candidate " + quoted(cand) + extra);
}

TEST_CASE("cli: run writes a result that check accepts, a NaN row or a wrong empty row fails",
          "[cli]") {
  temp_dir dir;
  const auto result = dir / "r.h5";
  const outcome run = cli("run --problem " + fixture_path("blocksparse_empty_rows") + " --out " +
                          quoted(result) + " --backend reference");
  CAPTURE(run.out, run.err);
  REQUIRE(run.rc == 0);
  CHECK(run.err.empty());
  CHECK(dir.entries() == std::vector<std::string>{"r.h5"});
  const td::fixture fx = td::read_fixture(testdata_dir() / "blocksparse_empty_rows.h5");
  td::result r = td::read_result(result, fx.golden);
  CHECK(h5::type_of(h5::file::open(result), "/o") == "float32");
  CHECK(h5::type_of(h5::file::open(result), "/lse") == "float32");
  // The result names its fixture and the inputs it was computed on.
  const td::result_info info = td::read_result_info(result);
  CHECK(info.case_name == "blocksparse_empty_rows");
  CHECK(info.inputs_digest == td::inputs_digest(fx.in));
  CHECK(info.backend == "reference");
  CHECK(info.inputs_digest->size() == 16);

  const outcome pass =
      cli("check " + fixture_path("blocksparse_empty_rows") + " --candidate " + quoted(result));
  CAPTURE(pass.out, pass.err);
  CHECK(pass.rc == 0);
  CHECK_THAT(pass.out, Contains("blocksparse_empty_rows") && Contains("PASS") &&
                           Contains("32/32") && Contains("1 pass, 0 fail"));

  // A hand-made candidate with one NaN in a non-empty row: the row and the element are named.
  std::size_t row = 0;
  while (fx.golden.lse[row] == -INFINITY)
    ++row;
  xt::xtensor<float, 4> o = xt::cast<float>(r.o);
  xt::xtensor<float, 3> lse = xt::cast<float>(r.lse);
  const std::size_t Dv = o.shape(3), Lq = o.shape(2);
  o.data()[row * Dv + 3] = NAN;
  td::write_result(dir / "nan.h5", o, lse, "hand-made");
  const outcome nan = cli("check " + fixture_path("blocksparse_empty_rows") + " --candidate " +
                          quoted(dir / "nan.h5"));
  CAPTURE(nan.out, nan.err);
  CHECK(nan.rc == 1);
  CHECK_THAT(nan.out, Contains("FAIL: 1 NaN row, first O[0, " + std::to_string(row / Lq) + ", " +
                               std::to_string(row % Lq) + ", 3]") &&
                          Contains("0 pass, 1 fail"));

  // FlashAttention-2's +inf or PyTorch's 0 as the LSE of an empty row is a failure too.
  o.data()[row * Dv + 3] = float(r.o.data()[row * Dv + 3]);
  std::size_t empty = 0;
  while (fx.golden.lse[empty] != -INFINITY)
    ++empty;
  const std::string empty_at =
      "[0, " + std::to_string(empty / Lq) + ", " + std::to_string(empty % Lq);
  lse.data()[empty] = 0.0f;
  td::write_result(dir / "zero_lse.h5", o, lse, "hand-made");
  const outcome zero = cli("check " + fixture_path("blocksparse_empty_rows") + " --candidate " +
                           quoted(dir / "zero_lse.h5"));
  CAPTURE(zero.out, zero.err);
  CHECK(zero.rc == 1);
  CHECK_THAT(zero.out, Contains("FAIL: 1/32 empty rows not (0, -inf) [1 LSE 0], first LSE" +
                                empty_at + "] = 0") &&
                           Contains("31/32"));

  // +inf LSE and a non-zero O on empty rows are named as such, and recorded in --json.
  lse.data()[empty] = INFINITY;
  o.data()[empty * Dv] = 0.5f;
  td::write_result(dir / "inf_lse.h5", o, lse, "hand-made");
  const outcome inf = cli("check " + fixture_path("blocksparse_empty_rows") + " --candidate " +
                          quoted(dir / "inf_lse.h5") + " --json " + quoted(dir / "v.json"));
  CAPTURE(inf.out, inf.err);
  CHECK(inf.rc == 1);
  CHECK_THAT(inf.out, Contains("[1 O != 0, 1 LSE +inf]") &&
                          Contains("1 inf row, first LSE" + empty_at + "] = +inf"));
  const nlohmann::json js = read_json(dir / "v.json");
  const nlohmann::json& j = js["rows"][0];
  CHECK(j["verdict"] == "fail");
  CHECK(j["empty_lse_posinf"] == 1);
  CHECK(j["empty_o_nonzero"] == 1);
  CHECK(j["inf_rows"] == 1);
  CHECK(j["nan_rows"] == 0);
  CHECK(j["first"]["empty"]["d"] == 0);
  CHECK(j["worst"][0]["kind"] == "inf");
  CHECK(j["worst"][0]["lse"] == "+inf");
  CHECK(j["worst"][0]["golden_lse"] == "-inf");
}

TEST_CASE("cli: check names the row and element that fail, and --json the worst rows", "[cli]") {
  temp_dir dir;
  float_result r = reference_result("gqa", dir);
  // A wrong element at [0, 1, 3, 5], a smaller error at [0, 6, 2, 0], a wrong LSE at [0, 7, 9].
  const std::size_t Dv = r.Dv(), a = r.row(0, 1, 3), b = r.row(0, 6, 2), c = r.row(0, 7, 9);
  r.o.data()[a * Dv + 5] += 20.0f;
  r.o.data()[b * Dv] += 0.01f;
  r.lse.data()[c] += 1.0f;
  td::write_result(dir / "wrong.h5", r.o, r.lse, "hand-made");
  const outcome o = check_candidate("gqa", dir / "wrong.h5", " --json " + quoted(dir / "w.json"));
  CAPTURE(o.out, o.err);
  CHECK(o.rc == 1);
  CHECK_THAT(o.out, Contains("3 values outside tolerance in 3 rows, first O[0, 1, 3, 5] = " + [&] {
               char buf[32];
               std::snprintf(buf, sizeof buf, "%.6g", double(r.o.data()[a * Dv + 5]));
               return std::string(buf);
             }()));
  const nlohmann::json js = read_json(dir / "w.json");
  const nlohmann::json& row = js["rows"][0];
  CHECK(row["bad_elements"] == 3);
  CHECK(row["wrong_rows"] == 3);
  CHECK(row["first"]["wrong"] == nlohmann::json({{"b", 0}, {"h", 1}, {"i", 3}, {"d", 5}}));
  REQUIRE(row["worst"].size() == 3);
  // Worst first by error / allowed error: O off by 20, the LSE off by 1, then O off by 0.01.
  const nlohmann::json& w0 = row["worst"][0];
  CHECK(w0["kind"] == "wrong");
  CHECK(w0["h"] == 1);
  CHECK(w0["i"] == 3);
  CHECK(w0["d"] == 5);
  CHECK(w0["o"].get<double>() == double(r.o.data()[a * Dv + 5]));
  CHECK(w0["golden_o"].get<double>() == r.fx.golden.o[a * Dv + 5]);
  CHECK(w0["golden_lse"].get<double>() == r.fx.golden.lse[a]);
  CHECK(w0["err_ratio"].get<double>() > 1.0);
  const nlohmann::json& w1 = row["worst"][1];
  CHECK(w1["h"] == 7);
  CHECK(w1["i"] == 9);
  CHECK_FALSE(w1.contains("d"));  // only the LSE of this row fails
  CHECK(w1["lse"].get<double>() == double(r.lse.data()[c]));
  CHECK(row["worst"][2]["h"] == 6);

  // --rows bounds the list.
  const outcome one =
      check_candidate("gqa", dir / "wrong.h5", " --rows 1 --json " + quoted(dir / "one.json"));
  CHECK(one.rc == 1);
  CHECK(read_json(dir / "one.json")["rows"][0]["worst"].size() == 1);
}

TEST_CASE("cli: NaN, inf and wrong-but-finite values are counted apart", "[cli]") {
  temp_dir dir;
  float_result r = reference_result("causal_lq_gt_lk", dir);  // rows 0..15 of each head empty
  const std::size_t Dv = r.Dv();
  const auto empty_rows = std::count(r.fx.golden.lse.begin(), r.fx.golden.lse.end(), -INFINITY);
  REQUIRE(empty_rows == 32);
  auto columns = [&](const std::string& file) {
    const outcome o =
        check_candidate("causal_lq_gt_lk", dir / file, " --json " + quoted(dir / (file + ".json")));
    CAPTURE(o.out, o.err);
    CHECK(o.rc == 1);
    const nlohmann::json j = read_json(dir / (file + ".json"))["rows"][0];
    return std::tuple{j["nan_rows"].get<int>(), j["inf_rows"].get<int>(),
                      j["wrong_rows"].get<int>(), j["empty_rows_bad"].get<int>(), o.out};
  };
  SECTION("FlashAttention-2's convention: LSE = +inf on empty rows, no NaN") {
    xt::xtensor<float, 3> lse = r.lse;
    for (std::size_t i = 0; i < lse.size(); ++i)
      if (r.fx.golden.lse[i] == -INFINITY) lse.data()[i] = INFINITY;
    td::write_result(dir / "fa2.h5", r.o, lse, "hand-made");
    const auto [nan, inf, wrong, empty_bad, out] = columns("fa2.h5");
    CHECK(nan == 0);
    CHECK(inf == 32);
    CHECK(wrong == 0);
    CHECK(empty_bad == 32);
    CHECK_THAT(out, Contains("32 inf rows, first LSE[0, 0, 0] = +inf (golden -inf)") &&
                        Contains("32/32 empty rows not (0, -inf) [32 LSE +inf]"));
  }
  SECTION("NaN on fully masked rows: NaN, not O != 0") {
    xt::xtensor<float, 4> o = r.o;
    xt::xtensor<float, 3> lse = r.lse;
    for (std::size_t i = 0; i < lse.size(); ++i) {
      if (r.fx.golden.lse[i] != -INFINITY) continue;
      lse.data()[i] = NAN;
      for (std::size_t d = 0; d < Dv; ++d)
        o.data()[i * Dv + d] = NAN;
    }
    td::write_result(dir / "nan.h5", o, lse, "hand-made");
    const auto [nan, inf, wrong, empty_bad, out] = columns("nan.h5");
    CHECK(nan == 32);
    CHECK(inf == 0);
    CHECK(wrong == 0);
    CHECK(empty_bad == 32);
    CHECK_THAT(out,
               Contains("32 NaN rows, first O[0, 0, 0, 0]") && Contains("[32 O NaN, 32 LSE NaN]"));
    CHECK_THAT(out, !Contains("O != 0"));
  }
  SECTION("inf in O of a row that sees keys, and a finite error elsewhere") {
    xt::xtensor<float, 4> o = r.o;
    const std::size_t full = r.first_full_row();
    o.data()[full * Dv + 2] = -INFINITY;
    o.data()[(full + 1) * Dv + 1] += 1.0f;
    td::write_result(dir / "mixed.h5", o, r.lse, "hand-made");
    const auto [nan, inf, wrong, empty_bad, out] = columns("mixed.h5");
    CHECK(nan == 0);
    CHECK(inf == 1);
    CHECK(wrong == 1);
    CHECK(empty_bad == 0);
    CHECK_THAT(out, Contains("1 inf row, first O[0, 0, 16, 2] = -inf") &&
                        Contains("1 value outside tolerance in 1 row, first O[0, 0, 17, 1]"));
  }
}

TEST_CASE("cli: check shows the candidate's dtype, the tolerances, errors in the rule's units",
          "[cli]") {
  temp_dir dir;
  const float_result r = reference_result("extreme_scores", dir);
  const outcome ok = check_candidate("extreme_scores", dir / "extreme_scores-reference.h5",
                                     " --json " + quoted(dir / "e.json"));
  CAPTURE(ok.out, ok.err);
  CHECK(ok.rc == 0);
  const nlohmann::json j = read_json(dir / "e.json")["rows"][0];
  // LSE of magnitude 1e3..1e4: an absolute error above atol_lse that the relative rule accepts.
  CHECK(j["max_lse_err"].get<double>() > j["tolerance"]["atol_lse"].get<double>());
  CHECK(j["lse_err_ratio"].get<double>() <= 1.0);
  CHECK(j["lse_err_ratio"].get<double>() ==
        Approx(j["max_lse_rel_err"].get<double>() / j["tolerance"]["atol_lse"].get<double>()));
  CHECK(j["tolerance"]["atol"].get<double>() == r.fx.tol.atol);
  CHECK(j["tolerance"]["rtol"].get<double>() == r.fx.tol.rtol);
  CHECK(j["o_dtype"] == "float32");
  CHECK(j["fixture_dtype"] == "float32");
  char atol[32];
  std::snprintf(atol, sizeof atol, "%.6g", r.fx.tol.atol);
  CHECK_THAT(ok.out, Contains("O err/tol") && Contains("LSE err/tol") &&
                         Contains("float32  inputs: atol = 2e-05 * max|V| = " + std::string(atol) +
                                  ", rtol = 2e-05, atol_lse = 1e-05"));

  // A float16 /o on a float32 fixture: the dtype column shows it and the verdict says why.
  const td::result back = td::read_result(dir / "extreme_scores-reference.h5", r.fx.golden);
  const flashref::test::float16_type f16;
  flashref::test::write_result_as(dir / "half_o.h5", back, f16.id, H5T_IEEE_F32LE);
  const outcome half = check_candidate("extreme_scores", dir / "half_o.h5");
  CAPTURE(half.out, half.err);
  CHECK(half.rc == 1);
  CHECK_THAT(half.out, Contains("float16/float32") &&
                           Contains("half-precision storage (/o in float16) cannot meet a "
                                    "float32 fixture's tolerance") &&
                           Contains("extreme_scores_bf16 or extreme_scores_fp16"));

  // A float16 /lse is named the same way.
  flashref::test::write_result_as(dir / "half_lse.h5", back, H5T_IEEE_F32LE, f16.id);
  const outcome half_lse = check_candidate("extreme_scores", dir / "half_lse.h5");
  CAPTURE(half_lse.out, half_lse.err);
  CHECK(half_lse.rc == 1);
  CHECK_THAT(half_lse.out, Contains("float32/float16") && Contains("(/lse in float16)"));

  // O rounded to bfloat16 but stored as float32: recognised from the values.
  xt::xtensor<float, 4> o = r.o;
  for (float& x : o)
    x = td::round_to(flashref::input_dtype::bfloat16, x);
  td::write_result(dir / "bf16_values.h5", o, r.lse, "hand-made");
  const outcome bf = check_candidate("extreme_scores", dir / "bf16_values.h5");
  CAPTURE(bf.out, bf.err);
  CHECK(bf.rc == 1);
  CHECK_THAT(bf.out, Contains("float32 ") && Contains("(/o in bfloat16)"));

  // An LSE in base 2 (FlashInfer's convention) is recognised.
  xt::xtensor<float, 3> lse2 = r.lse;
  for (float& x : lse2)
    x = float(double(x) / std::log(2.0));
  td::write_result(dir / "base2.h5", r.o, lse2, "hand-made");
  const outcome b2 = check_candidate("extreme_scores", dir / "base2.h5");
  CAPTURE(b2.out, b2.err);
  CHECK(b2.rc == 1);
  CHECK_THAT(b2.out, Contains("the LSE looks like base 2"));
  // ... and an LSE that is merely wrong is not called base 2.
  xt::xtensor<float, 3> off = r.lse;
  for (float& x : off)
    x += 3.0f;
  td::write_result(dir / "off.h5", r.o, off, "hand-made");
  const outcome wrong = check_candidate("extreme_scores", dir / "off.h5");
  CHECK(wrong.rc == 1);
  CHECK_THAT(wrong.out, !Contains("base 2") && !Contains("half-precision"));
}

TEST_CASE("cli: a result names its case and inputs; check refuses another fixture's", "[cli]") {
  temp_dir dir;
  const auto top_left = dir / "top_left.h5";
  REQUIRE(cli("run --backend reference --problem " + fixture_path("causal_lq_gt_lk_top_left") +
              " --out " + quoted(top_left))
              .rc == 0);
  require_bad_input(check_candidate("causal_lq_gt_lk", top_left),
                    "top_left.h5: / attribute 'case': expected 'causal_lq_gt_lk' (the fixture "
                    "causal_lq_gt_lk.h5), got 'causal_lq_gt_lk_top_left': a result of another "
                    "case");
  // Without the case, the digest of the inputs still tells them apart.
  const td::fixture tl = td::read_fixture(testdata_dir() / "causal_lq_gt_lk_top_left.h5");
  const td::result r = td::read_result(top_left, tl.golden);
  const xt::xtensor<float, 4> o = xt::cast<float>(r.o);
  const xt::xtensor<float, 3> lse = xt::cast<float>(r.lse);
  td::write_result(dir / "digest.h5", o, lse, "hand-made", "", td::inputs_digest(tl.in));
  const td::fixture br = td::read_fixture(testdata_dir() / "causal_lq_gt_lk.h5");
  require_bad_input(check_candidate("causal_lq_gt_lk", dir / "digest.h5"),
                    "digest.h5: / attribute 'inputs_digest': expected " + td::inputs_digest(br.in) +
                        " (the inputs of causal_lq_gt_lk.h5), got " + td::inputs_digest(tl.in) +
                        ": a result of other inputs");
  // A file without either (another tool's) is judged on its values.
  td::write_result(dir / "plain.h5", o, lse, "hand-made");
  const outcome plain = check_candidate("causal_lq_gt_lk", dir / "plain.h5");
  CAPTURE(plain.out, plain.err);
  CHECK(plain.rc == 1);
  CHECK_THAT(plain.out, Contains("FAIL"));
  CHECK(check_candidate("causal_lq_gt_lk_top_left", dir / "plain.h5").rc == 0);
  // The digest covers the options, not only the tensors.
  flashref::problem_data in = br.in;
  in.opt.causal = flashref::causal_mode::top_left;
  CHECK(td::inputs_digest(in) != td::inputs_digest(br.in));
  in = br.in;
  in.q(0, 0, 0, 0) = std::nextafter(in.q(0, 0, 0, 0), 10.0f);
  CHECK(td::inputs_digest(in) != td::inputs_digest(br.in));
}

TEST_CASE("cli: subsets of the cases: --cases, --skip-missing, unmatched candidate files",
          "[cli]") {
  temp_dir dir;
  const auto results = dir / "results";
  std::filesystem::create_directory(results);
  for (const char* name : {"gqa", "gqa_mqa", "dv_ne_d"}) {
    REQUIRE(cli("run --backend reference --problem " + fixture_path(name) + " --out " +
                quoted(results / (std::string(name) + ".h5")))
                .rc == 0);
  }
  flashref::test::write_text(results / "notes.txt", "not a result");
  std::filesystem::copy_file(results / "gqa.h5", results / "my_kernel_gqa.h5");
  const std::string folder_check =
      "check " + quoted(testdata_dir()) + " --candidate " + quoted(results);

  const outcome some = cli(folder_check + " --cases gqa,dv_ne_d");
  CAPTURE(some.out, some.err);
  CHECK(some.rc == 0);
  CHECK_THAT(some.out, Contains("2 checks: 2 pass, 0 fail") &&
                           Contains("candidate files that match no fixture (not judged): "
                                    "my_kernel_gqa.h5"));
  CHECK_THAT(some.out, !Contains("gqa_mqa") && !Contains("notes.txt"));

  const outcome skip = cli(folder_check + " --skip-missing --json " + quoted(dir / "s.json"));
  CAPTURE(skip.out, skip.err);
  CHECK(skip.rc == 0);
  const std::size_t skipped = td::cases().size() - 3;
  CHECK_THAT(skip.out, Contains("3 checks: 3 pass, 0 fail, 0 could not be run; " +
                                std::to_string(skipped) + " skipped (no candidate)") &&
                           Contains("skipped, no candidate file (--skip-missing): "
                                    "blocksparse_all_empty, "));
  const nlohmann::json js = read_json(dir / "s.json");
  CHECK(js["summary"]["checks"] == 3);
  CHECK(js["skipped"].size() == skipped);
  CHECK(js["unmatched_candidates"] == nlohmann::json::array({"my_kernel_gqa.h5"}));

  const outcome missing = cli(folder_check);  // without --skip-missing: ERROR rows, exit 2
  CHECK(missing.rc == 2);
  CHECK_THAT(missing.out, Contains("ERROR"));
  CHECK_THAT(missing.err, Contains("spec_random.h5: expected an existing file"));

  require_bad_input(cli(folder_check + " --cases gqa,nope"),
                    "--cases: expected fixtures of " + testdata_dir().string());
  require_bad_input(cli("check " + quoted(testdata_dir()) + " --candidate " +
                        quoted(dir / "empty") + " --skip-missing"),
                    "--candidate: expected a folder of <case>.h5 results");
  std::filesystem::create_directory(dir / "none");
  require_bad_input(cli("check " + quoted(testdata_dir()) + " --candidate " + quoted(dir / "none") +
                        " --skip-missing"),
                    "--candidate: expected <case>.h5 results for the fixtures of");
}

TEST_CASE("cli: --json - writes to standard output; a bad --json path fails before any check",
          "[cli]") {
  temp_dir dir;
  const outcome out = cli("check " + fixture_path("gqa") + " --backend reference --json -");
  CAPTURE(out.out, out.err);
  CHECK(out.rc == 0);
  CHECK(out.err.empty());
  const nlohmann::json js = nlohmann::json::parse(out.out);  // stdout is the JSON alone
  CHECK(js["rows"][0]["case"] == "gqa");
  CHECK(js["rows"][0]["judged"] == "reference");
  CHECK(dir.entries().empty());

  // Reported at once: no table, no check run.
  const outcome bad = cli("check " + quoted(testdata_dir()) + " --backend reference --json " +
                          quoted(dir / "no" / "v.json"));
  require_bad_input(bad, "--json: expected a file in an existing, writable folder");
  CHECK(bad.out.empty());
  require_bad_input(cli("check " + fixture_path("gqa") + " --json " + quoted(dir.path())),
                    "got a folder at");
}

TEST_CASE("cli: check exits 2 without leaving a JSON report", "[cli]") {
  temp_dir dir;
  const auto results = dir / "results";
  std::filesystem::create_directory(results);
  REQUIRE(cli("run --backend reference --problem " + fixture_path("gqa") + " --out " +
              quoted(results / "gqa.h5"))
              .rc == 0);
  flashref::test::write_text(results / "gqa_mqa.h5", "not hdf5");
  const outcome o = cli("check " + quoted(testdata_dir()) + " --cases gqa,gqa_mqa --candidate " +
                        quoted(results) + " --json " + quoted(dir / "v.json"));
  CAPTURE(o.out, o.err);
  CHECK(o.rc == 2);
  CHECK_THAT(o.out, Contains("ERROR"));
  CHECK_FALSE(std::filesystem::exists(dir / "v.json"));
  CHECK(dir.entries() == std::vector<std::string>{"results"});
  // A previous report stays as it was.
  flashref::test::write_text(dir / "v.json", "previous");
  CHECK(cli("check " + quoted(testdata_dir()) + " --cases gqa,gqa_mqa --candidate " +
            quoted(results) + " --json " + quoted(dir / "v.json"))
            .rc == 2);
  CHECK(read_text(dir / "v.json") == "previous");
}

TEST_CASE("cli: a candidate without /lse is judged on O alone", "[cli]") {
  temp_dir dir;
  const auto result = dir / "r.h5";
  REQUIRE(cli("run --problem " + fixture_path("causal_lq_gt_lk") + " --out " + quoted(result) +
              " --backend reference")
              .rc == 0);
  const td::fixture fx = td::read_fixture(testdata_dir() / "causal_lq_gt_lk.h5");
  const td::result r = td::read_result(result, fx.golden);
  h5::write_atomically(dir / "o_only.h5", [&](h5::file& f) {
    h5::dump(f, "/o", xt::xtensor<float, 4>(xt::cast<float>(r.o)));
  });
  const outcome ok =
      cli("check " + fixture_path("causal_lq_gt_lk") + " --candidate " + quoted(dir / "o_only.h5"));
  CAPTURE(ok.out, ok.err);
  CHECK(ok.rc == 0);
  CHECK_THAT(ok.out, Contains("PASS: no /lse: O judged alone"));
  // O alone still fails on an empty row whose output is not 0.
  xt::xtensor<float, 4> o = xt::cast<float>(r.o);
  o(0, 0, 0, 0) = 1.0f;  // row 0 sees no key (causal, Lq > Lk)
  h5::write_atomically(dir / "bad.h5", [&](h5::file& f) { h5::dump(f, "/o", o); });
  const outcome bad =
      cli("check " + fixture_path("causal_lq_gt_lk") + " --candidate " + quoted(dir / "bad.h5"));
  CHECK(bad.rc == 1);
  CHECK_THAT(bad.out, Contains("[1 O != 0]"));
}

TEST_CASE("cli: candidates stored as float64 or float16 are read and judged", "[cli]") {
  temp_dir dir;
  const auto ref = dir / "ref.h5";
  REQUIRE(cli("run --backend reference --problem " + fixture_path("half_inputs_fp16") + " --out " +
              quoted(ref))
              .rc == 0);
  const td::fixture fx = td::read_fixture(testdata_dir() / "half_inputs_fp16.h5");
  const td::result r = td::read_result(ref, fx.golden);
  const flashref::test::float16_type f16;
  flashref::test::write_result_as(dir / "f64.h5", r, H5T_IEEE_F64LE, H5T_IEEE_F64LE);
  const outcome f64 =
      cli("check " + fixture_path("half_inputs_fp16") + " --candidate " + quoted(dir / "f64.h5"));
  CAPTURE(f64.out, f64.err);
  CHECK(f64.rc == 0);
  flashref::test::write_result_as(dir / "f16.h5", r, f16.id, H5T_IEEE_F32LE);  // LSE float32
  CHECK(h5::type_of(h5::file::open(dir / "f16.h5"), "/o") == "float16");
  // A float16 O meets the float16 fixture's tolerance ...
  const outcome half =
      cli("check " + fixture_path("half_inputs_fp16") + " --candidate " + quoted(dir / "f16.h5"));
  CAPTURE(half.out, half.err);
  CHECK(half.rc == 0);
  // ... and a float16 O and LSE are judged, not refused, where float32 accuracy is required.
  REQUIRE(cli("run --backend reference --problem " + fixture_path("gqa") + " --out " +
              quoted(dir / "gqa.h5"))
              .rc == 0);
  const td::fixture g = td::read_fixture(testdata_dir() / "gqa.h5");
  const td::result rg = td::read_result(dir / "gqa.h5", g.golden);
  flashref::test::write_result_as(dir / "gqa16.h5", rg, f16.id, f16.id);
  const outcome coarse =
      cli("check " + fixture_path("gqa") + " --candidate " + quoted(dir / "gqa16.h5"));
  CAPTURE(coarse.out, coarse.err);
  CHECK(coarse.rc == 1);
  CHECK_THAT(coarse.out, Contains("values outside tolerance"));
}

TEST_CASE("cli: bad input is one line on stderr, exit status 2, and no output file", "[cli]") {
  temp_dir dir;
  const auto out = dir / "out.h5";
  const std::string to_out = " --out " + quoted(out);
  auto no_output = [&] { CHECK_FALSE(std::filesystem::exists(out)); };

  SECTION("missing problem file") {
    require_bad_input(cli("run --problem " + quoted(dir / "missing.h5") + to_out),
                      "missing.h5: expected an existing file, got no such file");
    no_output();
  }
  SECTION("a problem file that is not HDF5") {
    flashref::test::write_text(dir / "text.h5", "not hdf5");
    require_bad_input(cli("run --problem " + quoted(dir / "text.h5") + to_out),
                      "expected an HDF5 file");
    no_output();
  }
  SECTION("a truncated problem file") {
    std::filesystem::copy_file(testdata_dir() / "decode_lq1.h5", dir / "cut.h5");
    std::filesystem::resize_file(dir / "cut.h5", 100000);
    require_bad_input(cli("run --problem " + quoted(dir / "cut.h5") + to_out),
                      "cut.h5: expected an intact HDF5 file");
    no_output();
  }
  SECTION("q of the wrong dtype") {
    {
      flashref::test::raw_file r(dir / "int.h5");
      const std::vector<std::int32_t> x(16, 1);
      r.dataset("/inputs/q", H5T_STD_I32LE, H5T_NATIVE_INT32, {1, 1, 4, 4}, x.data());
      r.dataset("/inputs/k", H5T_STD_I32LE, H5T_NATIVE_INT32, {1, 1, 4, 4}, x.data());
      r.dataset("/inputs/v", H5T_STD_I32LE, H5T_NATIVE_INT32, {1, 1, 4, 4}, x.data());
    }
    require_bad_input(cli("run --problem " + quoted(dir / "int.h5") + to_out),
                      "int.h5:/inputs/q: expected a float type, got int32");
    no_output();
  }
  SECTION("a problem larger than the memory budget, refused before it is read") {
    REQUIRE(cli("run --problem " + fixture_path("spec_random") + to_out).rc == 0);
    std::filesystem::remove(out);
    const outcome big =
        cli("run --problem " + fixture_path("spec_random") + to_out, "FLASHREF_MEMORY_LIMIT=100");
    require_bad_input(big, "spec_random.h5: the problem's storage: expected at most 100 bytes");
    CHECK_THAT(big.err, Contains("(FLASHREF_MEMORY_LIMIT), got "));
    no_output();
  }
  SECTION("unknown and unavailable backends") {
    require_bad_input(cli("run --problem " + fixture_path("gqa") + to_out + " --backend gpu9"),
                      "backend: expected one of reference, cpu, cuda, automatic, got 'gpu9'");
    for (const flashref::backend_info& info : flashref::backends()) {
      if (info.available) continue;
      require_bad_input(cli("run --problem " + fixture_path("gqa") + to_out + " --backend " +
                            flashref::to_string(info.id)),
                        "backend: expected an available backend");
    }
    no_output();
  }
  SECTION("an output folder that does not exist") {
    require_bad_input(
        cli("run --problem " + fixture_path("gqa") + " --out " + quoted(dir / "no" / "out.h5")),
        "expected a path in an existing folder");
  }
  SECTION("a failed run keeps the previous output untouched") {
    REQUIRE(cli("run --problem " + fixture_path("gqa") + to_out).rc == 0);
    const std::string before = read_text(out);
    require_bad_input(cli("run --problem " + quoted(dir / "missing.h5") + to_out), "missing.h5");
    CHECK(read_text(out) == before);
    CHECK(dir.entries() == std::vector<std::string>{"out.h5"});
  }
  SECTION("check: a candidate of the wrong shape, a missing fixture, conflicting options") {
    REQUIRE(cli("run --problem " + fixture_path("gqa") + to_out).rc == 0);
    const td::fixture g = td::read_fixture(testdata_dir() / "gqa.h5");
    h5::write_atomically(dir / "out.h5", [&](h5::file& f) {  // another tool's file: no case
      h5::dump(f, "/o", xt::xtensor<float, 4>(xt::cast<float>(td::read_result(out, g.golden).o)));
    });
    const outcome shape = cli("check " + fixture_path("gqa_mqa") + " --candidate " + quoted(out));
    CHECK_THAT(shape.out, Contains("ERROR"));
    require_bad_input(shape, "out.h5:/o: expected shape [2, 4, 12, 16], got [1, 8, 16, 16]");
    require_bad_input(cli("check " + quoted(dir / "none.h5") + " --backend reference"),
                      "none.h5: expected a fixture file or folder, got no such path");
    require_bad_input(cli("check " + fixture_path("gqa") + " --candidate " + quoted(out) +
                          " --backend reference"),
                      "expected one of them, got both");
    require_bad_input(cli("check " + quoted(testdata_dir()) + " --candidate " + quoted(out)),
                      "--candidate: expected a folder of <case>.h5 results when checking a folder "
                      "of fixtures, got the file ");
    require_bad_input(
        cli("check " + quoted(testdata_dir()) + " --candidate " + quoted(dir / "nope")),
        "--candidate: expected a folder of <case>.h5 results when checking a folder of "
        "fixtures, got no such path ");
    require_bad_input(cli("run --problem " + fixture_path("gqa")), "--out is required");
  }
}

TEST_CASE("cli: a folder of candidates from run passes check, and so does every backend", "[cli]") {
  temp_dir dir;
  for (const td::case_info& c : td::cases()) {
    CAPTURE(c.name);
    REQUIRE(cli("run --backend reference --problem " + fixture_path(c.name) + " --out " +
                quoted(dir / (c.name + ".h5")))
                .rc == 0);
  }
  const outcome cand =
      cli("check " + quoted(testdata_dir()) + " --candidate " + quoted(dir.path()));
  CAPTURE(cand.out, cand.err);
  CHECK(cand.rc == 0);
  CHECK_THAT(cand.out, Contains(std::to_string(td::cases().size()) + " checks: " +
                                std::to_string(td::cases().size()) + " pass, 0 fail"));
  // A case without its candidate cannot be judged: bad input.
  std::filesystem::remove(dir / "gqa.h5");
  const outcome missing =
      cli("check " + quoted(testdata_dir()) + " --candidate " + quoted(dir.path()));
  CHECK(missing.rc == 2);
  CHECK_THAT(missing.err, Contains("gqa.h5: expected an existing file"));

  const outcome all = cli("check " + quoted(testdata_dir()));  // every available backend
  CAPTURE(all.out, all.err);
  CHECK(all.rc == 0);
  CHECK_THAT(all.out, Contains("reference") && Contains(" 0 fail"));
}

TEST_CASE("cli: fixtures verify names the case and the dataset that differ", "[cli]") {
  temp_dir dir;
  for (const td::case_info& c : td::cases())
    std::filesystem::copy_file(testdata_dir() / (c.name + ".h5"), dir / (c.name + ".h5"));
  const outcome same = cli("fixtures verify " + quoted(dir.path()));
  CAPTURE(same.out, same.err);
  CHECK(same.rc == 0);
  CHECK_THAT(same.out, Contains("bit-identical"));

  poke(dir / "spec_random.h5", "/golden/o", 5, 0.25);
  flashref::test::write_text(dir / "stale.h5", "old");
  const outcome changed = cli("fixtures verify " + quoted(dir.path()));
  CAPTURE(changed.out, changed.err);
  CHECK(changed.rc == 1);
  CHECK_THAT(changed.out, Contains("DIFF spec_random: /golden/o: 1 of 8 elements differ, first at "
                                   "[0, 0, 0, 5]: expected 0.25") &&
                              Contains("DIFF stale.h5: not a case of this generator") &&
                              Contains("2 differences"));

  std::filesystem::remove(dir / "gqa.h5");
  CHECK_THAT(cli("fixtures verify " + quoted(dir.path())).out, Contains("gqa: missing file"));
}

TEST_CASE("cli: fixtures regenerate and list", "[cli]") {
  temp_dir dir;
  const outcome regen = cli("fixtures regenerate " + quoted(dir / "fresh"));
  CAPTURE(regen.out, regen.err);
  CHECK(regen.rc == 0);
  const std::string n = std::to_string(td::cases().size());
  CHECK_THAT(regen.out,
             Contains("[ 1/" + n + "] spec_random") && Contains("/" + n + "] half_inputs_fp16"));
  CHECK(cli("fixtures verify " + quoted(dir / "fresh")).rc == 0);
  for (const auto& e : std::filesystem::directory_iterator(dir / "fresh"))
    CHECK(e.path().extension() == ".h5");  // no temporary left behind

  const outcome list = cli("fixtures list");
  CHECK(list.rc == 0);
  for (const td::case_info& c : td::cases())
    CHECK_THAT(list.out, Contains(c.name));
}

TEST_CASE("cli: run --backward writes gradients that check judges, naming how an empty row fails",
          "[cli][backward]") {
  temp_dir dir;
  const std::string fixture = fixture_path("bwd_empty_row_in_tile");
  const auto result = dir / "r.h5";
  const outcome run =
      cli("run --backward --problem " + fixture + " --out " + quoted(result) + " --backend cpu");
  CAPTURE(run.out, run.err);
  REQUIRE(run.rc == 0);
  CHECK_THAT(run.out, Contains("/dq [1, 2, 32, 16], /dk [1, 2, 48, 16], /dv [1, 2, 48, 16]"));
  for (const char* name : {"/dq", "/dk", "/dv"})
    CHECK(h5::type_of(h5::file::open(result), name) == "float32");

  const outcome pass = cli("check " + fixture + " --candidate " + quoted(result));
  CAPTURE(pass.out, pass.err);
  CHECK(pass.rc == 0);
  CHECK_THAT(pass.out, Contains("dq,dk,dv") && Contains("PASS"));

  // The same gradients with an empty row's dQ set to NaN, then to a small non-zero value, and
  // a gradient-free problem run --backward.
  const td::fixture fx = td::read_fixture(testdata_dir() / "bwd_empty_row_in_tile.h5");
  const td::result r = td::read_result(result, fx.golden, &*fx.grads);
  flashref::attention_outputs out;
  out.o = xt::cast<float>(r.o);
  out.lse = xt::cast<float>(r.lse);
  out.dq = xt::cast<float>(*r.dq);
  out.dk = xt::cast<float>(*r.dk);
  out.dv = xt::cast<float>(*r.dv);
  const std::size_t D = out.dq.shape(3), empty_row = 9;  // head 0, row 9 sees nothing
  out.dq.data()[empty_row * D] = NAN;
  td::write_result(dir / "nan.h5", out, "hand-made", true);
  const outcome nan = cli("check " + fixture + " --candidate " + quoted(dir / "nan.h5"));
  CAPTURE(nan.out, nan.err);
  CHECK(nan.rc == 1);
  CHECK_THAT(nan.out, Contains("dq: 1 empty rows with a NaN gradient"));
  out.dq.data()[empty_row * D] = 1e-3f;
  td::write_result(dir / "nonzero.h5", out, "hand-made", true);
  const outcome nonzero = cli("check " + fixture + " --candidate " + quoted(dir / "nonzero.h5"));
  CAPTURE(nonzero.out, nonzero.err);
  CHECK(nonzero.rc == 1);
  CHECK_THAT(nonzero.out, Contains("dq: 1 empty rows with a non-zero dQ"));

  // Only dV present, and wrong by a little for one unseen key.
  const td::fixture fu = td::read_fixture(testdata_dir() / "bwd_unseen_key.h5");
  const auto ru = dir / "u.h5";
  REQUIRE(cli("run --backward --problem " + fixture_path("bwd_unseen_key") + " --out " +
              quoted(ru) + " --backend reference")
              .rc == 0);
  const td::result u = td::read_result(ru, fu.golden, &*fu.grads);
  xt::xtensor<float, 4> dv = xt::cast<float>(*u.dv);
  dv.data()[5 * dv.shape(3)] = 1e-6f;  // key 5 of head 0 is seen by no row
  h5::write_atomically(dir / "dv_only.h5", [&](h5::file& f) {
    h5::dump(f, "/o", xt::xtensor<float, 4>(xt::cast<float>(u.o)));
    h5::dump(f, "/lse", xt::xtensor<float, 3>(xt::cast<float>(u.lse)));
    h5::dump(f, "/dv", dv);
  });
  const outcome only =
      cli("check " + fixture_path("bwd_unseen_key") + " --candidate " + quoted(dir / "dv_only.h5"));
  CAPTURE(only.out, only.err);
  CHECK(only.rc == 1);
  CHECK_THAT(only.out, Contains(" dv ") &&
                           Contains("dv: 1 keys no row sees with a non-zero dv (an empty row's "
                                    "contribution)"));

  // A problem without /inputs/do cannot run --backward.
  const auto no_do = dir / "p.h5";
  h5::write_atomically(no_do, [&](h5::file& f) {
    h5::dump(f, "/inputs/q", fx.in.q);
    h5::dump(f, "/inputs/k", fx.in.k);
    h5::dump(f, "/inputs/v", fx.in.v);
  });
  require_bad_input(
      cli("run --backward --problem " + quoted(no_do) + " --out " + quoted(dir / "never.h5")),
      "/inputs/do: expected the upstream gradient");
  CHECK_FALSE(std::filesystem::exists(dir / "never.h5"));
}

TEST_CASE("cli: explain --backward walks one row and each empty-row LSE convention",
          "[cli][backward]") {
  const outcome row = cli("explain --case spec_masked_first_block --backward");
  CAPTURE(row.out, row.err);
  CHECK(row.rc == 0);
  CHECK_THAT(row.out, Contains("sum_j P_j = 1") && Contains("Delta = sum_d dO_d O_d"));
  const outcome empty = cli("explain --case spec_all_masked --backward");
  CAPTURE(empty.out, empty.err);
  CHECK(empty.rc == 0);
  CHECK_THAT(empty.out, Contains("NaN / +inf") && Contains("LSE +inf (FA2)"));
  require_bad_input(cli("explain --case extreme_scores --backward"),
                    "--backward: expected a case with /inputs/do");
}
