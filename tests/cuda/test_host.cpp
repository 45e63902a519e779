// Host-side rules of the CUDA backend that need no device, so that every build checks them:
// the fixed-point scale of the Hopper backward's dQ (launch.hpp, dq_fixed_scale), on which its
// bitwise determinism and its range argument rest (hopper/backward.cuh, "dQ in fixed point"),
// the count of visible pairs that decides where it runs (launch.hpp, visible_pairs), and the
// order of the Hopper forward's work items (launch.hpp, work_place_of).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "launch.hpp"

using flashref::cuda::detail::dq_fixed_scale;

namespace {

// Whether x is 2^k for an integer k (a positive normal or subnormal float with one bit set).
bool power_of_two(float x) {
  int e = 0;
  return x > 0.f && std::frexp(x, &e) == 0.5f;
}

}  // namespace

TEST_CASE("dq_fixed_scale puts a row's bound in [2^28, 2^29) by a power of two", "[cuda][host]") {
  std::vector<float> bounds = {1.f,      0.5f,  0.75f,   3.f,   1e-3f,   1e3f,   123456.f,
                               0x1p-98f, 1e20f, 3.4e38f, 6e-8f, 0x1p28f, 0x1p29f};
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> mantissa(0.5f, 1.f);
  std::uniform_int_distribution<int> exponent(-90, 120);
  for (int i = 0; i < 2000; ++i)
    bounds.push_back(std::ldexp(mantissa(gen), exponent(gen)));
  for (const float b : bounds) {
    CAPTURE(b);
    const float s = dq_fixed_scale(b);
    REQUIRE(power_of_two(s));
    // Exact in double: b s is what the kernel's parts stay below, and no finer unit would fit.
    const double scaled = double(b) * double(s);
    REQUIRE(scaled < 0x1p29);
    REQUIRE(scaled >= 0x1p28);
  }
}

TEST_CASE("dq_fixed_scale: a zero bound gives 1, a bound that is not finite 0, a tiny one 2^127",
          "[cuda][host]") {
  REQUIRE(dq_fixed_scale(0.f) == 1.f);
  REQUIRE(dq_fixed_scale(std::numeric_limits<float>::infinity()) == 0.f);
  REQUIRE(dq_fixed_scale(std::numeric_limits<float>::quiet_NaN()) == 0.f);
  // Below 2^-98 the scale stops at 2^127, the largest power of two a float holds: the bound's
  // parts then stay below 2^29 all the more (a unit coarser than the bound would allow).
  for (const float b : {0x1p-99f, 0x1p-120f, std::numeric_limits<float>::denorm_min()}) {
    CAPTURE(b);
    REQUIRE(dq_fixed_scale(b) == 0x1p127f);
    REQUIRE(double(b) * 0x1p127 < 0x1p29);
  }
}

namespace {

using flashref::cuda::detail::kernel_params;
using flashref::cuda::detail::kWorkGroupBytes;
using flashref::cuda::detail::work_group_heads;
using flashref::cuda::detail::work_place_of;

kernel_params work_problem(std::int64_t batch, std::int64_t heads, std::int64_t len_k,
                           std::int64_t head_dim) {
  kernel_params p{};
  p.batch = batch, p.heads_q = heads, p.len_k = len_k, p.head_dim = head_dim;
  return p;
}

}  // namespace

