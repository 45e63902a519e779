#pragma once
// <immintrin.h> for the files compiled for AVX-512 (kernel_avx512.cpp, kernel_avx512_bf16.cpp,
// kernel_amx.cpp). GCC 12's AVX-512 intrinsics initialise a register from itself
// (`__m512 __Y = __Y;`, GCC bug 105593), which -Wuninitialized reports once the intrinsics are
// inlined there: those two warnings are off from here to the end of the including file.

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
