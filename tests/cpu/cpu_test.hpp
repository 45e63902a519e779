#pragma once
// Helpers of the CPU backend's own tests: the options of one instruction set and tile shape,
// and bitwise equality of two float results.

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "flashref/cpu/attention.hpp"

namespace flashref::test {

inline cpu::options with_isa(cpu::isa i, std::int64_t tq = 0, std::int64_t tk = 0) {
  cpu::options opt;
  opt.instruction_set = i;
  opt.tile_q = tq;
  opt.tile_k = tk;
  return opt;
}

// Same length and the same bits (NaN payloads and the sign of zero included).
template <class X>
bool same_bits(const X& a, const X& b) {
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(*a.data())>, float>);
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace flashref::test
