// Host-side rules of the CUDA backend that need no device, so that every build checks them:
// the fixed-point scale of the Hopper backward's dQ (launch.hpp, dq_fixed_scale), on which its
// bitwise determinism and its range argument rest (hopper/backward.cuh, "dQ in fixed point").
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

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
