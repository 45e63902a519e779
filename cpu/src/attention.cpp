// The CPU backend's driver: validation, the plan (instruction set, tiles, split-KV), the
// OpenMP schedule and the fixed-order merge of split partial results. The arithmetic lives in
// the kernels (kernel_body.inc), compiled once per instruction set.
#include "flashref/cpu/attention.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#if defined(FLASHREF_CPU_X86)
#include <cpuid.h>
#include <xmmintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#include "flashref/cpu/half.hpp"
#include "flashref/reference/limits.hpp"
#include "flashref/reference/merge.hpp"
#include "kept_buffer.hpp"
#include "kernel.hpp"

namespace flashref::cpu {

namespace {

using detail::context;
using detail::denormals_as_zero;
using detail::free_deleter;
using detail::kernel_table;
using detail::out_rows;
using detail::table_of;
using detail::thread_workspace;
using detail::work_item;

// Split-KV: decode-like shapes have too few (batch, head, query tile) items to keep many
// cores busy, so their keys are cut into chunks whose partial results (O, LSE) are merged
// in a fixed order (SPEC §5). The decision reads the shape and the tile sizes only — never
// the thread count — so every thread count computes the same bits.
constexpr std::int64_t kMinItems = 128;       // aim for at least this many work items
constexpr std::int64_t kMinChunkKeys = 1024;  // never cut the keys finer than this
constexpr std::int64_t kMaxTile = 4096;       // largest tile_q / tile_k accepted

// ceil(a / b) for a >= 0, b > 0, without forming a + b - 1 (b may be as large as 2^63 - 1).
std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return a == 0 ? 0 : (a - 1) / b + 1;
}

// The kernels of a half path: nullptr for convert (the instruction set's own kernels).
const kernel_table* table_of(half_path h) {
  switch (h) {
#if defined(FLASHREF_CPU_X86)
    case half_path::avx512_bf16:
      return &detail::avx512_bf16_kernels();
    case half_path::amx:
      return &detail::amx_kernels();
#endif
    default:
      return nullptr;
  }
}

#if defined(FLASHREF_CPU_X86)
// CPUID bits that not every compiler's __builtin_cpu_supports knows (clang 14 has neither).
bool cpuid_bit(unsigned leaf, unsigned subleaf, int reg, unsigned bit) {
  unsigned r[4] = {0, 0, 0, 0};  // eax, ebx, ecx, edx
  if (__get_cpuid_count(leaf, subleaf, &r[0], &r[1], &r[2], &r[3]) == 0) return false;
  return ((r[reg] >> bit) & 1u) != 0;
}
bool has_f16c() {
  return cpuid_bit(1, 0, 2, 29);  // leaf 1, ECX bit 29
}
bool has_avx512_bf16() {
  return cpuid_bit(7, 1, 0, 5);  // leaf 7 subleaf 1, EAX bit 5
}
bool vendor_is_amd() {  // asked once per process (CPUID traps to the hypervisor in a VM)
  static const bool amd = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;  // leaf 0: the vendor string in EBX, EDX, ECX
    if (__get_cpuid(0, &a, &b, &c, &d) == 0) return false;
    return b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "Auth" "enti" "cAMD"
  }();
  return amd;
}

// AMX-BF16 and AMX-TILE (leaf 7, EDX bits 22 and 24), and the operating system's grant of the
// tile state: Linux keeps the AMX tile data out of a process's state until the process asks for
// it (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+); a tile instruction before that faults.
// Asked once per process; false when refused.
bool amx_granted() {
  static const bool granted = [] {
    if (!cpuid_bit(7, 0, 3, 22) || !cpuid_bit(7, 0, 3, 24)) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr long kGetPerm = 0x1022, kReqPerm = 0x1023, kXtiledata = 18;
    if (syscall(SYS_arch_prctl, kReqPerm, kXtiledata) != 0) return false;  // refused
    unsigned long perm = 0;
    if (syscall(SYS_arch_prctl, kGetPerm, &perm) != 0) return false;
    return ((perm >> kXtiledata) & 1u) != 0;
#else
    return false;
#endif
  }();
  return granted;
}
#endif

