// Fuzz harness: problem descriptors. Two halves, chosen by the first byte:
//  - any descriptor: shapes, strides, block sizes, windows, kv_len and options drawn from the
//    whole int64 range, over a small buffer. validate() must refuse (problem_error) or accept;
//    an accepted descriptor is planned for the CPU and its masks' row intervals and tile
//    classes are computed — arithmetic only, no element is read (the buffer is too small for
//    most shapes that validate, on purpose).
//  - a real problem: small shapes over buffers that hold them, inputs from a few exact values,
//    windows, block sizes and kv_len from anywhere in their valid range, random tiles and
//    split-KV chunks; run on the reference and the CPU backend, which must agree within the
//    contract's tolerance and give (0, -inf) on exactly the same empty rows. Then, as the
//    input asks, the same problem in bfloat16 or float16 (every value above is exact in both)
//    on one of the processor's half paths, within the half tolerance, and bit for bit the same
//    from 16-bit storage as from float32 storage; and the CPU backward against the naive
//    float64 backward (SPEC §9), empty rows' dQ and unseen keys' dK, dV exactly 0.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include "../cpu/cpu_test.hpp"  // same_bits, to_bits
#include "flashref/cpu/attention.hpp"
#include "flashref/cpu/backward.hpp"
#include "flashref/reference/backward.hpp"
#include "flashref/reference/conformance.hpp"
#include "flashref/reference/mask.hpp"
#include "flashref/reference/naive.hpp"
#include "flashref/reference/tiled.hpp"
#include "harness.hpp"

namespace {

using i64 = std::int64_t;
constexpr i64 kMax = std::numeric_limits<i64>::max();
constexpr i64 kMin = std::numeric_limits<i64>::min();

// The exact values a real problem's inputs (and the backward's upstream gradient) are drawn
// from, and the largest magnitude among them: max|V| of the tolerances, the bound of the
// backward's terms.
constexpr float kValues[] = {0.0f, 1.0f, -1.0f, 0.5f, -2.0f, 3.0f, 0.25f, -0.125f};
constexpr double max_magnitude(const float (&x)[8]) {
  double most = 0;
  for (const float e : x)
    most = std::max(most, e < 0 ? -double(e) : double(e));
  return most;
}
constexpr double kMostValue = max_magnitude(kValues);

// Mostly interesting values: small, boundaries, and anything.
i64 some_int(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange(0, 5)) {
    case 0:
      return in.ConsumeIntegralInRange<i64>(-2, 16);
    case 1:
      return in.PickValueInArray({kMax, kMin, kMax - 1, kMin + 1, i64(1) << 31, i64(1) << 32,
                                  i64(1) << 62, -(i64(1) << 31)});
    case 2:
      return in.ConsumeIntegralInRange<i64>(0, 1 << 20);
    default:
      return in.ConsumeIntegral<i64>();
  }
}

template <class T, int R>
flashref::strided<T, R> any_view(FuzzedDataProvider& in, T* data) {
  flashref::strided<T, R> v;
  v.data = in.ConsumeBool() ? data : nullptr;
  for (int d = 0; d < R; ++d) {
    v.shape[std::size_t(d)] = some_int(in);
    v.stride[std::size_t(d)] = some_int(in);
  }
  return v;
}

