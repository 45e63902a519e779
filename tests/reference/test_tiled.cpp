// The scalar tiled reference at tile sizes of its own: the conformance catalogue (the suite in
// tests/conformance runs it at the default tiles) with tiles from 1 upwards, and independence
// of the tile sizes.
#include <catch2/catch.hpp>

#include "../common/catalogue.hpp"
#include "../common/check.hpp"
#include "flashref/reference/tiled.hpp"

using flashref::causal_mode;
using flashref::test::catalogue_case;
using flashref::test::problem_shape;

namespace {

flashref::test::runner with_tiles(flashref::reference::tile_shape tile) {
  return [tile](const flashref::attention_problem& p) {
    flashref::reference::tiled_attention(p, tile);
  };
}

}  // namespace

TEST_CASE("tiled reference: the catalogue at small and odd tiles", "[tiled]") {
  using tiles = flashref::reference::tile_shape;
  const tiles tile = GENERATE(tiles{3, 5}, tiles{16, 32}, tiles{1, 1});
  CAPTURE(tile.q, tile.k);
  for (const catalogue_case& c : flashref::test::edge_cases())
    flashref::test::check_case(c, flashref::input_dtype::float32, with_tiles(tile));
  for (const catalogue_case& c : flashref::test::combined_masks())
    flashref::test::check_case(c, flashref::input_dtype::float32, with_tiles(tile));
}

TEST_CASE("tiled reference: random problems at random tiles", "[tiled]") {
  for (const catalogue_case& c : flashref::test::random_cases(1, 60)) {
    const flashref::reference::tile_shape tile{1 + std::int64_t(c.seed % 17),
                                               1 + std::int64_t((c.seed * 7) % 33)};
    CAPTURE(tile.q, tile.k);
    flashref::test::check_case(c, flashref::input_dtype::float32, with_tiles(tile));
  }
}

TEST_CASE("tiled reference: results do not depend on its tile sizes", "[tiled]") {
  problem_shape s;
  s.B = 1, s.Hq = 2, s.Lq = 41, s.Lk = 67, s.D = 8, s.Dv = 8, s.block_q = 5, s.block_k = 13;
  s.causal = causal_mode::bottom_right;
  flashref::problem_data a = flashref::test::random_problem(s, 11);
  flashref::problem_data b = flashref::test::random_problem(s, 11);
  flashref::reference::tiled_attention(a.problem(), {1, 1});
  flashref::reference::tiled_attention(b.problem(), {64, 64});
  FLASHREF_REQUIRE_OUTPUTS_CLOSE(a, b, 1e-6);
}
