#pragma once
// The benchmark grid shared by `flashref bench`'s CPU part (bench.cpp) and GPU part
// (bench_cuda.cpp, built with the CUDA backend). SPEC §8 gives the FLOP conventions.

#include <cstdint>
#include <string>
#include <vector>

namespace flashref::cli {

struct bench_point {
  std::string mask = "dense";  // dense | causal | block_sparse | local_window | decode
  std::int64_t B = 1, Hq = 8, Hk = 8, Lq = 1024, Lk = 1024, D = 128, Dv = 128;
  double density = 1.0;           // block_sparse: fraction of visible blocks
  std::int64_t block = 128;       // block_sparse: mask block size (square)
  std::int64_t window = 256;      // local_window: left = right = window
  std::string dtype = "float32";  // float32 | bfloat16 | float16 (GPU)
};

struct bench_record {
  bench_point point;
  std::string backend;  // cpu, reference, openblas_naive, peak_fma, cuda, ...
  int threads = 1;      // threads actually used (CPU)
  double median_s = 0;  // median over repetitions after warm-up
  double flops = 0;     // counted per SPEC §8 (effective for block-sparse)
  double gflops = 0;    // flops / median_s * 1e-9
  std::string note;     // free text (e.g. bandwidth for decode)
  // Filled by the CPU grid where they apply (0 = not measured):
  std::string isa;           // instruction set of the CPU kernels (or of the peak loop)
  double peak_fraction = 0;  // gflops / measured peak FMA rate on the same threads
  double vs_naive = 0;       // openblas_naive time / this time, same point and threads
  double vs_reference = 0;   // scalar tiled reference time / this time, same point
  double vs_dense = 0;       // this time / dense time at the same shape (masked points)
  double gbps = 0;           // decode: GB/s of K and V read; copy_bandwidth: GB/s moved
};

}  // namespace flashref::cli
