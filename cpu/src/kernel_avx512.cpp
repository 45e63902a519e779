// The kernels compiled for AVX-512 (F + DQ). Only called after a run-time check of the
// processor (attention.cpp); the rest of the library is compiled for the baseline. The same
// `vec` (vec_avx512.inc) also serves the bf16 kernels (kernel_avx512_bf16.cpp, kernel_amx.cpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "avx512_intrinsics.hpp"
#include "kernel.hpp"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx2,fma,f16c")
#endif

// After the target pragmas: exp_lanes is compiled for this instruction set.
#include "isa_exp.hpp"

namespace flashref::cpu::detail::avx512 {
namespace {

#include "vec_avx512.inc"

#include "kernel_body.inc"

#include "backward_body.inc"  // uses the helpers of kernel_body.inc

#include "kernel_table.inc"  // after both

}  // namespace

}  // namespace flashref::cpu::detail::avx512

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace flashref::cpu::detail {
const kernel_table& avx512_kernels() {
  return avx512::table();
}
}  // namespace flashref::cpu::detail
