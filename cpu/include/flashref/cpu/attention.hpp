#pragma once
// flashref::cpu — the OpenMP CPU backend: fp32 tiled attention for every problem the reference
// accepts. Queries are tiled against keys in cache; SIMD micro-kernels compute QKᵀ and PV;
// tiles with no visible key are never loaded; the element mask runs only on tiles that
// straddle a mask boundary. One build carries several instruction sets (AVX-512, AVX2+FMA,
// portable) and picks the best the processor has at run time.
//
// Results are bitwise identical for any thread count and from run to run: the work split
// (tiles, key chunks for decode-like shapes, their merge order) depends on the problem shape,
// the tile sizes and the instruction set, never on the number of threads.

#include <cstdint>
#include <string>
#include <vector>

#include "flashref/reference/problem.hpp"

namespace flashref::cpu {

enum class isa { automatic, portable, avx2, avx512 };

const char* to_string(isa i);
isa parse_isa(const std::string& s);  // "automatic" | "portable" | "avx2" | "avx512"

bool compiled(isa i);               // built into this library
bool supported(isa i);              // built and runnable on this processor
isa best_isa();                     // the fastest supported one
std::vector<isa> supported_isas();  // portable first, best last

struct options {
  std::int64_t tile_q = 0;  // query rows per tile; 0 = the instruction set's default
  std::int64_t tile_k = 0;  // keys per tile; 0 = the instruction set's default
  isa instruction_set = isa::automatic;
  int threads = 0;            // 0 = OpenMP's default (follows OMP_NUM_THREADS)
  std::int64_t kv_chunk = 0;  // keys per split-KV chunk; 0 = chosen from the shape alone
};

// How a problem will be run: resolved options plus the split-KV decision.
struct plan {
  isa used = isa::portable;
  std::int64_t tile_q = 0, tile_k = 0;
  std::int64_t kv_chunk = 0;   // keys per chunk (a multiple of tile_k), or Lk when not split
  std::int64_t kv_splits = 1;  // number of key chunks merged per query row
  int threads = 1;             // threads the parallel region uses
};

// Throws problem_error for an invalid problem or option (an unsupported instruction set, a
// negative tile size).
plan make_plan(const attention_problem& p, const options& opt = {});

// Writes p.o and p.lse (when present).
void attention(const attention_problem& p);
void attention(const attention_problem& p, const options& opt);

// The processor's fp32 multiply-add rate with instruction set `i` on `threads` threads: a
// register-only loop of independent FMAs, about `seconds` long. GFLOP/s (an FMA is 2 FLOPs).
double peak_fma_gflops(isa i, int threads, double seconds = 0.2);

}  // namespace flashref::cpu