// visible_pairs against the rows' key intervals summed one by one (reference/'s row_range), on
// every causal mode and windows from none to wider than both lengths, the lengths in both orders.
TEST_CASE("visible_pairs is the sum of the rows' key intervals", "[cuda][host]") {
  using flashref::causal_mode;
  using flashref::cuda::detail::visible_pairs;
  std::mt19937 gen(11);
  std::uniform_int_distribution<std::int64_t> len(1, 160), narrow(0, 40), wide(0, 400);
  const std::int64_t unbounded = std::numeric_limits<std::int64_t>::max();
  const auto window = [&](int kind) -> std::int64_t {
    switch (kind) {
      case 0:
        return -1;
      case 1:
        return 0;
      case 2:
        return narrow(gen);
      case 3:
        return wide(gen);
      default:
        return unbounded;
    }
  };
  int cases = 0;
  for (int round = 0; round < 400; ++round) {
    const std::int64_t lq = len(gen), lk = len(gen);
    for (const causal_mode causal :
         {causal_mode::none, causal_mode::bottom_right, causal_mode::top_left})
      for (int l = 0; l < 5; ++l)
        for (int r = 0; r < 5; ++r) {
          flashref::mask_spec m;
          m.len_q = lq, m.len_k = lk, m.causal = causal;
          m.window_left = window(l), m.window_right = window(r);
          std::int64_t expected = 0;
          for (std::int64_t i = 0; i < lq; ++i) {
            const flashref::key_range k = m.row_range(0, i);
            expected += std::max<std::int64_t>(0, k.hi - k.lo);
          }
          CAPTURE(lq, lk, static_cast<int>(causal), m.window_left, m.window_right);
          REQUIRE(visible_pairs(lq, lk, causal, m.window_left, m.window_right) == expected);
          ++cases;
        }
  }
  REQUIRE(cases == 400 * 3 * 25);
  // Square causal: half the square and its diagonal; a window of w on each side of it.
  REQUIRE(visible_pairs(4096, 4096, causal_mode::bottom_right, -1, -1) == 4096 * 4097 / 2);
  REQUIRE(visible_pairs(1000, 1000, causal_mode::none, 10, 10) == 1000 * 21 - 2 * (10 * 11 / 2));
  // Lengths where the pairs pass 2^31.
  REQUIRE(visible_pairs(1 << 20, 1 << 20, causal_mode::none, -1, -1) == std::int64_t(1) << 40);
}

TEST_CASE("the Hopper forward's work order: every tile once, heaviest first in each group",
          "[cuda][host]") {
  // (B, H, Lk, D): groups of 16 heads (K and V of 512 KiB each), of 4 (2 MiB), of one head (more
  // than the group's bytes alone), a group cut short at the end (24 pairs in groups of 16), and
  // all pairs in one group.
  struct shape {
    std::int64_t b, h, l, d, tiles_q, group;
  };
  const shape shapes[] = {{16, 16, 1024, 128, 8, 16},  {4, 16, 4096, 128, 32, 4},
                          {1, 16, 16384, 128, 128, 1}, {2, 12, 1024, 128, 8, 16},
                          {1, 3, 512, 64, 4, 3},       {3, 5, 100000, 256, 7, 1}};
  for (const shape& s : shapes) {
    CAPTURE(s.b, s.h, s.l, s.d);
    const kernel_params p = work_problem(s.b, s.h, s.l, s.d);
    const std::int64_t group = work_group_heads(p);
    CHECK(group == s.group);
    CHECK(group ==
          std::min(s.b * s.h, std::max<std::int64_t>(1, kWorkGroupBytes / (4 * s.l * s.d))));
    const std::int64_t pairs = s.b * s.h, items = pairs * s.tiles_q;
    std::vector<int> seen(static_cast<std::size_t>(items), 0);
    std::int64_t prev_group = 0, prev_tile = s.tiles_q, prev_pair = -1;
    for (std::int64_t work = 0; work < items; ++work) {
      const auto at = work_place_of<int>(static_cast<int>(work), static_cast<int>(s.tiles_q),
                                         static_cast<int>(pairs), static_cast<int>(group));
      CAPTURE(work, at.pair, at.tile);
      REQUIRE(at.pair >= 0);
      REQUIRE(at.pair < pairs);
      REQUIRE(at.tile >= 0);
      REQUIRE(at.tile < s.tiles_q);
      ++seen[static_cast<std::size_t>(at.pair * s.tiles_q + at.tile)];
      // The host's 64-bit form gives the same place.
      const auto wide = work_place_of<std::int64_t>(work, s.tiles_q, pairs, group);
      CHECK(wide.pair == at.pair);
      CHECK(wide.tile == at.tile);
      // Groups in order; within one, tiles from the last down, each across the group's pairs.
      const std::int64_t g = at.pair / group;
      REQUIRE(g >= prev_group);
      if (g == prev_group) {
        REQUIRE(at.tile <= prev_tile);
        if (at.tile == prev_tile) REQUIRE(at.pair == prev_pair + 1);
      } else {
        REQUIRE(at.tile == s.tiles_q - 1);
      }
      prev_group = g, prev_tile = at.tile, prev_pair = at.pair;
    }
    for (std::int64_t n = 0; n < items; ++n)
      REQUIRE(seen[static_cast<std::size_t>(n)] == 1);
  }
}

