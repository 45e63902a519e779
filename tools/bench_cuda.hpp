#pragma once
// The GPU part of `flashref bench` (SPEC §8): bf16/fp16 attention on the CUDA backend's
// device entry over the grid B·L = tokens, Hq·D = model width; dense, causal and block-sparse
// (128×128 blocks, with empty query-block rows) masks. Built only with the CUDA backend.

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench.hpp"
#include "commands.hpp"

namespace flashref::cli {

struct gpu_bench_options {
  std::vector<std::int64_t> lengths{512, 1024, 2048, 4096, 8192, 16384};
  std::vector<std::int64_t> head_dims{64, 128};
  std::vector<std::string> masks{"dense", "causal", "block_sparse"};
  std::vector<double> densities{0.5, 0.2, 0.05};
  std::int64_t tokens = 16384;  // B * L
  std::int64_t model = 2048;    // Hq * D
  std::int64_t block = 128;     // block-sparse mask block size
  std::string dtype = "bfloat16";
  double seconds_per_point = 0.25;  // timed repetitions per point fill about this long
  std::uint64_t seed = 2024;
};

// The block mask of a block-sparse grid point, (Hq, nqb, nkb), broadcast over the batch:
// block (h, qb, kb) is visible iff qb % 8 != 7 (every eighth query-block row is empty) and
// counter_rng(seed, L).uniform((h * nqb + qb) * nkb + kb) < density. The comparison script
// regenerates it bit for bit and checks mask_hash.
std::vector<std::uint8_t> gpu_bench_block_mask(std::int64_t Hq, std::int64_t L, std::int64_t block,
                                               double density, std::uint64_t seed);
std::uint64_t mask_hash(const std::vector<std::uint8_t>& mask);  // FNV-1a, 64 bit

// Runs the grid; prints one table line per point to `table` (may be null) as it goes.
std::vector<bench_record> run_gpu_bench(const gpu_bench_options& opt, std::FILE* table);

}  // namespace flashref::cli
