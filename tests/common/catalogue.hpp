#pragma once
// The conformance catalogue, written once: the edge cases of SPEC §2 (first), every mask
// combined, and random problems. The conformance suite runs it over every backend that
// flashref::backends() lists; a backend's own tests run it over its variants (instruction
// sets, kernels) through the same runner.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "problem.hpp"

namespace flashref::test {

struct catalogue_case {
  std::string name;  // what it pins
  problem_shape shape;
  std::uint64_t seed = 1;
  // Q and K rounded to integers and scale 1, so that scores of magnitude 1e3..1e4 are exact in
  // every dtype and only the softmax itself is judged.
  bool integer_qk = false;
  // The backward: about this much added to every score with P kept spread (offset_scores in
  // backward_check.hpp), so that a recomputation that does not start from the stored LSE shows.
  double score_offset = 0.0;
  // A softmax scale of the case's own in place of 1/sqrt(D) (SPEC allows any finite one): 0
  // (every visible key alike) and negative scales, where the largest score is the smallest
  // product and a kernel that folds the scale into its exponent must not.
  std::optional<double> scale = std::nullopt;
};

// Edge cases: zero sizes, lengths around common tile sizes, both causal alignments with more
// and fewer queries than keys, windows (some empty), kv_len = 0, block masks (all empty,
// sparse, all full, sizes that divide nothing, broadcast), GQA/MQA, [B, L, H, D], Dv != D,
// head dims from 1 to 256, extreme scores, decode shapes.
std::vector<catalogue_case> edge_cases();
// Every mask alone and combined: causal x window x block mask x kv_len.
std::vector<catalogue_case> combined_masks();
// Random shapes and masks (random_shape), seeds first_seed .. first_seed + count - 1.
std::vector<catalogue_case> random_cases(std::uint64_t first_seed, int count);

// The problem of a case with inputs representable in `dtype` and poisoned outputs.
problem_data build(const catalogue_case& c, input_dtype dtype);

// Computes the outputs of a problem (a backend, or one variant of a backend).
using runner = std::function<void(const attention_problem&)>;

// Builds the case, runs it and requires it to meet the contract with `dtype`'s tolerance
// (Catch2 assertions; the case and dtype are captured).
void check_case(const catalogue_case& c, input_dtype dtype, const runner& run);

// NaN in one input (q, k or v) reaches exactly the rows the golden result marks, never others.
void check_nan_isolation(input_dtype dtype, const runner& run);

// --- the backward pass (SPEC §9)

// The backward's own edge cases: zero sizes, empty rows next to full rows in one tile, keys no
// row sees, kv_len = 0 and kv_len cutting a tile, block masks (empty to full, sizes that divide
// nothing, broadcast), GQA with an empty row in one head of a group, windows, GQA/MQA with
// Dv != D in [B, L, H, D], scores of magnitude 1e3, long keys, every mask combined at small
// head dims. Shapes small enough for a scalar backend at any tile size.
std::vector<catalogue_case> backward_edge_cases();

// A forward case as the backward runs it: inputs kept at unit scale and at least two keys
// (well_conditioned in backward_check.hpp says why; the cases meant for large scores
// included), the one-key window (0, 0) widened to (0, 1).
catalogue_case for_backward(catalogue_case c);

// The whole catalogue as the backward sees it: its own edge cases first, then every edge case,
// combined mask and random case (seeds 0 .. 60) for_backward.
std::vector<catalogue_case> backward_cases();

// Computes p's gradients; p.o and p.lse hold the forward's results.
using backward_runner = std::function<void(const attention_problem&, const attention_gradients&)>;

// One way of computing the gradients (a backend, or one variant of it: instruction set, tiles).
struct backward_variant {
  std::string name;  // captured with a failure
  runner forward;
  backward_runner backward;
};

// Builds the case (float32) and its golden gradients once; then, for each variant on a copy of
// the inputs, runs `forward` then `backward` and requires dQ, dK, dV to meet SPEC §9 against
// the naive float64 golden gradients, empty rows and unseen keys exactly 0.
void check_backward_case(const catalogue_case& c, const std::vector<backward_variant>& variants);
void check_backward_case(const catalogue_case& c, const runner& forward,
                         const backward_runner& backward);

}  // namespace flashref::test
