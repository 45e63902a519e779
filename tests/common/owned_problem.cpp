#include "owned_problem.hpp"

#include <cmath>
#include <sstream>

namespace flashref::test {

std::string problem_shape::describe() const {
  std::ostringstream os;
  os << "B=" << B << " Hq=" << Hq << " Hk=" << Hk << " Lq=" << Lq << " Lk=" << Lk << " D=" << D
     << " Dv=" << Dv << (blhd ? " blhd" : " bhld") << " causal=" << to_string(causal) << " window=("
     << window_left << "," << window_right << ") block=" << block_q << "x" << block_k
     << " density=" << block_density << (mask_broadcast_b ? " bcastB" : "")
     << (mask_broadcast_h ? " bcastH" : "") << (use_kv_len ? " kv_len" : "");
  return os.str();
}

owned_problem::owned_problem(const problem_shape& s, std::uint64_t seed) : shape(s) {
  const testdata::counter_rng r(seed, 100), rm(seed, 101), rl(seed, 102);
  std::uint64_t n = 0;
  auto fill = [&](std::vector<float>& x, std::int64_t count) {
    x.resize(std::size_t(count));
    for (auto& e : x)
      e = float(s.value_scale * r.normal(n++));
  };
  fill(q, s.B * s.Hq * s.Lq * s.D);
  fill(k, s.B * s.Hk * s.Lk * s.D);
  fill(v, s.B * s.Hk * s.Lk * s.Dv);
  o.assign(std::size_t(s.B * s.Hq * s.Lq * s.Dv), 0.f);
  lse.assign(std::size_t(s.B * s.Hq * s.Lq), 0.f);

  auto view = [&](auto* data, std::int64_t H, std::int64_t L, std::int64_t D) {
    using T = std::remove_pointer_t<decltype(data)>;
    return s.blhd ? from_blhd<T>(data, s.B, L, H, D) : contiguous<T, 4>(data, {s.B, H, L, D});
  };
  p.q = view(static_cast<const float*>(q.data()), s.Hq, s.Lq, s.D);
  p.k = view(static_cast<const float*>(k.data()), s.Hk, s.Lk, s.D);
  p.v = view(static_cast<const float*>(v.data()), s.Hk, s.Lk, s.Dv);
  p.o = view(o.data(), s.Hq, s.Lq, s.Dv);
  p.lse = contiguous<float, 3>(lse.data(), {s.B, s.Hq, s.Lq});
  p.causal = s.causal;
  p.window_left = s.window_left;
  p.window_right = s.window_right;
  if (s.block_q > 0) {
    const std::int64_t mb = s.mask_broadcast_b ? 1 : s.B, mh = s.mask_broadcast_h ? 1 : s.Hq;
    const std::int64_t nqb = (s.Lq + s.block_q - 1) / s.block_q;
    const std::int64_t nkb = (s.Lk + s.block_k - 1) / s.block_k;
    mask.resize(std::size_t(mb * mh * nqb * nkb));
    for (std::size_t i = 0; i < mask.size(); ++i)
      mask[i] = rm.uniform(i) < s.block_density;
    static const std::uint8_t kNone = 0;
    p.block_mask =
        contiguous<const std::uint8_t, 4>(mask.empty() ? &kNone : mask.data(), {mb, mh, nqb, nkb});
    p.block_q = s.block_q;
    p.block_k = s.block_k;
  }
  if (s.use_kv_len) {
    kv_len.resize(std::size_t(s.B));
    for (std::int64_t b = 0; b < s.B; ++b) {
      // Entry 0 sees no key at all; the others a random length, sometimes the full one.
      const double u = rl.uniform(std::uint64_t(b));
      kv_len[std::size_t(b)] = b == 0 ? 0 : std::int32_t(std::floor(u * double(s.Lk + 1)));
    }
    p.kv_len = kv_len.data();
  }
}

void owned_problem::poison_outputs() {
  for (auto& x : o)
    x = NAN;
  for (auto& x : lse)
    x = NAN;
}

problem_shape random_shape(std::uint64_t seed) {
  const testdata::counter_rng r(seed, 200);
  std::uint64_t n = 0;
  auto pick = [&](std::int64_t lo, std::int64_t hi) {
    return lo + std::int64_t(r.uniform(n++) * double(hi - lo + 1));
  };
  problem_shape s;
  s.B = pick(1, 3);
  s.Hk = pick(1, 3);
  s.Hq = s.Hk * pick(1, 3);
  s.Lq = pick(0, 9) == 0 ? pick(0, 2) : pick(1, 90);
  s.Lk = pick(0, 9) == 0 ? pick(0, 2) : pick(1, 130);
  s.D = pick(1, 40);
  s.Dv = pick(0, 3) == 0 ? pick(1, 40) : s.D;
  s.blhd = pick(0, 1) == 1;
  const auto c = pick(0, 2);
  s.causal = c == 0   ? causal_mode::none
             : c == 1 ? causal_mode::bottom_right
                      : causal_mode::top_left;
  if (pick(0, 2) == 0) {
    s.window_left = pick(-1, 20);
    s.window_right = pick(-1, 20);
  }
  if (pick(0, 1) == 1) {
    s.block_q = pick(1, 40);
    s.block_k = pick(1, 40);
    s.block_density = r.uniform(n++);
    s.mask_broadcast_b = pick(0, 1) == 1;
    s.mask_broadcast_h = pick(0, 1) == 1;
  }
  s.use_kv_len = pick(0, 3) == 0;
  s.value_scale = pick(0, 4) == 0 ? 8.0 : 1.0;
  return s;
}

}  // namespace flashref::test
