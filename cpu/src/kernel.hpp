#pragma once
// Internal interface between the ISA-independent driver (attention.cpp) and the kernels,
// compiled once per instruction set (kernel_avx512.cpp, kernel_avx2.cpp, kernel_portable.cpp).
// Everything here is plain data: the driver plans and schedules, a kernel computes one work
// item — one query tile of one (batch, head) against one chunk of keys.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "flashref/cpu/attention.hpp"
#include "flashref/reference/mask.hpp"
#include "flashref/reference/online_softmax.hpp"
#include "flashref/reference/problem.hpp"

namespace flashref::cpu::detail {

struct context {
  const attention_problem* p = nullptr;
  mask_spec mask;
  float scale = 1.0f;
  std::int64_t Lq = 0, Lk = 0, D = 0, Dv = 0, group = 1;
  std::int64_t tq = 0, tk = 0;  // tile sizes
};

// Query rows [q0, q1) of (b, h) against keys [k0, k1).
struct work_item {
  std::int64_t b = 0, h = 0, q0 = 0, q1 = 0, k0 = 0, k1 = 0;
};

// Where a work item writes its rows: O row r (r = 0 .. q1-q0-1) at o + r*o_row (column stride
// o_col), its LSE at lse + r*lse_row (lse may be null). Rows are normalised: (O, LSE) is the
// partial result of SPEC §5 over the item's keys.
struct out_rows {
  float* o = nullptr;
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

struct kernel_table {
  isa id;
  int width;                // floats per SIMD register
  std::int64_t default_tq;  // default tile sizes (multiples of the register blocking)
  std::int64_t default_tk;
  std::size_t (*workspace_floats)(const context& ctx);
  void (*run)(const context& ctx, const work_item& item, const out_rows& out, thread_workspace& ws);
  // Runs `iterations` rounds of independent FMAs on one thread; returns the FLOPs done.
  double (*fma_loop)(std::int64_t iterations);
};

const kernel_table& portable_kernels();
#if defined(FLASHREF_CPU_X86)
const kernel_table& avx2_kernels();
const kernel_table& avx512_kernels();
#endif

}  // namespace flashref::cpu::detail
