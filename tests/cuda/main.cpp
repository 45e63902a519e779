// The CUDA tests need a device. Without one they print one line saying why and exit with
// kSkipped, which ctest reports as skipped (SKIP_RETURN_CODE).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>

#include "flashref/cuda/attention.hpp"

namespace {
constexpr int kSkipped = 77;
}

int main(int argc, char** argv) {
  std::string why;
  if (!flashref::cuda::device_available(&why)) {
    std::printf("test_cuda: skipped: %s\n", why.c_str());
    return kSkipped;
  }
  return Catch::Session().run(argc, argv);
}