void any_descriptor(FuzzedDataProvider& in) {
  static float buffer[64];
  static std::uint8_t mask[64];
  std::int32_t kv[8] = {};
  flashref::attention_problem p;
  p.q = any_view<const float, 4>(in, buffer);
  p.k = any_view<const float, 4>(in, buffer);
  p.v = any_view<const float, 4>(in, buffer);
  p.o = any_view<float, 4>(in, buffer);
  p.lse = any_view<float, 3>(in, buffer);
  if (in.ConsumeBool()) p.scale = in.ConsumeFloatingPoint<double>();
  p.causal = in.PickValueInArray({flashref::causal_mode::none, flashref::causal_mode::bottom_right,
                                  flashref::causal_mode::top_left});
  p.window_left = some_int(in);
  p.window_right = some_int(in);
  if (in.ConsumeBool()) p.block_mask = any_view<const std::uint8_t, 4>(in, mask);
  p.block_q = some_int(in);
  p.block_k = some_int(in);
  if (in.ConsumeBool() && p.batch() >= 0 && p.batch() <= 8) {
    for (auto& x : kv)
      x = in.ConsumeIntegral<std::int32_t>();
    p.kv_len = kv;
  }
  try {
    flashref::validate(p);
  } catch (const flashref::problem_error&) {
    return;
  }
  flashref::cpu::options opt;
  opt.tile_q = some_int(in);
  opt.tile_k = some_int(in);
  opt.kv_chunk = some_int(in);
  flashref::fuzz::expect_refusal_only([&] { (void)flashref::cpu::make_plan(p, opt); });
  // Row intervals and tile classes of a few rows and tiles, anywhere in the problem.
  const flashref::mask_spec m = flashref::make_mask_spec(p);
  for (int n = 0; n < 4 && p.batch() > 0 && p.len_q() > 0; ++n) {
    const i64 b = in.ConsumeIntegralInRange<i64>(0, p.batch() - 1);
    const i64 q0 = in.ConsumeIntegralInRange<i64>(0, p.len_q() - 1);
    const i64 q1 = in.ConsumeIntegralInRange<i64>(q0 + 1, p.len_q());
    const flashref::key_range r = m.row_range(b, q0);
    (void)r;
    if (p.len_k() > 0 && !p.has_block_mask()) {
      const i64 k0 = in.ConsumeIntegralInRange<i64>(0, p.len_k() - 1);
      const i64 k1 = in.ConsumeIntegralInRange<i64>(k0 + 1, p.len_k());
      (void)m.classify(b, 0, q0, q1, k0, k1);
    }
  }
}

// The problem (float32 storage `q`, `k`, `v` behind p's views, every value exact in 16 bits)
// as bfloat16 or float16 inputs on one of the half paths this processor runs: within the half
// tolerance of the golden values; from 16-bit storage (half_problem) the same bits; with O
// written in 16 bits, O rounded once from those bits.
void half_inputs(FuzzedDataProvider& in, flashref::attention_problem p, flashref::cpu::options opt,
                 const flashref::reference::golden& g, const std::vector<float>& q,
                 const std::vector<float>& k, const std::vector<float>& v) {
  using flashref::input_dtype;
  p.dtype = in.ConsumeBool() ? input_dtype::bfloat16 : input_dtype::float16;
  const std::vector<flashref::cpu::half_path> paths = flashref::cpu::supported_half_paths(p.dtype);
  opt.half = paths[in.ConsumeIntegralInRange<std::size_t>(0, paths.size() - 1)];
  const i64 B = p.batch(), Hq = p.heads_q(), Lq = p.len_q(), Dv = p.head_dim_v();
  std::vector<float> o(std::size_t(B * Hq * Lq * Dv), NAN), lse(std::size_t(B * Hq * Lq), NAN);
  p.o = flashref::contiguous<float, 4>(o.data(), {B, Hq, Lq, Dv});
  p.lse = flashref::contiguous<float, 3>(lse.data(), {B, Hq, Lq});
  flashref::fuzz::require_no_throw([&] { flashref::cpu::attention(p, opt); },
                                   "cpu runs the half problem");
  const flashref::conformance_report rep =
      flashref::compare(g, o.data(), lse.data(), flashref::default_tolerance(p.dtype, kMostValue));
  flashref::fuzz::require(rep.pass(), "the CPU's half path conforms to the reference");

  using flashref::test::same_bits;
  using flashref::test::to_bits;
  const std::vector<std::uint16_t> q16 = to_bits(q, p.dtype), k16 = to_bits(k, p.dtype),
                                   v16 = to_bits(v, p.dtype);
  std::vector<float> o2(o.size(), NAN), lse2(lse.size(), NAN);
  std::vector<std::uint16_t> o16(o.size(), 0xffff);
  flashref::cpu::half_problem hp{p, q16.data(), k16.data(), v16.data(), nullptr};
  hp.p.o = flashref::contiguous<float, 4>(o2.data(), {B, Hq, Lq, Dv});
  hp.p.lse = flashref::contiguous<float, 3>(lse2.data(), {B, Hq, Lq});
  flashref::fuzz::require_no_throw([&] { flashref::cpu::attention(hp, opt); },
                                   "cpu runs the 16-bit storage");
  flashref::fuzz::require(same_bits(o, o2) && same_bits(lse, lse2),
                          "16-bit storage gives the bits of float32 storage");
  hp.o = o16.data();
  flashref::fuzz::require_no_throw([&] { flashref::cpu::attention(hp, opt); },
                                   "cpu writes O in 16 bits");
  flashref::fuzz::require(o16 == to_bits(o, p.dtype), "O in 16 bits is the float32 O rounded once");
}

