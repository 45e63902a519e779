#pragma once
// The scalar tiled reference: the whole problem, tile by tile, through the online-softmax
// state. Tiles of keys with no visible key are skipped; the element mask is applied only on
// tiles that straddle a mask boundary; rows with no visible key give (0, -inf). Its tile sizes
// are its own and independent of the mask's block sizes.

#include <cstdint>

#include "flashref/reference/problem.hpp"

namespace flashref::reference {

struct tile_shape {
  std::int64_t q = 16;  // query rows per tile
  std::int64_t k = 32;  // keys per tile
};

// Writes p.o and p.lse (when present). Accumulates in float64.
void tiled_attention(const attention_problem& p, tile_shape tile = {});

}  // namespace flashref::reference
