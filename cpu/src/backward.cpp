// The CPU backward's driver: validation, the plan (instruction set, tiles, key chunks), Delta,
// the OpenMP schedule of the work items and the fixed-order sum of the partial dQs. The
// arithmetic lives in backward_body.inc, compiled once per instruction set.
#include "flashref/cpu/backward.hpp"

#include <omp.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "kept_buffer.hpp"
#include "kernel.hpp"

namespace flashref::cpu {

namespace {

using detail::backward_context;
using detail::backward_item;
using detail::context;
using detail::kernel_table;

// Key tiles of one (batch, key/value head) are cut into interleaved chunks when there are
// too few such pairs to keep many cores busy; each chunk adds to its own copy of dQ. The
// decision reads the shape and the tile sizes only — never the thread count.
constexpr std::int64_t kMinItems = 64;      // aim for at least this many work items
constexpr std::int64_t kMaxChunks = 8;      // at most this many partial copies of dQ
constexpr std::int64_t kDefaultTileQ = 64;  // the backward keeps ten tiles per thread in
constexpr std::int64_t kDefaultTileK = 64;  // cache (Q, dO twice each, K, V, dK, dV, P, dS)

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

std::int64_t round_up(std::int64_t a, std::int64_t m) {
  return ceil_div(a, m) * m;
}

}  // namespace

backward_plan make_backward_plan(const attention_problem& p, const options& opt) {
  const plan fwd = make_plan(p, opt);  // validates the problem, the options, the instruction set
  backward_plan pl;
  pl.used = fwd.used;
  pl.threads = fwd.threads;
  pl.tile_q = opt.tile_q > 0 ? opt.tile_q : kDefaultTileQ;
  pl.tile_k = opt.tile_k > 0 ? opt.tile_k : kDefaultTileK;
  const std::int64_t pairs = p.batch() * p.heads_k();
  const std::int64_t key_tiles = ceil_div(p.len_k(), pl.tile_k);
  if (opt.backward_chunks > 0) {
    pl.chunks = std::max<std::int64_t>(1, std::min(opt.backward_chunks, key_tiles));
  } else if (pairs > 0 && key_tiles > 1) {
    pl.chunks = std::min({ceil_div(kMinItems, pairs), key_tiles, kMaxChunks});
  }
  return pl;
}

void attention_backward(const attention_problem& p, const attention_gradients& g,
                        const options& opt) {
  validate_backward(p, g);
  const backward_plan pl = make_backward_plan(p, opt);
  const kernel_table& kt = *detail::table_of(pl.used);
  const std::int64_t B = p.batch(), Hq = p.heads_q(), Hk = p.heads_k();
  const std::int64_t Lq = p.len_q(), D = p.head_dim(), Dv = p.head_dim_v();

  backward_context bc;
  context& ctx = bc.fwd;
  ctx.p = &p;
  ctx.mask = make_mask_spec(p);
  ctx.scale = float(p.softmax_scale());
  ctx.Lq = Lq;
  ctx.Lk = p.len_k();
  ctx.D = D;
  ctx.Dv = Dv;
  ctx.group = p.group_size();
  ctx.tq = pl.tile_q;
  ctx.tk = pl.tile_k;
  bc.g = &g;
  bc.chunks = pl.chunks;
  bc.dq_ld = round_up(D, kt.width);

  const std::int64_t rows = B * Hq * Lq;
  const std::int64_t items = B * Hk * pl.chunks;
  // Delta (B, Hq, Lq) and the partial dQs (chunks, B, Hq, Lq, dq_ld), the latter in the buffer
  // kept between calls (kept_buffer.hpp: hundreds of MB at L = 4096, whose fresh pages the
  // system would zero); each item zeroes its own slice of it, so that no thread writes what
  // another one reads.
  std::vector<float> delta(static_cast<std::size_t>(rows));
  const detail::kept_lease dq_part(std::size_t(pl.chunks * rows * bc.dq_ld) * sizeof(float));
  bc.delta = delta.data();
  bc.dq_part = dq_part.as<float>();

  const std::size_t ws_floats = kt.backward_workspace_floats(bc);
  const std::size_t ws_bytes = (ws_floats * sizeof(float) + 63) / 64 * 64 + 64;
  const std::size_t vis_bytes =
      std::size_t((ceil_div(pl.tile_k, 16) + 1) * 16 * (ceil_div(pl.tile_q, 16) + 1) * 16);
#pragma omp parallel num_threads(pl.threads)
  {
    const detail::denormals_as_zero ftz;

    // Delta_i = Σ_d dO_id O_id, in float64 and rounded once.
#pragma omp for schedule(static)
    for (std::int64_t row = 0; row < rows; ++row) {
      const std::int64_t i = row % Lq, h = row / Lq % Hq, b = row / (Lq * Hq);
      const float* d_o = g.d_o.data + detail::offset_of(g.d_o, b, h, i);
      const float* o = p.o.data + detail::offset_of(p.o, b, h, i);
      const std::int64_t sd = g.d_o.stride[3], so = p.o.stride[3];
      double s = 0.0;
      for (std::int64_t d = 0; d < Dv; ++d)
        s += double(d_o[d * sd]) * double(o[d * so]);
      delta[std::size_t(row)] = float(s);
    }

    detail::thread_workspace ws;
    std::unique_ptr<float, detail::free_deleter> buffer(
        static_cast<float*>(std::aligned_alloc(64, ws_bytes)));
    ws.f = buffer.get();
    ws.range.resize(std::size_t(pl.tile_q));
    ws.visible.resize(vis_bytes);

#pragma omp for schedule(dynamic, 1)
    for (std::int64_t idx = 0; idx < items; ++idx) {
      backward_item it;
      it.chunk = idx % pl.chunks;
      it.hk = idx / pl.chunks % Hk;
      it.b = idx / (pl.chunks * Hk);
      kt.run_backward(bc, it, ws);
    }

    // dQ_i = scale Σ_c dQ_c,i, the chunks summed in order: the same bits on any thread count.
    // A row's sums run chunk by chunk over all its columns (each column's terms in the same
    // order as one column at a time), in a buffer of the thread's own.
    std::vector<float> sum(static_cast<std::size_t>(D));
#pragma omp for schedule(static)
    for (std::int64_t row = 0; row < rows; ++row) {
      const std::int64_t i = row % Lq, h = row / Lq % Hq, b = row / (Lq * Hq);
      const float* part = bc.dq_part + row * bc.dq_ld;
      float* s = sum.data();
      std::copy_n(part, D, s);
      for (std::int64_t c = 1; c < pl.chunks; ++c) {
        const float* next = part + c * rows * bc.dq_ld;
        for (std::int64_t d = 0; d < D; ++d)
          s[d] += next[d];
      }
      float* dq = g.dq.data + detail::offset_of(g.dq, b, h, i);
      const std::int64_t sd = g.dq.stride[3];
      for (std::int64_t d = 0; d < D; ++d)
        dq[d * sd] = ctx.scale * s[d];
    }
  }
}

}  // namespace flashref::cpu
