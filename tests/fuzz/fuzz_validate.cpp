// Fuzz harness: problem descriptors. Two halves, chosen by the first byte:
//  - any descriptor: shapes, strides, block sizes, windows, kv_len and options drawn from the
//    whole int64 range, over a small buffer. validate() must refuse (problem_error) or accept;
//    an accepted descriptor is planned for the CPU and its masks' row intervals and tile
//    classes are computed — arithmetic only, no element is read (the buffer is too small for
//    most shapes that validate, on purpose).
//  - a real problem: small shapes over buffers that hold them, inputs from a few exact values,
//    windows, block sizes and kv_len from anywhere in their valid range, random tiles and
//    split-KV chunks; run on the reference and the CPU backend, which must agree within the
//    contract's tolerance and give (0, -inf) on exactly the same empty rows.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "flashref/cpu/attention.hpp"
#include "flashref/reference/conformance.hpp"
#include "flashref/reference/mask.hpp"
#include "flashref/reference/naive.hpp"
#include "harness.hpp"

namespace {

using i64 = std::int64_t;
constexpr i64 kMax = std::numeric_limits<i64>::max();
constexpr i64 kMin = std::numeric_limits<i64>::min();

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

void real_problem(FuzzedDataProvider& in) {
  const i64 B = in.ConsumeIntegralInRange<i64>(0, 2), Hk = in.ConsumeIntegralInRange<i64>(1, 2),
            group = in.ConsumeIntegralInRange<i64>(1, 2), Hq = Hk * group,
            Lq = in.ConsumeIntegralInRange<i64>(0, 40), Lk = in.ConsumeIntegralInRange<i64>(0, 300),
            D = in.ConsumeIntegralInRange<i64>(1, 20), Dv = in.ConsumeIntegralInRange<i64>(1, 20);
  const bool blhd = in.ConsumeBool();
  const float values[] = {0.0f, 1.0f, -1.0f, 0.5f, -2.0f, 3.0f, 0.25f, -0.125f};
  auto fill = [&](std::vector<float>& x, i64 n) {
    x.resize(std::size_t(n));
    for (float& e : x)
      e = values[in.ConsumeIntegralInRange<int>(0, 7)];
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
                        flashref::default_tolerance(flashref::input_dtype::float32, 3.0));
  flashref::fuzz::require(rep.pass(), "the CPU backend conforms to the reference");
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
