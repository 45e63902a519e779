#pragma once
// One measured point of `flashref bench` or `flashref bench-gpu`, and its JSON form. Both
// commands write their records through write_records (nlohmann-json), so the keys agree.

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "grid.hpp"

namespace flashref::cli {

struct bench_record {
  bench_point point;
  std::string backend;  // cpu, reference, openblas_naive, peak_fma, cuda, ...
  int threads = 1;      // threads actually used (CPU; 0 on the GPU)
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
  // Filled by the GPU grid:
  std::string kernel;                // the CUDA kernel that ran
  double host_s = 0;                 // median wall time of the call's host part (enqueueing)
  bool back_to_back = false;         // timed as streams of calls (bench-gpu --back-to-back)
  double visible_fraction = 0;       // fraction of (query, key) pairs in visible blocks
  std::uint64_t mask_hash = 0;       // of the block-sparse mask (block_sparse_mask)
  std::int64_t nan_rows = -1;        // rows holding NaN or +inf (-1: not checked)
  std::int64_t empty_rows = -1;      // rows with LSE = -inf
  std::int64_t empty_rows_bad = -1;  // empty rows whose O (dQ for a backward) is not exactly 0
  // "backward" for a backward's record (SPEC §9: 2.5 x the forward's FLOPs); empty for a forward.
  std::string pass;
};

nlohmann::json to_json(const bench_record& r);

// Throws problem_error when `path` (an output file; empty = none) has no existing folder: called
// before any measurement, so that a bad path fails at once rather than after the grid.
void check_output_path(const std::string& path);
// Writes the records as a JSON array, atomically.
void write_records(const std::filesystem::path& path, const std::vector<bench_record>& recs);

}  // namespace flashref::cli