bool processor_runs(isa i) {
#if defined(FLASHREF_CPU_X86)
  __builtin_cpu_init();
  if (i == isa::avx2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
  if (i == isa::avx512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
#endif
  return i == isa::portable;
}

bool processor_runs(half_path h) {
  if (h == half_path::convert) return true;
#if defined(FLASHREF_CPU_X86)
  __builtin_cpu_init();
  const bool avx512 = processor_runs(isa::avx512) && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  if (h == half_path::avx512_bf16) return avx512 && has_avx512_bf16();
  if (h == half_path::amx) return avx512 && amx_granted();
#endif
  return false;
}

// The names of `items` (instruction sets, half paths), comma-separated.
template <class Items>
std::string listed(const Items& items) {
  std::string s;
  for (const auto& x : items) {
    if (!s.empty()) s.append(", ");
    s.append(to_string(x));
  }
  return s;
}

std::string supported_list() {
  return listed(supported_isas());
}

[[noreturn]] void fail(const std::string& field, const std::string& expected,
                       const std::string& got) {
  throw problem_error(field + ": expected " + expected + ", got " + got);
}

[[noreturn]] void unsupported(isa i) {
  std::string expected = "one of the instruction sets this processor runs (";
  expected.append(supported_list()).append(")");
  std::string got = "'";
  got.append(to_string(i)).append("'");
  fail("isa", expected, got);
}

}  // namespace

namespace detail {

const kernel_table* table_of(isa i) {
  switch (i) {
    case isa::portable:
      return &portable_kernels();
#if defined(FLASHREF_CPU_X86)
    case isa::avx2:
      return &avx2_kernels();
    case isa::avx512:
      return &avx512_kernels();
#endif
    default:
      return nullptr;
  }
}

}  // namespace detail

const char* to_string(isa i) {
  switch (i) {
    case isa::automatic:
      return "automatic";
    case isa::portable:
      return "portable";
    case isa::avx2:
      return "avx2";
    case isa::avx512:
      return "avx512";
  }
  return "?";
}

isa parse_isa(const std::string& s) {
  for (isa i : {isa::automatic, isa::portable, isa::avx2, isa::avx512})
    if (s == to_string(i)) return i;
  std::string got = "'";
  got.append(s).append("'");
  fail("isa", "one of automatic, portable, avx2, avx512", got);
}

bool compiled(isa i) {
  return i != isa::automatic && table_of(i) != nullptr;
}

bool supported(isa i) {
  return compiled(i) && processor_runs(i);
}

const char* to_string(half_path h) {
  switch (h) {
    case half_path::automatic:
      return "automatic";
    case half_path::convert:
      return "convert";
    case half_path::avx512_bf16:
      return "avx512_bf16";
    case half_path::amx:
      return "amx";
  }
  return "?";
}

half_path parse_half_path(const std::string& s) {
  for (half_path h :
       {half_path::automatic, half_path::convert, half_path::avx512_bf16, half_path::amx})
    if (s == to_string(h)) return h;
  std::string got = "'";
  got.append(s).append("'");
  fail("half_path", "one of automatic, convert, avx512_bf16, amx", got);
}

bool compiled(half_path h) {
  return h == half_path::convert || table_of(h) != nullptr;
}

bool supported(half_path h) {
  return compiled(h) && processor_runs(h);
}

std::vector<half_path> supported_half_paths(input_dtype dtype) {
  std::vector<half_path> out;
  if (dtype == input_dtype::float32) return out;
  out.push_back(half_path::convert);
  if (dtype == input_dtype::bfloat16)
    for (half_path h : {half_path::avx512_bf16, half_path::amx})
      if (supported(h)) out.push_back(h);
  return out;
}

half_path preferred_half_path(input_dtype dtype) {
  const std::vector<half_path> paths = supported_half_paths(dtype);
  const auto has = [&](half_path h) {
    return std::find(paths.begin(), paths.end(), h) != paths.end();
  };
  if (has(half_path::amx)) return half_path::amx;
#if defined(FLASHREF_CPU_X86)
  if (has(half_path::avx512_bf16) && vendor_is_amd()) return half_path::avx512_bf16;
#endif
  return half_path::convert;
}

std::vector<isa> supported_isas() {
  std::vector<isa> out;
  for (isa i : {isa::portable, isa::avx2, isa::avx512})
    if (supported(i)) out.push_back(i);
  return out;
}

isa best_isa() {
  return supported_isas().back();
}

plan make_plan(const attention_problem& p, const options& opt) {
  validate(p);
  // Tiles live in a per-thread workspace: bounded, so that a typo cannot ask for gigabytes.
  if (opt.tile_q < 0 || opt.tile_q > kMaxTile)
    fail("tile_q", "0 (default) .. " + std::to_string(kMaxTile), std::to_string(opt.tile_q));
  if (opt.tile_k < 0 || opt.tile_k > kMaxTile)
    fail("tile_k", "0 (default) .. " + std::to_string(kMaxTile), std::to_string(opt.tile_k));
  if (opt.threads < 0) fail("threads", ">= 0 (0 = default)", std::to_string(opt.threads));
  if (opt.kv_chunk < 0) fail("kv_chunk", ">= 0 (0 = automatic)", std::to_string(opt.kv_chunk));
  if (opt.backward_chunks < 0)
    fail("backward_chunks", ">= 0 (0 = automatic)", std::to_string(opt.backward_chunks));
  plan pl;
  pl.used = opt.instruction_set == isa::automatic ? best_isa() : opt.instruction_set;
  if (!supported(pl.used))  // forced on a processor (or build) without it
    unsupported(pl.used);
  pl.half = half_path::convert;
  if (p.dtype != input_dtype::float32) {
    const std::vector<half_path> paths = supported_half_paths(p.dtype);
    if (opt.half == half_path::automatic) {
      // The bf16 kernels are AVX-512 kernels: a lesser instruction set converts.
      if (pl.used == isa::avx512) pl.half = preferred_half_path(p.dtype);
    } else if (std::find(paths.begin(), paths.end(), opt.half) == paths.end() ||
               (opt.half != half_path::convert && pl.used != isa::avx512)) {
      // The bf16 kernels are AVX-512 kernels: on a lesser instruction set only convert runs.
      const std::vector<half_path> runs =
          pl.used == isa::avx512 ? paths : std::vector<half_path>{half_path::convert};
      std::string expected = "a path this processor runs for ";
      expected.append(to_string(p.dtype)).append(" inputs on ").append(to_string(pl.used));
      expected.append(" (").append(listed(runs)).append(")");
      fail("half_path", expected, std::string("'") + to_string(opt.half) + "'");
    } else {
      pl.half = opt.half;
    }
  }
  const kernel_table& kt = pl.half == half_path::convert ? *table_of(pl.used) : *table_of(pl.half);
  pl.tile_q = opt.tile_q > 0 ? opt.tile_q : kt.default_tq;
  // A query tile taller than the block mask's blocks computes every key tile that any of its
  // blocks sees (256-row tiles over 128-row blocks at density 0.44 took 1.5 x the time of
  // 128-row ones): under such a mask the default query tile is no taller than the key tile.
  if (opt.tile_q <= 0 && p.has_block_mask() && p.block_q < pl.tile_q)
    pl.tile_q = std::min(pl.tile_q, kt.block_tk);
  pl.tile_k = opt.tile_k > 0 ? opt.tile_k : kt.default_tk;
  // Likewise a key tile wider than the blocks computes every block of it that one row sees: the
  // bf16 paths' 256-key tile (dense work) gives way to their 128-key one there.
  const bool narrowed = opt.tile_k <= 0 && p.has_block_mask() && p.block_k < pl.tile_k;
  if (narrowed) pl.tile_k = kt.block_tk;
  // The bf16 paths' per-step costs (accᵀ's rescale, loads and stores, the row steps) are what
  // their wide tile spreads over more keys; a block mask narrows the tile, not the step: the
  // visible narrow tiles are taken together, up to the wide tile's keys.
  pl.step_k = pl.tile_k;
  if (narrowed && (pl.half == half_path::avx512_bf16 || pl.half == half_path::amx))
    pl.step_k = std::max<std::int64_t>(1, kt.default_tk / pl.tile_k) * pl.tile_k;
  pl.threads = opt.threads > 0 ? opt.threads : omp_get_max_threads();

  const std::int64_t Lk = p.len_k();
  const std::int64_t items = p.batch() * p.heads_q() * ceil_div(p.len_q(), pl.tile_q);
  std::int64_t chunk = Lk;
  if (opt.kv_chunk > 0) {
    chunk = opt.kv_chunk;
  } else if (items > 0 && items < kMinItems && Lk >= 2 * kMinChunkKeys) {
    chunk = std::max(kMinChunkKeys, ceil_div(Lk, ceil_div(kMinItems, items)));
  }
  chunk = std::min(chunk, Lk);                     // a chunk beyond the keys is no split
  chunk = ceil_div(chunk, pl.tile_k) * pl.tile_k;  // chunks hold whole tiles
  pl.kv_splits = Lk > 0 && chunk < Lk ? ceil_div(Lk, chunk) : 1;
  pl.kv_chunk = pl.kv_splits > 1 ? chunk : Lk;
  return pl;
}

void attention(const attention_problem& p) {
  attention(p, options{});
}

namespace {

// The inputs' storage and where O goes, for either entry.
struct storage_of {
  detail::storage in = detail::storage::f32;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  std::uint16_t* o16 = nullptr;  // O in p.dtype instead of float32 in p.o
};

// The problem as validate() sees it: the 16-bit storage stands in for the float views, whose
// data pointers are only checked for null.
attention_problem with_half_storage(const half_problem& hp) {
  attention_problem p = hp.p;
  if (p.dtype == input_dtype::float32)
    fail("dtype", "bfloat16 or float16 for 16-bit storage", "float32");
  p.q.data = reinterpret_cast<const float*>(hp.q);
  p.k.data = reinterpret_cast<const float*>(hp.k);
  p.v.data = reinterpret_cast<const float*>(hp.v);
  if (hp.o != nullptr) p.o.data = reinterpret_cast<float*>(hp.o);
  return p;
}

void run(const attention_problem& p, const storage_of& st, const options& opt) {
  const plan pl = make_plan(p, opt);
  const kernel_table& kt = pl.half == half_path::convert ? *table_of(pl.used) : *table_of(pl.half);
  const std::int64_t B = p.batch(), Hq = p.heads_q(), Lq = p.len_q(), Lk = p.len_k();
  const std::int64_t Dv = p.head_dim_v();
  if (B * Hq * Lq == 0) return;  // O and LSE have no elements

  context ctx;
  ctx.p = &p;
  ctx.in = st.in;
  ctx.q = st.q;
  ctx.k = st.k;
  ctx.v = st.v;
  // Only tiles of more than a few rows take the bf16 kernel (decode rows the fp32 row kernel):
  // when no item has them, K and V are not packed for it.
  ctx.bf16_dot = (pl.half == half_path::avx512_bf16 || pl.half == half_path::amx) &&
                 std::min(Lq, pl.tile_q) > detail::kRowKernelMaxRows;
  ctx.mask = make_mask_spec(p);
  ctx.scale = float(p.softmax_scale());
  ctx.Lq = Lq;
  ctx.Lk = Lk;
  ctx.D = p.head_dim();
  ctx.Dv = Dv;
  ctx.group = p.group_size();
  ctx.tq = pl.tile_q;
  ctx.tk = pl.tile_k;
  ctx.tk_step = pl.step_k;
  // The bf16 kernels read K and Vᵀ in bfloat16, packed once here for every query tile, into
  // one buffer kept between calls (kept_buffer.hpp). It is left uninitialised: prepack writes
  // every element of each head, padding included, in the parallel region, so that a fresh
  // buffer's pages are first touched (and zeroed by the operating system) by many threads
  // rather than by a serial value-initialisation of tens of MB.
  detail::kept_lease packed;
  std::unique_ptr<std::uint8_t[]> v_bad;
  const std::int64_t heads_kv = B * p.heads_k();
  if (ctx.bf16_dot) {
    ctx.Dkp = ceil_div(ctx.D, detail::kDotK) * detail::kDotK;     // whole AMX tile rows
    ctx.Dvp = ceil_div(Dv, detail::kDotRow) * detail::kDotRow;    // whole result tiles
    ctx.Lkp = (ceil_div(Lk, detail::kDotK) + 1) * detail::kDotK;  // room for rounded-up reads
    // bfloat16 K already is the products' operand, row by row: read where it is.
    ctx.k_in_place = st.in == detail::storage::bf16 && p.k.stride[3] == 1 && ctx.Dkp == ctx.D;
    const std::size_t kb_elements = ctx.k_in_place ? 0 : std::size_t(heads_kv * ctx.Lkp * ctx.Dkp);
    packed = detail::kept_lease((kb_elements + std::size_t(heads_kv * ctx.Dvp * ctx.Lkp)) *
                                sizeof(std::uint16_t));
    v_bad.reset(new std::uint8_t[std::size_t(heads_kv * ctx.Lkp / detail::kDotK)]);
    ctx.kb = ctx.k_in_place ? nullptr : packed.as<std::uint16_t>();
    ctx.vt = packed.as<std::uint16_t>() + kb_elements;
    ctx.v_bad = v_bad.get();
  }

  const std::int64_t nqt = ceil_div(Lq, pl.tile_q), splits = pl.kv_splits;
  const std::int64_t items = B * Hq * nqt * splits;
  // Split partial results: (splits, B, Hq, Lq, Dv) and (splits, B, Hq, Lq). Only decode-like
  // shapes split, so this stays small.
  std::vector<float> part_o, part_lse;
  if (splits > 1) {
    check_allocation("cpu: split-KV partial results",
                     checked_product({std::uint64_t(splits), std::uint64_t(B), std::uint64_t(Hq),
                                      std::uint64_t(Lq), std::uint64_t(Dv) + 1, sizeof(float)}),
                     std::to_string(splits) + " key chunks of O and LSE");
    part_o.resize(std::size_t(splits * B * Hq * Lq * Dv));
    part_lse.resize(std::size_t(splits * B * Hq * Lq));
  }
  const std::size_t ws_floats = kt.workspace_floats(ctx);
  const std::size_t ws_bytes = (ws_floats * sizeof(float) + 63) / 64 * 64 + 64;
  // The element mask of a partial tile: tk rows of the tile kernel's padded stride
  // (round_up(tq, W) + 16 with W <= 16, tile_layout::ldt), or tq rows of the row kernel's keys.
  const std::size_t vis_bytes =
      std::size_t((ceil_div(pl.step_k, 16) + 1) * 16 * (ceil_div(pl.tile_q, 16) + 1) * 16);
  const int threads = int(std::min<std::int64_t>(pl.threads, std::max<std::int64_t>(items, 1)));

#pragma omp parallel num_threads(threads)
  {
    const denormals_as_zero ftz;
    thread_workspace ws;
    std::unique_ptr<float, free_deleter> buffer(
        static_cast<float*>(std::aligned_alloc(64, ws_bytes)));
    ws.f = buffer.get();
    ws.state.resize(std::size_t(pl.tile_q));
    ws.range.resize(std::size_t(pl.tile_q));
    ws.visible.resize(vis_bytes);

    if (ctx.bf16_dot) {
#pragma omp for schedule(static)
      for (std::int64_t bh = 0; bh < heads_kv; ++bh)
        kt.prepack(ctx, bh / p.heads_k(), bh % p.heads_k());
    }

    // The order of the items, heaviest query tiles first (with a causal mask the last query
    // tiles see the most keys). The fp32 kernels take them one key/value head at a time (the
    // query heads of its group and their query tiles, heaviest first within the head), so that
    // the threads running at once share that head's K and V in the caches: +1 to +6 % at 2 and
    // 16 threads. The bf16 kernels, whose K and Vᵀ are packed before the loop, measured 7 to 13 %
    // slower that way at 16 threads (and 3 to 10 % faster at 2): they take the query tile of
    // every head in turn (docs/benchmarks.md, "the order of the work items").
    const bool head_major = !ctx.bf16_dot;
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t idx = 0; idx < items; ++idx) {
      std::int64_t rest = idx;
      const std::int64_t c = rest % splits;
      rest /= splits;
      std::int64_t b = 0, h = 0, qt = 0;
      if (head_major) {
        const std::int64_t g = rest % ctx.group;
        rest /= ctx.group;
        qt = nqt - 1 - rest % nqt;
        rest /= nqt;
        h = rest % p.heads_k() * ctx.group + g;
        b = rest / p.heads_k();
      } else {
        h = rest % Hq;
        rest /= Hq;
        b = rest % B;
        qt = nqt - 1 - rest / B;
      }
      work_item it;
      it.b = b;
      it.h = h;
      it.q0 = qt * pl.tile_q;
      it.q1 = std::min(it.q0 + pl.tile_q, Lq);
      it.k0 = c * pl.kv_chunk;
      it.k1 = std::min(it.k0 + pl.kv_chunk, Lk);
      out_rows out;
      if (splits == 1) {
        const std::int64_t at = b * p.o.stride[0] + h * p.o.stride[1] + it.q0 * p.o.stride[2];
        if (st.o16 != nullptr) {
          out.o16 = st.o16 + at;
          out.o16_dtype = p.dtype;
        } else {
          out.o = p.o.data + at;
        }
        out.o_row = p.o.stride[2];
        out.o_col = p.o.stride[3];
        if (p.lse.data != nullptr) {
          out.lse =
              p.lse.data + b * p.lse.stride[0] + h * p.lse.stride[1] + it.q0 * p.lse.stride[2];
          out.lse_row = p.lse.stride[2];
        }
      } else {
        const std::int64_t row = ((c * B + b) * Hq + h) * Lq + it.q0;
        out.o = part_o.data() + row * Dv;
        out.o_row = Dv;
        out.o_col = 1;
        out.lse = part_lse.data() + row;
        out.lse_row = 1;
      }
      kt.run(ctx, it, out, ws);
    }

    if (splits > 1) {
      // Fold the chunks of each row left to right: the same order on any thread count.
      std::vector<float> o_row(static_cast<std::size_t>(Dv));
      const std::int64_t rows = B * Hq * Lq;
#pragma omp for schedule(static)
      for (std::int64_t row = 0; row < rows; ++row) {
        std::copy_n(part_o.data() + row * Dv, Dv, o_row.data());
        float lse = part_lse[std::size_t(row)];
        for (std::int64_t c = 1; c < splits; ++c) {
          const std::int64_t at = c * rows + row;
          lse = merge_partials(o_row.data(), lse, part_o.data() + at * Dv,
                               part_lse[std::size_t(at)], Dv, o_row.data());
        }
        const std::int64_t i = row % Lq, h = row / Lq % Hq, b = row / (Lq * Hq);
        const std::int64_t at = b * p.o.stride[0] + h * p.o.stride[1] + i * p.o.stride[2];
        if (st.o16 != nullptr) {
          const bool bf16 = p.dtype == input_dtype::bfloat16;
          for (std::int64_t d = 0; d < Dv; ++d) {
            const float x = o_row[std::size_t(d)];
            st.o16[at + d * p.o.stride[3]] = bf16 ? bf16_from_float(x) : f16_from_float(x);
          }
        } else {
          for (std::int64_t d = 0; d < Dv; ++d)
            p.o.data[at + d * p.o.stride[3]] = o_row[std::size_t(d)];
        }
        if (p.lse.data != nullptr)
          p.lse.data[b * p.lse.stride[0] + h * p.lse.stride[1] + i * p.lse.stride[2]] = lse;
      }
    }
  }
}

}  // namespace

