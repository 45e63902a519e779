#pragma once
// Internal interface between the ISA-independent driver (attention.cpp) and the kernels,
// compiled once per instruction set (kernel_avx512.cpp, kernel_avx2.cpp, kernel_portable.cpp).
// Everything here is plain data: the driver plans and schedules, a kernel computes one work
// item — one query tile of one (batch, head) against one chunk of keys.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(FLASHREF_CPU_X86)
#include <xmmintrin.h>
#endif

#include "flashref/cpu/attention.hpp"
#include "flashref/cpu/half.hpp"
#include "flashref/reference/backward.hpp"
#include "flashref/reference/mask.hpp"
#include "flashref/reference/online_softmax.hpp"
#include "flashref/reference/problem.hpp"

// Unrolls the loop that follows completely: the register-blocked micro-kernels index their
// accumulators by loop counters of compile-time trip count, and only a complete unroll keeps
// them in registers (GCC at -O2 leaves such loops rolled, its accumulators on the stack).
#if defined(__clang__)
#define FLASHREF_UNROLL _Pragma("unroll")
#else
#define FLASHREF_UNROLL _Pragma("GCC unroll 16")
#endif

namespace flashref::cpu::detail {

// How q, k and v are stored: float32, or the 16-bit patterns of bfloat16 / float16 values.
enum class storage { f32, bf16, f16 };

// A 16-bit element of bf16 or f16 storage, typed so that the kernels overload on it.
struct bf16_bits {
  std::uint16_t bits;
};
struct f16_bits {
  std::uint16_t bits;
};

// Work items of at most this many query rows take the row kernel (lanes over the head dim).
constexpr std::int64_t kRowKernelMaxRows = 4;

// The bf16 kernels' granules: keys and head-dim elements per step (an AMX tile row of 32
// bfloat16), and result rows per AMX tile.
constexpr std::int64_t kDotK = 32;
constexpr std::int64_t kDotRow = 16;

// The columns of Vᵀ that one run of a product step's keys reads (the bf16 kernels' P·V): row c
// of the run at vt + c * ldv, nk32 keys (a multiple of 32); the runs follow one another in Pv.
// A step holds at most kMaxKeyRuns of them.
struct vt_run {
  const std::uint16_t* vt;
  std::int64_t ldv, nk32;
};
constexpr int kMaxKeyRuns = 8;

struct context {
  const attention_problem* p = nullptr;  // shapes, strides, masks (its q, k, v data: see `in`)
  storage in = storage::f32;
  const void* q = nullptr;  // the inputs' elements in `in`'s storage
  const void* k = nullptr;
  const void* v = nullptr;
  bool bf16_dot = false;  // the bf16 dot-product kernels (half_path avx512_bf16 / amx)
  // Their operands, packed once per call by kernel_table::prepack (kernel_bf16_body.inc):
  // K (B, Hk, Lkp, Dkp) and Vᵀ (B, Hk, Dvp, Lkp) in bfloat16, zero-padded, and per 32 keys
  // whether a value row holds a NaN or ±inf (B, Hk, Lkp / 32).
  // With k_in_place (bfloat16 storage, unit column stride, D a multiple of 32) K is not
  // packed: the products read its rows where they are, at the row stride p->k.stride[2], and kb
  // is null.
  std::uint16_t* kb = nullptr;
  bool k_in_place = false;
  std::uint16_t* vt = nullptr;
  std::uint8_t* v_bad = nullptr;
  std::int64_t Lkp = 0, Dkp = 0, Dvp = 0;
  mask_spec mask;
  float scale = 1.0f;
  std::int64_t Lq = 0, Lk = 0, D = 0, Dv = 0, group = 1;
  std::int64_t tq = 0, tk = 0;  // tile sizes
  std::int64_t tk_step = 0;     // keys per product step of the bf16 kernels (plan::step_k)
};

// The element offset of (b, h, row, 0) in a strided tensor.
template <class View>
inline std::int64_t offset_of(const View& t, std::int64_t b, std::int64_t h, std::int64_t row) {
  return b * t.stride[0] + h * t.stride[1] + row * t.stride[2];
}

// Query rows [q0, q1) of (b, h) against keys [k0, k1).
struct work_item {
  std::int64_t b = 0, h = 0, q0 = 0, q1 = 0, k0 = 0, k1 = 0;
};

// Where a work item writes its rows: O row r (r = 0 .. q1-q0-1) at o + r*o_row (column stride
// o_col), its LSE at lse + r*lse_row (lse may be null). Rows are normalised: (O, LSE) is the
// partial result of SPEC §5 over the item's keys.
struct out_rows {
  float* o = nullptr;
  std::uint16_t* o16 = nullptr;  // instead of o: O rounded to o16_dtype (bfloat16 / float16)
  input_dtype o16_dtype = input_dtype::bfloat16;
  std::int64_t o_row = 0, o_col = 1;
  float* lse = nullptr;
  std::int64_t lse_row = 0;
};

// One thread's scratch memory, reused across its work items. Nothing here grows with Lq x Lk.
struct thread_workspace {
  float* f = nullptr;  // 64-byte aligned, kernel_table::workspace_floats(ctx) floats
  std::vector<online_softmax<float>> state;  // (tq) one online-softmax state per query row
  std::vector<key_range> range;              // (tq) causal/window/kv_len interval per row
  std::vector<std::uint8_t> visible;         // (tk, tq padded) element mask of a partial tile
};

// The backward (backward.cpp plans, backward_body.inc computes). A work item is one key/value
// head of one batch entry and one chunk of its key tiles: tiles t with t % chunks == c form
// chunk c (interleaved, so that a causal mask gives every chunk the same work). The item
// finishes dK, dV of its tiles and adds its part of dQ to its own slice of dq_part; slices are
// summed in chunk order afterwards, so no two threads ever add to one float.
struct backward_context {
  context fwd;  // the problem (whose o, lse hold the forward's results), mask, tiles
  const attention_gradients* g = nullptr;
  const float* delta = nullptr;  // (B, Hq, Lq)  Delta_i = Σ_d dO_id O_id
  float* dq_part = nullptr;      // (chunks, B, Hq, Lq, dq_ld)  Σ_j dS_ij K_j per chunk
  std::int64_t dq_ld = 0;        // D rounded up to a whole number of registers
  std::int64_t chunks = 1;
};

struct backward_item {
  std::int64_t b = 0, hk = 0, chunk = 0;
};

struct kernel_table {
  isa id;
  int width;                // floats per SIMD register
  std::int64_t default_tq;  // default tile sizes (multiples of the register blocking)
  std::int64_t default_tk;
  std::int64_t block_tk;  // the default key tile under a block mask of narrower key blocks
  std::size_t (*workspace_floats)(const context& ctx);
  void (*run)(const context& ctx, const work_item& item, const out_rows& out, thread_workspace& ws);
  // bf16 kernels only (else null): fills ctx.kb, ctx.vt and ctx.v_bad for one (batch, kv head).
  void (*prepack)(const context& ctx, std::int64_t b, std::int64_t hk);
  // Runs `iterations` rounds of independent FMAs on one thread; returns the FLOPs done.
  double (*fma_loop)(std::int64_t iterations);
  std::size_t (*backward_workspace_floats)(const backward_context& ctx);
  void (*run_backward)(const backward_context& ctx, const backward_item& item,
                       thread_workspace& ws);
  // bf16 kernels only (else null): `iterations` rounds of independent bfloat16 dot products
  // into float32 on the path's own unit (vdpbf16ps, AMX tiles), on one thread; returns the
  // FLOPs done (2 per multiply-add).
  double (*dot_loop)(std::int64_t iterations);
};

const kernel_table& portable_kernels();
const kernel_table* table_of(isa i);  // null when not compiled into this library
#if defined(FLASHREF_CPU_X86)
const kernel_table& avx2_kernels();
const kernel_table& avx512_kernels();
const kernel_table& avx512_bf16_kernels();  // AVX-512 + vdpbf16ps
const kernel_table& amx_kernels();          // AVX-512 + AMX tiles (tdpbf16ps)
#endif

struct free_deleter {
  void operator()(void* p) const { std::free(p); }
};

// n uninitialised elements for a buffer of many MB that the caller fills in parallel: aligned
// to 2 MiB and, on Linux, marked for transparent huge pages (where the system has them on
// request), so that first touching it takes one page fault per 2 MiB instead of one per 4 KiB.
// Freed with std::free (free_deleter). Throws std::bad_alloc when the memory cannot be had.
template <class T>
T* large_buffer(std::size_t n) {
  constexpr std::size_t kHuge = std::size_t(2) << 20;
  const std::size_t bytes = (std::max<std::size_t>(n * sizeof(T), 1) + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, bytes);
  if (p == nullptr) throw std::bad_alloc();
#if defined(__linux__)
  (void)madvise(p, bytes, MADV_HUGEPAGE);  // a hint: refused or unsupported, 4 KiB pages serve
#endif
  return static_cast<T*>(p);
}

// Flush denormals to zero inside the kernels (and restore the caller's mode): a denormal
// product p * v costs a microcode assist on many processors and is below every tolerance.
class denormals_as_zero {
 public:
#if defined(FLASHREF_CPU_X86)
  denormals_as_zero() : saved_(_mm_getcsr()) {
    _mm_setcsr(saved_ | 0x8040u);
  }  // FTZ | DAZ
  ~denormals_as_zero() {
    _mm_setcsr(saved_);
  }

 private:
  unsigned saved_;
#endif
};

}  // namespace flashref::cpu::detail
