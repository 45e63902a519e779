#pragma once
// A counter-based deterministic generator. Every value is a pure function of (seed, stream,
// index) computed with integer arithmetic and IEEE-exact float operations (+ - * / sqrt), so
// regeneration is bit-identical on any machine, compiler and standard library — which the
// standard library's distributions are not. Normal variates use Marsaglia's polar method with
// a logarithm written here (the C library's log is not guaranteed to round the same way
// everywhere). Compile users of this header with -ffp-contract=off.

#include <cmath>
#include <cstdint>

namespace flashref::testdata {

// SplitMix64's finaliser (Steele, Lea & Flood 2014): a bijective 64-bit mix.
constexpr std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

class counter_rng {
 public:
  constexpr counter_rng(std::uint64_t seed, std::uint64_t stream)
      : key_(mix64(mix64(seed) ^ (stream * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL))) {}

  // 64 random bits for counter n.
  constexpr std::uint64_t bits(std::uint64_t n) const {
    return mix64(key_ ^ mix64(n * 0x9e3779b97f4a7c15ULL + 0xd1b54a32d192ed03ULL));
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform(std::uint64_t n) const { return double(bits(n) >> 11) * 0x1.0p-53; }

  // A standard normal variate for index n (polar method; attempt a uses counters 2*(64n+a)+{0,1}).
  double normal(std::uint64_t n) const {
    for (std::uint64_t a = 0;; ++a) {
      const std::uint64_t c = 2 * (64 * n + (a & 63));
      const double x = 2.0 * uniform(c) - 1.0;
      const double y = 2.0 * uniform(c + 1) - 1.0;
      const double r2 = x * x + y * y;
      if (r2 > 0.0 && r2 < 1.0) return x * std::sqrt(-2.0 * portable_log(r2) / r2);
    }
  }

  // ln(x) for x > 0 with + - * / only: x = m * 2^e, m in [sqrt(1/2), sqrt(2)), and
  // ln(m) = 2 atanh(z), z = (m - 1)/(m + 1), |z| < 0.1716, summed to 1e-17.
  static double portable_log(double x) {
    int e = 0;
    double m = std::frexp(x, &e);  // exact: x = m * 2^e, m in [0.5, 1)
    if (m < 0.70710678118654752440) {
      m *= 2.0;
      e -= 1;
    }
    const double z = (m - 1.0) / (m + 1.0), z2 = z * z;
    double term = z, sum = 0.0;
    for (int k = 1; k <= 41; k += 2) {
      sum += term / double(k);
      term *= z2;
    }
    return double(e) * 0.69314718055994530942 + 2.0 * sum;
  }

 private:
  std::uint64_t key_;
};

}  // namespace flashref::testdata
