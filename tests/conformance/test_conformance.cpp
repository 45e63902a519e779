// The conformance suite: the one catalogue (tests/common/catalogue.hpp) over every backend
// that flashref::backends() lists as available, in every input dtype the backend has a path
// for, judged against the naive float64 reference with that dtype's tolerance. A new backend
// joins by registering in backends(); no test code changes.
#include <catch2/catch.hpp>

#include "backward_check.hpp"
#include "catalogue.hpp"
#include "flashref/flashref.hpp"

using flashref::test::catalogue_case;

namespace {

// Runs `body(runner, dtype)` once per available backend and dtype, each in its own section.
template <class F>
void over_backends(F&& body) {
  int ran = 0;
  for (const flashref::backend_info& info : flashref::backends()) {
    if (!info.available) continue;  // e.g. CUDA without a device
    for (const flashref::input_dtype dtype : info.dtypes) {
      DYNAMIC_SECTION(flashref::to_string(info.id) << " " << flashref::to_string(dtype)) {
        const flashref::backend id = info.id;
        body([id](const flashref::attention_problem& p) { flashref::attention(p, id); }, dtype);
      }
      ++ran;
    }
  }
  REQUIRE(ran >= 2);  // at least the reference and the CPU backend
}

void run_all(const std::vector<catalogue_case>& cases) {
  over_backends([&](const flashref::test::runner& run, flashref::input_dtype dtype) {
    for (const catalogue_case& c : cases)
      flashref::test::check_case(c, dtype, run);
  });
}

}  // namespace

TEST_CASE("conformance: edge cases", "[conformance]") {
  run_all(flashref::test::edge_cases());
}

TEST_CASE("conformance: every mask combined", "[conformance]") {
  run_all(flashref::test::combined_masks());
}

TEST_CASE("conformance: random problems", "[conformance][random]") {
  run_all(flashref::test::random_cases(1, 120));
}

TEST_CASE("conformance: NaN in an input reaches only the rows that read it", "[conformance]") {
  over_backends([](const flashref::test::runner& run, flashref::input_dtype dtype) {
    flashref::test::check_nan_isolation(dtype, run);
  });
}

TEST_CASE("conformance: the backward pass of every backend that has one",
          "[conformance][backward]") {
  int ran = 0;
  const std::vector<catalogue_case> cases = flashref::test::backward_cases();
  for (const flashref::backend_info& info : flashref::backends()) {
    if (!info.available || !info.backward) continue;
    DYNAMIC_SECTION(flashref::to_string(info.id) << " backward") {
      const flashref::backend id = info.id;
      for (const catalogue_case& c : cases) {
        flashref::test::check_backward_case(
            c, [id](const flashref::attention_problem& p) { flashref::attention(p, id); },
            [id](const flashref::attention_problem& p, const flashref::attention_gradients& g) {
              flashref::attention_backward(p, g, id);
            });
      }
    }
    ++ran;
  }
  REQUIRE(ran >= 2);  // at least the reference and the CPU backend
}

TEST_CASE("conformance: a backend without a backward says so", "[conformance][backward]") {
  for (const flashref::backend_info& info : flashref::backends()) {
    if (!info.available || info.backward) continue;
    flashref::problem_data d = flashref::test::random_problem({}, 1);
    flashref::attention(d.problem(), info.id);
    flashref::test::add_upstream_gradient(d, 1);
    REQUIRE_THROWS_WITH(flashref::attention_backward(d.problem(), d.gradients(), info.id),
                        Catch::Contains("expected a backend with a backward pass"));
  }
}
