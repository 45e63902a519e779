#pragma once
// The judge of `flashref check`, in one place for every front end (the CLI, the Python package):
// one result (O, LSE) against one fixture's golden values and tolerances, the verdict, the
// sentence that says why a result fails, and the table the CLI prints.

#include <cstddef>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "flashref/reference/backward.hpp"
#include "flashref/reference/conformance.hpp"
#include "flashref/testdata/fixture.hpp"

namespace flashref::testdata {

enum class verdict { pass, fail, error };
const char* to_string(verdict v);

// The judged result, flat and row-major: O (B, Hq, Lq, Dv) and LSE (B, Hq, Lq) or none.
struct judged_values {
  const double* o = nullptr;
  const double* lse = nullptr;
  std::size_t o_size = 0;
};

// The gradients a result holds, row-major like the fixture's golden ones (null: not held).
struct judged_gradients {
  const float* dq = nullptr;
  const float* dk = nullptr;
  const float* dv = nullptr;
};

// The backward's gradients judged for one row: each tensor present (SPEC §9).
struct gradient_verdicts {
  std::optional<gradient_report> dq, dk, dv;
  std::string judged() const;  // "dq,dk,dv", or "-" for none
  bool pass() const { return (!dq || dq->pass()) && (!dk || dk->pass()) && (!dv || dv->pass()); }
};

// One check: one fixture, one judged result.
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

// A row for the fixture fx with what the fixture alone says (case, dtype, tolerances, max|V|);
// judge() fills in the rest.
check_row row_for(const fixture& fx, const std::string& stem);

// Judges x (and the gradients g holds, against the fixture's golden ones when it has them) into
// row: the report, the verdict, the hints and the message. fixture_file locates the fixture's
// half-precision twins, named in a hint when one applies.
void judge(check_row& row, const fixture& fx, const judged_values& x,
           const std::filesystem::path& fixture_file, std::size_t keep_worst,
           const judged_gradients& g = {});

// x as text: "nan", "+inf", "-inf" or %.6g.
std::string number(double x);

// The verdict table `flashref check` prints, one line per row under a header.
std::string check_table(const std::vector<check_row>& rows);
// The rule and the tolerances the table applied, one line per input dtype of the fixtures
// (empty when no row was measured).
std::string tolerance_lines(const std::vector<check_row>& rows);

}  // namespace flashref::testdata
