#include "problem.hpp"

#include <cmath>
#include <sstream>

#include "flashref/testdata/fixture.hpp"
#include "flashref/testdata/random.hpp"

namespace flashref::test {

std::string problem_shape::describe() const {
  std::ostringstream os;
  os << "B=" << B << " Hq=" << Hq << " Hk=" << Hk << " Lq=" << Lq << " Lk=" << Lk << " D=" << D
     << " Dv=" << Dv << (blhd ? " blhd" : " bhld") << " causal=" << to_string(causal) << " window=("
     << window_left << "," << window_right << ") block=" << block_q << "x" << block_k
     << " density=" << block_density << (mask_broadcast_b ? " bcastB" : "")
     << (mask_broadcast_h ? " bcastH" : "") << (use_kv_len ? " kv_len" : "")
     << " value_scale=" << value_scale;
  return os.str();
}

problem_data random_problem(const problem_shape& s, std::uint64_t seed) {
  const testdata::counter_rng r(seed, 100), rm(seed, 101), rl(seed, 102);
  std::uint64_t n = 0;
  auto fill = [&](std::int64_t H, std::int64_t L, std::int64_t W) {
    const auto shape = s.blhd ? std::array<std::size_t, 4>{std::size_t(s.B), std::size_t(L),
                                                           std::size_t(H), std::size_t(W)}
                              : std::array<std::size_t, 4>{std::size_t(s.B), std::size_t(H),
                                                           std::size_t(L), std::size_t(W)};
    auto x = xt::xtensor<float, 4>::from_shape(shape);
    for (auto& e : x)
      e = float(s.value_scale * r.normal(n++));
    return x;
  };
  problem_data d;
  d.layout = s.blhd ? tensor_layout::blhd : tensor_layout::bhld;
  d.q = fill(s.Hq, s.Lq, s.D);
  d.k = fill(s.Hk, s.Lk, s.D);
  d.v = fill(s.Hk, s.Lk, s.Dv);
  attention_options& opt = d.opt;
  opt.causal = s.causal;
  opt.window_left = s.window_left;
  opt.window_right = s.window_right;
  if (s.block_q > 0) {
    const std::int64_t mb = s.mask_broadcast_b ? 1 : s.B, mh = s.mask_broadcast_h ? 1 : s.Hq;
    const std::int64_t nqb = (s.Lq + s.block_q - 1) / s.block_q;
    const std::int64_t nkb = (s.Lk + s.block_k - 1) / s.block_k;
    opt.block_mask = xt::xtensor<std::uint8_t, 4>::from_shape(
        {std::size_t(mb), std::size_t(mh), std::size_t(nqb), std::size_t(nkb)});
    for (std::size_t i = 0; i < opt.block_mask.size(); ++i)
      opt.block_mask.data()[i] = rm.uniform(i) < s.block_density;
    opt.block_q = s.block_q;
    opt.block_k = s.block_k;
  }
  if (s.use_kv_len) {
    opt.kv_len.resize(std::size_t(s.B));
    for (std::int64_t b = 0; b < s.B; ++b) {
      // Entry 0 sees no key at all; the others a random length, sometimes the full one.
      const double u = rl.uniform(std::uint64_t(b));
      opt.kv_len[std::size_t(b)] = b == 0 ? 0 : std::int32_t(std::floor(u * double(s.Lk + 1)));
    }
  }
  d.problem();  // allocates O and LSE
  poison_outputs(d);
  return d;
}

void poison_outputs(problem_data& d) {
  d.o.fill(NAN);
  d.lse.fill(NAN);
}

void round_inputs(problem_data& d, input_dtype dtype) {
  for (auto* x : {&d.q, &d.k, &d.v})
    for (float& e : *x)
      e = testdata::round_to(dtype, e);
  d.opt.dtype = dtype;
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
