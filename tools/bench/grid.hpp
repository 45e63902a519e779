#pragma once
// The benchmark grid of SPEC §8, shared by `flashref bench` (the CPU, cpu.cpp) and
// `flashref bench-gpu` (the CUDA backend, gpu.cpp): total tokens B·L and model width Hq·D fixed,
// L and D varied, dense / causal / block-sparse masks. The block-sparse masks are the same on
// both, and scripts/bench_gpu_torch.py regenerates them bit for bit for PyTorch.

#include <cstdint>
#include <string>
#include <vector>

namespace flashref::cli {

struct bench_point {
  std::string mask = "dense";  // dense | causal | block_sparse | local_window | decode
  std::int64_t B = 1, Hq = 8, Hk = 8, Lq = 1024, Lk = 1024, D = 128, Dv = 128;
  double density = 1.0;           // block_sparse: requested fraction of visible blocks
  std::int64_t block = 128;       // block_sparse: mask block size (square)
  std::int64_t window = 256;      // local_window: left = right = window
  std::string dtype = "float32";  // float32 | bfloat16 | float16
};

struct bench_grid {
  std::vector<std::int64_t> lengths;
  std::vector<std::int64_t> head_dims{64, 128};
  std::vector<std::string> masks{"dense", "causal", "block_sparse"};
  std::vector<double> densities{0.5, 0.2, 0.05};
  std::int64_t tokens = 16384;  // B · L: every L must divide it
  std::int64_t model = 2048;    // Hq · D: every D must divide it
  std::int64_t block = 128;     // block-sparse mask block size

  // Throws problem_error naming the option (as the CLI spells it) on a bad value; `allowed`
  // lists the masks the caller runs.
  void validate(const std::vector<std::string>& allowed) const;
  // The points, D outermost, then L, then masks (block_sparse once per density).
  std::vector<bench_point> points(const std::string& dtype) const;
};

// The block mask of a block-sparse point, (Hq, nb, nb) with nb = ceil(L / block), broadcast
// over the batch: block (h, qb, kb) is visible iff qb % 8 != 7 (every eighth query-block row
// is empty) and counter_rng(seed, L).uniform((h * nb + qb) * nb + kb) < density.
std::vector<std::uint8_t> block_sparse_mask(std::int64_t Hq, std::int64_t L, std::int64_t block,
                                            double density, std::uint64_t seed);
std::uint64_t mask_hash(const std::vector<std::uint8_t>& mask);  // FNV-1a, 64 bit

}  // namespace flashref::cli