// The CPU backward of p (o and lse hold the CPU forward's results) for an upstream gradient of
// exact values: against the naive float64 backward within SPEC §9's float32 tolerance, with
// the empty rows' dQ and the unseen keys' dK, dV exactly 0; then, as the input asks, the
// reference's scalar tiled backward at random tiles, judged the same way.
void backward(FuzzedDataProvider& in, const flashref::attention_problem& p,
              flashref::cpu::options opt) {
  const i64 B = p.batch(), Hq = p.heads_q(), Hk = p.heads_k(), Lq = p.len_q(), Lk = p.len_k(),
            D = p.head_dim(), Dv = p.head_dim_v();
  std::vector<float> d_o(std::size_t(B * Hq * Lq * Dv));
  for (float& e : d_o)
    e = kValues[in.ConsumeIntegralInRange<int>(0, 7)];
  std::vector<float> dq(std::size_t(B * Hq * Lq * D), NAN), dk(std::size_t(B * Hk * Lk * D), NAN),
      dv(std::size_t(B * Hk * Lk * Dv), NAN);
  flashref::attention_gradients g;
  g.d_o = flashref::contiguous<const float, 4>(d_o.data(), {B, Hq, Lq, Dv});
  g.dq = flashref::contiguous<float, 4>(dq.data(), {B, Hq, Lq, D});
  g.dk = flashref::contiguous<float, 4>(dk.data(), {B, Hk, Lk, D});
  g.dv = flashref::contiguous<float, 4>(dv.data(), {B, Hk, Lk, Dv});
  opt.tile_q = in.ConsumeIntegralInRange<i64>(0, 64);
  opt.tile_k = in.ConsumeIntegralInRange<i64>(0, 64);
  opt.backward_chunks = in.ConsumeIntegralInRange<i64>(0, 8);
  const flashref::reference::golden_gradients ref =
      flashref::reference::naive_attention_backward(p, g.d_o);
  flashref::fuzz::require_no_throw([&] { flashref::cpu::attention_backward(p, g, opt); },
                                   "the cpu backward runs it");
  // SPEC §9's tolerance scales with max|ref|, which presumes a gradient of the size of its
  // terms. Exact inputs can make a whole tensor cancel (dQ_i = scale Σ_j P_ij (dP_ij - Delta_i)
  // K_j is 0 for every row whose visible keys share one K, say): the golden is then 0 up to
  // float64 rounding (1e-14) and any float32 evaluation misses it by eps times its terms. There,
  // and only there (max|ref| below 1e-3 of the terms' bound M), the error is held to 1e-4 M
  // instead; non-finite values and the zero rows are judged as always.
  const double scale = p.softmax_scale(), group_rows = double(p.group_size() * Lq);
  const double most = kMostValue;                          // max |x| of every input alike
  const double dp_bound = 2.0 * double(Dv) * most * most;  // |dP - Delta|
  const char* who = "the cpu backward";
  const auto judge = [&](const std::vector<double>& golden, const std::vector<float>& got, i64 cols,
                         const std::vector<char>& zero, double terms) {
    const flashref::gradient_report r =
        flashref::compare_gradient(golden, got.data(), cols, zero, flashref::input_dtype::float32);
    const bool cancelled = r.max_ref < 1e-3 * terms && r.nonfinite == 0 && r.zero_rows_nan == 0 &&
                           r.zero_rows_nonzero == 0 && r.max_abs_err <= 1e-4 * terms;
    if (!r.pass() && !cancelled) {  // what the finding is, beside the input libFuzzer keeps
      std::fprintf(stderr,
                   "fuzz: %s: B %lld Hq %lld Hk %lld Lq %lld Lk %lld D %lld Dv %lld, causal %s, "
                   "window %lld %lld, block mask %d (%lld x %lld), kv_len %d; tiles %lld x "
                   "%lld, chunks %lld: %lld bad of %lld, %lld non-finite, max error %g "
                   "against max |ref| %g, zero rows %lld (NaN %lld, non-zero %lld)\n",
                   who, (long long)B, (long long)Hq, (long long)Hk, (long long)Lq, (long long)Lk,
                   (long long)D, (long long)Dv, flashref::to_string(p.causal),
                   (long long)p.window_left, (long long)p.window_right, int(p.has_block_mask()),
                   (long long)p.block_q, (long long)p.block_k, int(p.kv_len != nullptr),
                   (long long)opt.tile_q, (long long)opt.tile_k, (long long)opt.backward_chunks,
                   (long long)r.bad_elements, (long long)r.elements, (long long)r.nonfinite,
                   r.max_abs_err, r.max_ref, (long long)r.zero_rows, (long long)r.zero_rows_nan,
                   (long long)r.zero_rows_nonzero);
    }
    return r.pass() || cancelled;
  };
  const auto require_conform = [&] {
    flashref::fuzz::require(judge(ref.dq, dq, D, ref.row_empty, scale * dp_bound * most),
                            "dQ conforms");
    flashref::fuzz::require(
        judge(ref.dk, dk, D, ref.key_unseen, scale * dp_bound * most * group_rows), "dK conforms");
    flashref::fuzz::require(judge(ref.dv, dv, Dv, ref.key_unseen, most * group_rows),
                            "dV conforms");
  };
  require_conform();
  if (in.ConsumeBool()) {
    who = "the tiled reference's backward";
    for (std::vector<float>* x : {&dq, &dk, &dv})
      std::fill(x->begin(), x->end(), NAN);
    const flashref::reference::tile_shape tile{in.ConsumeIntegralInRange<i64>(1, 40),
                                               in.ConsumeIntegralInRange<i64>(1, 40)};
    opt.tile_q = tile.q, opt.tile_k = tile.k, opt.backward_chunks = 0;  // as the message says
    flashref::fuzz::require_no_throw(
        [&] { flashref::reference::tiled_attention_backward(p, g, tile); },
        "the tiled reference's backward runs it");
    require_conform();
  }
}

