// The portable kernels: plain C++ over fixed-size float arrays, which the compiler vectorises
// for whatever baseline the library is built for (SSE2 on x86-64). The fallback on processors
// without AVX2 and on other architectures.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "isa_exp.hpp"
#include "kernel.hpp"

namespace flashref::cpu::detail::portable {
namespace {

struct vec {
  static constexpr isa kIsa = isa::portable;
  static constexpr int W = 8;
  struct reg {
    float v[W];
  };
  static constexpr int kQkRows = 4, kQkVecs = 2;
  static constexpr int kPvRows = 4, kPvVecs = 2;
  static constexpr int kGemmRows = 4, kGemmVecs = 2;  // the backward's
  static constexpr int kPeakAccumulators = 8;
  static constexpr std::int64_t kTileQ = 32, kTileK = 64;
  static constexpr std::int64_t kFwdTileQ = kTileQ;  // the forward's (kernel_table.inc)

  template <class F>
  static reg map(F f) {
    reg r;
    for (int l = 0; l < W; ++l)
      r.v[l] = f(l);
    return r;
  }
  static reg load(const float* p) {
    return map([&](int l) { return p[l]; });
  }
  static reg load(const bf16_bits* p) {
    return map([&](int l) { return bf16_to_float(p[l].bits); });
  }
  static reg load(const f16_bits* p) {
    return map([&](int l) { return f16_to_float(p[l].bits); });
  }
  static void store(float* p, const reg& x) {
    for (int l = 0; l < W; ++l)
      p[l] = x.v[l];
  }
  static reg set1(float x) {
    return map([&](int) { return x; });
  }
  static reg zero() { return set1(0.0f); }
  // dst[d * ld + i] = src[i * s_row + d] for a W x W block.
  static void transpose(const float* src, std::int64_t s_row, float* dst, std::int64_t ld) {
    for (int d = 0; d < W; ++d)
      for (int i = 0; i < W; ++i)
        dst[d * ld + i] = src[i * s_row + d];
  }
  static reg add(const reg& a, const reg& b) {
    return map([&](int l) { return a.v[l] + b.v[l]; });
  }
  static reg sub(const reg& a, const reg& b) {
    return map([&](int l) { return a.v[l] - b.v[l]; });
  }
  static reg mul(const reg& a, const reg& b) {
    return map([&](int l) { return a.v[l] * b.v[l]; });
  }
  static reg fma(const reg& a, const reg& b, const reg& c) {
    return map([&](int l) { return a.v[l] * b.v[l] + c.v[l]; });
  }
  static reg max(const reg& a, const reg& b) {  // like maxps: the second operand on NaN
    return map([&](int l) { return a.v[l] > b.v[l] ? a.v[l] : b.v[l]; });
  }
  static float reduce_add(const reg& x) {
    float s = 0.0f;
    for (int l = 0; l < W; ++l)
      s += x.v[l];
    return s;
  }
  static float reduce_max(const reg& x) {
    float m = x.v[0];
    for (int l = 1; l < W; ++l)
      m = x.v[l] > m ? x.v[l] : m;
    return m;
  }
  // The steps of exp_lanes (isa_exp.hpp) that differ per instruction set; unfused, like the
  // rest of this kernel.
  struct lanes {
    bool v[W];
  };
  static lanes below(const reg& x, const reg& lo) {
    lanes m;
    for (int l = 0; l < W; ++l)
      m.v[l] = x.v[l] < lo.v[l];  // false for NaN
    return m;
  }
  static reg clamp(const reg& x, float lo, float hi) {
    return map([&](int l) { return x.v[l] < lo ? lo : x.v[l] > hi ? hi : x.v[l]; });
  }
  static reg fnma(const reg& a, const reg& b, const reg& c) {
    return map([&](int l) { return c.v[l] - a.v[l] * b.v[l]; });
  }
  static reg round_nearest(const reg& x) {
    return map([&](int l) { return std::nearbyint(x.v[l]); });
  }
  static reg scale_pow2(const reg& y, const reg& n) {
    return map([&](int l) {
      if (std::isnan(y.v[l])) return y.v[l];  // n is NaN too: no integer to scale by
      const std::uint32_t e = std::uint32_t(int(n.v[l]) + 127) << 23;  // 2^n, n in [-126, 127]
      return y.v[l] * std::bit_cast<float>(e);
    });
  }
  static reg zero_where(const lanes& m, const reg& y) {
    return map([&](int l) { return m.v[l] ? 0.0f : y.v[l]; });
  }
  static reg exp(const reg& x) { return exp_lanes<vec>(x); }
};

#include "kernel_body.inc"

#include "backward_body.inc"  // uses the helpers of kernel_body.inc

#include "kernel_table.inc"  // after both

}  // namespace

}  // namespace flashref::cpu::detail::portable

namespace flashref::cpu::detail {
const kernel_table& portable_kernels() {
  return portable::table();
}
}  // namespace flashref::cpu::detail
