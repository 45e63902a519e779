#pragma once
// flashref::cpu — the OpenMP CPU backend: tiled attention for every problem the reference
// accepts, with float32 inputs or bfloat16 / float16 ones (fp32 accumulation either way). Queries
// are tiled against keys in cache; SIMD micro-kernels compute QKᵀ and PV; tiles with no visible key
// are never loaded; the element mask runs only on tiles that straddle a mask boundary. One build
// carries several instruction sets (AVX-512, AVX2+FMA, portable) and picks the best the processor
// has at run time.
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

// How bfloat16 / float16 inputs are computed (float32 inputs always take the fp32 kernels):
//   convert      each tile converted to float32, then the fp32 kernels (any instruction set;
//                the only path for float16: no x86 instruction multiplies float16 pairs into
//                a float32 sum short of AMX-FP16 / AVX10.2)
//   avx512_bf16  Q·Kᵀ and P·V as bfloat16 pair dot products into float32 (vdpbf16ps)
//   amx          the same products on AMX tiles (tdpbf16ps), where the processor has them
//                and the operating system grants the tile state
// The bf16 paths round P to bfloat16 before P·V (as GPU kernels do); scores, the softmax
// state and every sum stay float32.
enum class half_path { automatic, convert, avx512_bf16, amx };

const char* to_string(isa i);
isa parse_isa(const std::string& s);  // "automatic" | "portable" | "avx2" | "avx512"

bool compiled(isa i);               // built into this library
bool supported(isa i);              // built and runnable on this processor
isa best_isa();                     // the fastest supported one
std::vector<isa> supported_isas();  // portable first, best last

const char* to_string(half_path h);
half_path parse_half_path(const std::string& s);  // "automatic" | "convert" | ...
bool compiled(half_path h);
bool supported(half_path h);  // built, run by this processor and (amx) granted by the OS
// The paths that can run inputs of `dtype` on this processor, convert first (float32: none).
std::vector<half_path> supported_half_paths(input_dtype dtype);
// What `automatic` takes for inputs of `dtype` on AVX-512 (a lesser instruction set converts):
// amx where the processor has it and the OS grants it; avx512_bf16 where its dot product
// outruns the fp32 FMAs, which is on AMD's cores (on Zen 4 the bf16 kernel ran 1.7 x the fp32
// one); convert otherwise — on an Intel Xeon vdpbf16ps measured half the multiply-adds per
// second of the FMAs, and the fp32 kernel over 16-bit storage ran 1.7 x the avx512_bf16 kernel
// (docs/benchmarks.md). float32: convert.
half_path preferred_half_path(input_dtype dtype);

struct options {
  std::int64_t tile_q = 0;  // query rows per tile; 0 = the instruction set's default
  std::int64_t tile_k = 0;  // keys per tile; 0 = the instruction set's default
  isa instruction_set = isa::automatic;
  int threads = 0;            // 0 = OpenMP's default (follows OMP_NUM_THREADS)
  std::int64_t kv_chunk = 0;  // keys per split-KV chunk; 0 = chosen from the shape alone
  half_path half = half_path::automatic;  // bfloat16 / float16 inputs only
  // The backward's interleaved chunks of key tiles per (batch, key/value head), each adding to
  // its own copy of dQ (summed in chunk order: the gradients' bits follow this number, never
  // the thread count); 0 = chosen from the shape alone. The forward ignores it.
  std::int64_t backward_chunks = 0;
};

// How a problem will be run: resolved options plus the split-KV decision.
struct plan {
  isa used = isa::portable;
  half_path half = half_path::convert;  // the path of bf16/fp16 inputs (convert for float32)
  std::int64_t tile_q = 0, tile_k = 0;
  // Keys per product step (a multiple of tile_k): the bf16 dot-product paths, whose default
  // tile a block mask narrows to tile_k, put that many keys of visible tiles together into one
  // softmax and P·V step; tile_k everywhere else.
  std::int64_t step_k = 0;
  std::int64_t kv_chunk = 0;   // keys per chunk (a multiple of tile_k), or Lk when not split
  std::int64_t kv_splits = 1;  // number of key chunks merged per query row
  int threads = 1;             // threads the parallel region uses
};

// Throws problem_error for an invalid problem or option (an unsupported instruction set, a
// negative tile size).
plan make_plan(const attention_problem& p, const options& opt = {});

// Writes p.o and p.lse (when present). With p.dtype bfloat16 or float16 the float32 storage
// holds values of that dtype (problem.hpp), and the half path runs on them.
void attention(const attention_problem& p);
void attention(const attention_problem& p, const options& opt);

// A problem whose inputs are stored in 16 bits: the bit patterns of bfloat16 or float16
// values (half.hpp converts). `p` describes everything else — shapes and strides of q, k, v
// and o (in elements), masks, scale, LSE (float32) and the dtype (bfloat16 or float16); the
// data pointers of p.q, p.k and p.v are not read. O is written in the input dtype to `o`
// (p.o's shape and strides) when it is set, else in float32 to p.o.
struct half_problem {
  attention_problem p;
  const std::uint16_t* q = nullptr;
  const std::uint16_t* k = nullptr;
  const std::uint16_t* v = nullptr;
  std::uint16_t* o = nullptr;
};

plan make_plan(const half_problem& hp, const options& opt = {});
// The same results, bit for bit, as attention(p) on float32 storage holding the same values
// (with O rounded to the input dtype when `o` is set).
void attention(const half_problem& hp, const options& opt = {});

// The processor's fp32 multiply-add rate with instruction set `i` on `threads` threads: a
// register-only loop of independent FMAs, about `seconds` long, timed in windows of about 50 ms
// of which the best counts (a disturbed window measures less, never more). GFLOP/s (an FMA is 2
// FLOPs).
double peak_fma_gflops(isa i, int threads, double seconds = 0.2);
// The same for the unit of a bfloat16 path: vdpbf16ps (avx512_bf16) or AMX tiles (amx), two
// FLOPs per multiply-add; convert runs the fp32 kernels, so its peak is peak_fma_gflops of the
// best instruction set. Throws problem_error for a path this processor does not run.
double peak_dot_gflops(half_path h, int threads, double seconds = 0.2);

}  // namespace flashref::cpu
