#pragma once
// The name of a kernel choice, for the CUDA tests' captures.
#include "flashref/cuda/attention.hpp"

namespace flashref::test {

inline const char* name_of(cuda::kernel_choice k) {
  switch (k) {
    case cuda::kernel_choice::hopper:
      return "hopper";
    case cuda::kernel_choice::tensor_core:
      return "tensor_core";
    case cuda::kernel_choice::simt:
      return "simt";
    case cuda::kernel_choice::automatic:
      break;
  }
  return "automatic";
}

}  // namespace flashref::test