void attention(const attention_problem& p, const options& opt) {
  storage_of st;
  st.q = p.q.data;
  st.k = p.k.data;
  st.v = p.v.data;
  run(p, st, opt);
}

plan make_plan(const half_problem& hp, const options& opt) {
  return make_plan(with_half_storage(hp), opt);
}

void attention(const half_problem& hp, const options& opt) {
  const attention_problem p = with_half_storage(hp);
  storage_of st;
  st.in = p.dtype == input_dtype::bfloat16 ? detail::storage::bf16 : detail::storage::f16;
  st.q = hp.q;
  st.k = hp.k;
  st.v = hp.v;
  st.o16 = hp.o;
  run(p, st, opt);
}

namespace {

// The best rate of `loop` (FLOPs per call of `iterations` rounds) on `threads` threads over
// about `seconds`, in windows of about 50 ms.
double peak_gflops(double (*loop)(std::int64_t), int threads, double seconds) {
  if (threads < 1) fail("threads", ">= 1", std::to_string(threads));
  using clock = std::chrono::steady_clock;
  // Calibrate on one thread, then run every thread for about `seconds`.
  std::int64_t iters = 1 << 16;
  double per_iter = 0;
  for (;;) {
    const auto t0 = clock::now();
    loop(iters);
    const double s = std::chrono::duration<double>(clock::now() - t0).count();
    if (s > 0.02) {
      per_iter = s / double(iters);
      break;
    }
    iters *= 4;
  }
  // The best of windows of about 50 ms: a window in which something else held one of the cores
  // (another process, a virtual machine's neighbour) measures less, never more, so the best one
  // is the rate the processor gives when undisturbed — what a kernel's share of peak should be
  // taken against. (One window of the whole duration measured 188 to 328 GFLOP/s from run to
  // run on a shared 2-core virtual machine whose kernels' own rates moved by 5 %.)
  constexpr double kWindow = 0.05;
  const int windows = std::max(1, int(seconds / kWindow + 0.5));
  const std::int64_t n =
      std::max<std::int64_t>(1, std::int64_t(seconds / double(windows) / per_iter));
  double best = 0;
  for (int w = 0; w < windows; ++w) {
    double flops = 0;
    const auto t0 = clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : flops)
    flops += loop(n);
    const double s = std::chrono::duration<double>(clock::now() - t0).count();
    best = std::max(best, flops / s * 1e-9);
  }
  return best;
}

}  // namespace

double peak_fma_gflops(isa i, int threads, double seconds) {
  if (i == isa::automatic) i = best_isa();
  if (!supported(i)) unsupported(i);
  return peak_gflops(table_of(i)->fma_loop, threads, seconds);
}

double peak_dot_gflops(half_path h, int threads, double seconds) {
  if (h == half_path::automatic) h = preferred_half_path(input_dtype::bfloat16);
  if (h == half_path::convert) return peak_fma_gflops(isa::automatic, threads, seconds);
  if (!supported(h)) {
    fail("half_path",
         "a path this processor runs (" + listed(supported_half_paths(input_dtype::bfloat16)) + ")",
         std::string("'") + to_string(h) + "'");
  }
  return peak_gflops(table_of(h)->dot_loop, threads, seconds);
}

}  // namespace flashref::cpu