namespace {

// offsets_in's definition, one offset at a time.
template <int kBlocks>
std::uint32_t offsets_in_by_test(std::int64_t lo, std::int64_t hi) {
  std::uint32_t bits = 0;
  for (int n = 0; n < 2 * kBlocks; ++n) {
    const std::int64_t off = (n / 2) * 8 + n % 2;
    if (off >= lo && off < hi) bits |= 1u << n;
  }
  return bits;
}

template <int kBlocks>
void check_offsets_in() {
  CAPTURE(kBlocks);
  const std::int64_t far = std::int64_t(1) << 40;
  std::vector<std::int64_t> bounds = {-far, -far + 1, far,
                                      std::numeric_limits<std::int64_t>::max() / 2};
  for (std::int64_t x = -20; x <= 8 * kBlocks + 20; ++x)
    bounds.push_back(x);
  for (const std::int64_t lo : bounds)
    for (const std::int64_t hi : bounds) {
      CAPTURE(lo, hi);
      REQUIRE(flashref::cuda::detail::offsets_in<kBlocks>(lo, hi) ==
              offsets_in_by_test<kBlocks>(lo, hi));
    }
}

}  // namespace

TEST_CASE("offsets_in gives the bits of the offsets in an interval, as one test per offset does",
          "[cuda][host]") {
  // Every width the kernels use (n8 blocks of a 16- to 128-wide row or column strip), every
  // interval around them, empty and reversed ones included.
  check_offsets_in<1>();
  check_offsets_in<2>();
  check_offsets_in<4>();
  check_offsets_in<8>();
  check_offsets_in<11>();
  check_offsets_in<16>();
}

TEST_CASE("sw128_advance moves a descriptor's start as sw128_desc of the moved address does",
          "[cuda][host]") {
  using flashref::cuda::detail::sw128_advance;
  using flashref::cuda::detail::sw128_desc;
  // The distances the kernels advance by: a K-major k-step ((ks / 4) boxes and (ks % 4) 32-byte
  // steps) over boxes of 64 to 192 rows of 128 bytes, an MN-major step of 16 rows (2048 bytes)
  // times up to 11, and D = 256's second half (two boxes); every 16-byte address of shared
  // memory, every lbo the kernels pass.
  std::vector<std::uint32_t> steps;
  for (const std::uint32_t box : {8192u, 10240u, 16384u, 22528u, 24576u}) {
    for (std::uint32_t ks = 0; ks < 16; ++ks)
      steps.push_back((ks / 4) * box + (ks % 4) * 32);
    steps.push_back(2 * box);
  }
  for (std::uint32_t kk = 0; kk < 11; ++kk)
    steps.push_back(kk * 16 * 128);
  std::int64_t checked = 0, differ = 0;
  for (const std::uint32_t lbo : {16u, 8192u, 10240u, 16384u, 22528u})
    for (std::uint32_t addr = 0; addr < (1u << 18); addr += 16)
      for (const std::uint32_t bytes : steps) {
        if (addr + bytes >= (1u << 18)) continue;  // past the 256 KiB the start field spans
        ++checked;
        differ += sw128_advance(sw128_desc(addr, lbo, 1024), bytes) !=
                  sw128_desc(addr + bytes, lbo, 1024);
      }
  CAPTURE(checked);
  REQUIRE(checked > 1000000);
  REQUIRE(differ == 0);
  // Beyond that range the field would carry into the next one, which sw128_desc masks: the
  // reason the kernels' tiles must lie below 256 KiB (they do: a block has at most 227 KiB).
  REQUIRE(sw128_advance(sw128_desc(0x3FFF0, 16, 1024), 16) != sw128_desc(0x40000, 16, 1024));
}