void real_problem(FuzzedDataProvider& in) {
  const i64 B = in.ConsumeIntegralInRange<i64>(0, 2), Hk = in.ConsumeIntegralInRange<i64>(1, 2),
            group = in.ConsumeIntegralInRange<i64>(1, 2), Hq = Hk * group,
            Lq = in.ConsumeIntegralInRange<i64>(0, 40), Lk = in.ConsumeIntegralInRange<i64>(0, 300),
            D = in.ConsumeIntegralInRange<i64>(1, 20), Dv = in.ConsumeIntegralInRange<i64>(1, 20);
  const bool blhd = in.ConsumeBool();
  auto fill = [&](std::vector<float>& x, i64 n) {
    x.resize(std::size_t(n));
    for (float& e : x)
      e = kValues[in.ConsumeIntegralInRange<int>(0, 7)];
  };
  std::vector<float> q, k, v, o(std::size_t(B * Hq * Lq * Dv), NAN),
      lse(std::size_t(B * Hq * Lq), NAN);
  fill(q, B * Hq * Lq * D);
  fill(k, B * Hk * Lk * D);
  fill(v, B * Hk * Lk * Dv);
  flashref::attention_problem p;
  if (blhd) {
    p.q = flashref::from_blhd<const float>(q.data(), B, Lq, Hq, D);
    p.k = flashref::from_blhd<const float>(k.data(), B, Lk, Hk, D);
    p.v = flashref::from_blhd<const float>(v.data(), B, Lk, Hk, Dv);
    p.o = flashref::from_blhd<float>(o.data(), B, Lq, Hq, Dv);
  } else {
    p.q = flashref::contiguous<const float, 4>(q.data(), {B, Hq, Lq, D});
    p.k = flashref::contiguous<const float, 4>(k.data(), {B, Hk, Lk, D});
    p.v = flashref::contiguous<const float, 4>(v.data(), {B, Hk, Lk, Dv});
    p.o = flashref::contiguous<float, 4>(o.data(), {B, Hq, Lq, Dv});
  }
  p.lse = flashref::contiguous<float, 3>(lse.data(), {B, Hq, Lq});
  p.causal = in.PickValueInArray({flashref::causal_mode::none, flashref::causal_mode::bottom_right,
                                  flashref::causal_mode::top_left});
  auto window = [&] {
    return in.ConsumeBool()   ? -1
           : in.ConsumeBool() ? in.ConsumeIntegralInRange<i64>(0, 64)
                              : in.ConsumeIntegralInRange<i64>(0, kMax);
  };
  p.window_left = window();
  p.window_right = window();
  std::vector<std::uint8_t> mask;
  if (in.ConsumeBool()) {
    p.block_q = in.ConsumeBool() ? in.ConsumeIntegralInRange<i64>(1, 64)
                                 : in.ConsumeIntegralInRange<i64>(1, kMax);
    p.block_k = in.ConsumeBool() ? in.ConsumeIntegralInRange<i64>(1, 64)
                                 : in.ConsumeIntegralInRange<i64>(1, kMax);
    const i64 Bm = in.ConsumeBool() ? 1 : B, Hm = in.ConsumeBool() ? 1 : Hq;
    const i64 nqb = Lq == 0 ? 0 : (Lq - 1) / p.block_q + 1,
              nkb = Lk == 0 ? 0 : (Lk - 1) / p.block_k + 1;
    mask.resize(std::size_t(Bm * Hm * nqb * nkb) + 1);
    for (auto& x : mask)
      x = in.ConsumeBool();
    p.block_mask = flashref::contiguous<const std::uint8_t, 4>(mask.data(), {Bm, Hm, nqb, nkb});
  }
  std::vector<std::int32_t> kv;
  if (in.ConsumeBool()) {
    for (i64 b = 0; b < B; ++b)
      kv.push_back(in.ConsumeIntegralInRange<std::int32_t>(0, std::int32_t(Lk)));
    p.kv_len = kv.data();
  }
  flashref::cpu::options opt;
  opt.tile_q = in.ConsumeIntegralInRange<i64>(0, 64);
  opt.tile_k = in.ConsumeIntegralInRange<i64>(0, 64);
  opt.kv_chunk = in.ConsumeBool() ? 0 : in.ConsumeIntegralInRange<i64>(1, kMax);
  opt.threads = 1;

  flashref::fuzz::require_no_throw([&] { flashref::validate(p); }, "a well-formed problem");
  const flashref::reference::golden g = flashref::reference::naive_attention(p);
  flashref::fuzz::require_no_throw([&] { flashref::cpu::attention(p, opt); }, "cpu runs it");
  std::vector<float> o_rows, lse_rows;  // (B, Hq, Lq, Dv) whatever the layout
  for (i64 b = 0; b < B; ++b)
    for (i64 h = 0; h < Hq; ++h)
      for (i64 i = 0; i < Lq; ++i) {
        lse_rows.push_back(p.lse(b, h, i));
        for (i64 x = 0; x < Dv; ++x)
          o_rows.push_back(p.o(b, h, i, x));
      }
  const flashref::conformance_report rep =
      flashref::compare(g, o_rows.data(), lse_rows.data(),
                        flashref::default_tolerance(flashref::input_dtype::float32, kMostValue));
  flashref::fuzz::require(rep.pass(), "the CPU backend conforms to the reference");
  if (in.ConsumeBool()) half_inputs(in, p, opt, g, q, k, v);
  if (in.ConsumeBool()) backward(in, p, opt);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  if (in.ConsumeBool()) {
    any_descriptor(in);
  } else {
    real_problem(in);
  }
  return 0;
}
