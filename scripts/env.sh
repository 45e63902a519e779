# Sourced by scripts/demo and scripts/test: the CUDA toolkit on PATH when it is installed,
# so that FLASHREF_CUDA=AUTO finds nvcc.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
