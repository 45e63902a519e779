#pragma once
// Portability macros shared by host and device code. This header must stay includable from
// .cu files: no xtensor, no exceptions, nothing host-only.

#if defined(__CUDACC__)
#define FLASHREF_INLINE __host__ __device__ __forceinline__
#else
#define FLASHREF_INLINE inline
#endif
