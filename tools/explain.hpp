#pragma once
// flashref explain: inputs of the spec function, where they come from, and the options.

#include <cstdint>
#include <optional>
#include <string>

#include <xtensor/xtensor.hpp>

#include "flashref/reference/problem.hpp"
#include "flashref/reference/spec.hpp"
#include "flashref/testdata/fixture.hpp"

namespace flashref::cli {

struct explain_inputs {
  std::string name;                       // where the inputs came from
  xt::xtensor<double, 1> q;               // (D)
  xt::xtensor<double, 2> K;               // (Lk, D)
  xt::xtensor<double, 2> V;               // (Lk, Dv)
  xt::xtensor<std::uint8_t, 1> key_mask;  // (Lk), or empty = all visible
  double scale = 1.0;
  std::int64_t tile = 4;
};

struct explain_options {
  std::string case_name;      // a fixture case
  std::string dir;            // fixture folder
  std::string q, k, v, mask;  // inline inputs
  std::optional<double> scale;
  std::optional<std::int64_t> tile;
  std::string variant = "all";
  std::string svg;                   // trace figure
  std::string mask_map;              // block visibility figure
  std::int64_t b = 0, h = 0, i = 0;  // the row of a multi-row case
  bool backward = false;             // the row through the backward pass instead
};

explain_inputs inline_inputs(const explain_options& opt);
double invariant_deviation(const explain_inputs& in, const reference::spec_step& step);
std::string mask_map_svg(const attention_problem& p, std::int64_t b, std::int64_t h,
                         const std::string& title);
int run_explain(const explain_inputs& in, const explain_options& opt);

// The backward pass of one row of a fixture (explain_backward.cpp): exit status 0 when the row's
// dQ recomputed from the stored LSE matches the golden one.
int run_explain_backward(const testdata::fixture& fx, std::int64_t b, std::int64_t h,
                         std::int64_t i);

}  // namespace flashref::cli
