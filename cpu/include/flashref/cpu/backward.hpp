#pragma once
// flashref::cpu — the OpenMP backward pass (SPEC §9) in the forward's instruction-set scheme
// (AVX-512 / AVX2+FMA / portable, chosen at run time). FlashAttention-2 order: Delta first,
// then for each key tile the query tiles that see it, P recomputed from the stored LSE; key
// tiles no query sees and query tiles that see no key of a tile are skipped, never loaded.
//
// Results are bitwise identical for any thread count and from run to run: a work item owns
// the dK, dV rows of its key tiles and its own partial dQ; the partial dQs are summed in a fixed
// order. The split depends on the shape, the tile sizes and the instruction set only. Memory
// beyond the inputs and gradients is that partial dQ (at most kMaxBackwardChunks copies of dQ)
// and a per-thread tile workspace: linear in the sequence length.

#include <cstdint>

#include "flashref/cpu/attention.hpp"
#include "flashref/reference/backward.hpp"

namespace flashref::cpu {

// How a backward will be run.
struct backward_plan {
  isa used = isa::portable;
  std::int64_t tile_q = 0, tile_k = 0;
  std::int64_t chunks = 1;  // interleaved groups of key tiles per (batch, key/value head)
  int threads = 1;
};

// Throws problem_error for an invalid problem, gradient tensor or option. options::kv_chunk
// does not apply to the backward; tile_q / tile_k of 0 take the backward's own defaults.
backward_plan make_backward_plan(const attention_problem& p, const options& opt = {});

// Reads p's inputs and its o, lse (the forward's results); writes g.dq, g.dk, g.dv.
void attention_backward(const attention_problem& p, const attention_gradients& g,
                        const options& opt = {});

}  // namespace flashref::cpu
