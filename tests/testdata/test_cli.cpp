// The CLI's fixture commands as a user runs them: exit statuses (0 pass, 1 a failing candidate
// or a changed fixture, 2 bad input), one line on stderr for bad input, no output file left.

#include <sys/wait.h>
#include <fstream>
#include <iterator>

#include <catch2/catch.hpp>

#include <cstdlib>

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
outcome cli(const std::string& args) {
  const temp_dir logs;
  const std::string cmd = quoted(FLASHREF_CLI) + " " + args + " >" + quoted(logs / "out") + " 2>" +
                          quoted(logs / "err");
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

  const outcome pass =
      cli("check " + fixture_path("blocksparse_empty_rows") + " --candidate " + quoted(result));
  CAPTURE(pass.out, pass.err);
  CHECK(pass.rc == 0);
  CHECK_THAT(pass.out, Contains("blocksparse_empty_rows") && Contains("PASS") &&
                           Contains("32/32") && Contains("1 pass, 0 fail"));

  // A hand-made candidate with one NaN row in a non-empty row.
  std::size_t row = 0;
  while (fx.golden.lse[row] == -INFINITY)
    ++row;
  xt::xtensor<float, 4> o = xt::cast<float>(r.o);
  xt::xtensor<float, 3> lse = xt::cast<float>(r.lse);
  const std::size_t Dv = o.shape(3);
  o.data()[row * Dv + 3] = NAN;
  td::write_result(dir / "nan.h5", o, lse, "hand-made");
  const outcome nan = cli("check " + fixture_path("blocksparse_empty_rows") + " --candidate " +
                          quoted(dir / "nan.h5"));
  CAPTURE(nan.out, nan.err);
  CHECK(nan.rc == 1);
  CHECK_THAT(nan.out, Contains("FAIL: 1 NaN/inf rows") && Contains("0 pass, 1 fail"));

  // FlashAttention-2's +inf or PyTorch's 0 as the LSE of an empty row is a failure too.
  o.data()[row * Dv + 3] = float(r.o.data()[row * Dv + 3]);
  std::size_t empty = 0;
  while (fx.golden.lse[empty] != -INFINITY)
    ++empty;
  lse.data()[empty] = 0.0f;
  td::write_result(dir / "zero_lse.h5", o, lse, "hand-made");
  const outcome zero = cli("check " + fixture_path("blocksparse_empty_rows") + " --candidate " +
                           quoted(dir / "zero_lse.h5"));
  CAPTURE(zero.out, zero.err);
  CHECK(zero.rc == 1);
  CHECK_THAT(zero.out, Contains("FAIL: 1 empty rows not (0, -inf) [1 LSE 0]") && Contains("31/32"));

  // +inf LSE and a non-zero O on empty rows are named as such, and recorded in --json.
  lse.data()[empty] = INFINITY;
  o.data()[empty * Dv] = 0.5f;
  td::write_result(dir / "inf_lse.h5", o, lse, "hand-made");
  const outcome inf = cli("check " + fixture_path("blocksparse_empty_rows") + " --candidate " +
                          quoted(dir / "inf_lse.h5") + " --json " + quoted(dir / "v.json"));
  CAPTURE(inf.out, inf.err);
  CHECK(inf.rc == 1);
  CHECK_THAT(inf.out, Contains("[1 O != 0, 1 LSE +inf]"));
  std::ifstream js(dir / "v.json");
  const std::string json((std::istreambuf_iterator<char>(js)), std::istreambuf_iterator<char>());
  CHECK_THAT(json, Contains("\"verdict\": \"fail\"") && Contains("\"empty_lse_posinf\": 1") &&
                       Contains("\"empty_o_nonzero\": 1"));
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
    const outcome shape = cli("check " + fixture_path("gqa_mqa") + " --candidate " + quoted(out));
    CHECK_THAT(shape.out, Contains("ERROR"));
    require_bad_input(shape, "out.h5:/o: expected shape [2, 4, 12, 16], got [1, 8, 16, 16]");
    require_bad_input(cli("check " + quoted(dir / "none.h5") + " --backend reference"),
                      "none.h5: expected a fixture file or folder, got no such path");
    require_bad_input(cli("check " + fixture_path("gqa") + " --candidate " + quoted(out) +
                          " --backend reference"),
                      "expected one of them, got both");
    require_bad_input(cli("check " + quoted(testdata_dir()) + " --candidate " + quoted(out)),
                      "--candidate: expected a folder");
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
