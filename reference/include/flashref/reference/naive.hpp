#pragma once
// The golden semantics: a naive float64 three-pass reference (scores, row max, exp-sum,
// normalise). It shares no code with the tiled paths — not the online-softmax state, not the
// mask helper — so it cannot share their bugs.

#include <array>
#include <cstdint>
#include <vector>

#include "flashref/reference/problem.hpp"

namespace flashref::reference {

struct golden {
  std::array<std::int64_t, 4> o_shape{};  // (B, Hq, Lq, Dv)
  std::vector<double> o;                  // row-major (B, Hq, Lq, Dv)
  std::vector<double> lse;                // row-major (B, Hq, Lq); -inf on empty rows
};

// Computes O and LSE in float64 from the problem's inputs. The problem's output views are
// neither read nor written. Throws problem_error on an invalid problem.
golden naive_attention(const attention_problem& p);

}  // namespace flashref::reference
