#pragma once
// Helpers of the CPU backend's own tests (and of the fuzz harness that runs it): the options of
// one instruction set and tile shape, bitwise equality of two float results, and 16-bit storage
// of float values.

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "flashref/cpu/attention.hpp"
#include "flashref/cpu/half.hpp"

namespace flashref::test {

inline cpu::options with_isa(cpu::isa i, std::int64_t tq = 0, std::int64_t tk = 0) {
  cpu::options opt;
  opt.instruction_set = i;
  opt.tile_q = tq;
  opt.tile_k = tk;
  return opt;
}

// Same length and the same bits (NaN payloads and the sign of zero included). Empty storage
// may have null data, which memcmp must not be given even for no bytes.
template <class X>
bool same_bits(const X& a, const X& b) {
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(*a.data())>, float>);
  return a.size() == b.size() &&
         (a.size() == 0 || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// 16-bit storage of a float tensor whose values are representable in `dtype`.
template <class X>
std::vector<std::uint16_t> to_bits(const X& x, input_dtype dtype) {
  std::vector<std::uint16_t> out(x.size());
  for (std::size_t n = 0; n < x.size(); ++n)
    out[n] = dtype == input_dtype::bfloat16 ? cpu::bf16_from_float(x.data()[n])
                                            : cpu::f16_from_float(x.data()[n]);
  return out;
}

}  // namespace flashref::test
