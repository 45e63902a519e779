#include "flashref/flashref.hpp"

#if defined(FLASHREF_HAVE_CPU)
#include "flashref/cpu/attention.hpp"
#endif
#if defined(FLASHREF_HAVE_CUDA)
#include "flashref/cuda/attention.hpp"
#endif

namespace flashref {

const char* to_string(backend b) {
  switch (b) {
    case backend::reference:
      return "reference";
    case backend::cpu:
      return "cpu";
    case backend::cuda:
      return "cuda";
    case backend::automatic:
      return "automatic";
  }
  return "?";
}

backend parse_backend(const std::string& s) {
  for (backend b : {backend::reference, backend::cpu, backend::cuda, backend::automatic}) {
    if (s == to_string(b)) return b;
  }
  throw problem_error("backend: expected one of reference, cpu, cuda, automatic, got '" + s + "'");
}

std::vector<backend_info> backends() {
  std::vector<backend_info> out;
  out.push_back({backend::reference, true, true, ""});
#if defined(FLASHREF_HAVE_CPU)
  out.push_back({backend::cpu, true, true, ""});
#else
  out.push_back({backend::cpu, false, false, "the CPU backend is not built into this library"});
#endif
#if defined(FLASHREF_HAVE_CUDA)
  std::string why;
  const bool dev = cuda::device_available(&why);
  out.push_back({backend::cuda, true, dev, why});
#else
  out.push_back({backend::cuda, false, false,
                 "the CUDA backend is not built into this library (FLASHREF_CUDA=OFF or no nvcc)"});
#endif
  return out;
}

backend resolve(backend b) {
  const std::vector<backend_info> all = backends();
  if (b == backend::automatic) {
    for (backend pref : {backend::cuda, backend::cpu, backend::reference}) {
      for (const auto& info : all)
        if (info.id == pref && info.available) return pref;
    }
  }
  for (const auto& info : all) {
    if (info.id == b && !info.available)
      throw problem_error(std::string("backend: expected an available backend, got '") +
                          to_string(b) + "' (" + info.reason + ")");
  }
  return b;
}

backend attention(const attention_problem& p, backend b) {
  const backend use = resolve(b);
  switch (use) {
#if defined(FLASHREF_HAVE_CPU)
    case backend::cpu:
      cpu::attention(p);
      return use;
#endif
#if defined(FLASHREF_HAVE_CUDA)
    case backend::cuda:
      cuda::attention(p);
      return use;
#endif
    default:
      reference::tiled_attention(p);
      return backend::reference;
  }
}

attention_problem make_problem(const xt::xtensor<float, 4>& q, const xt::xtensor<float, 4>& k,
                               const xt::xtensor<float, 4>& v, const attention_options& opt,
                               xt::xtensor<float, 4>& o, xt::xtensor<float, 3>& lse) {
  auto shape4 = [](const auto& x) {
    return std::array<std::int64_t, 4>{std::int64_t(x.shape(0)), std::int64_t(x.shape(1)),
                                       std::int64_t(x.shape(2)), std::int64_t(x.shape(3))};
  };
  const std::int64_t B = std::int64_t(q.shape(0)), Hq = std::int64_t(q.shape(1));
  const std::int64_t Lq = std::int64_t(q.shape(2)), Dv = std::int64_t(v.shape(3));
  o = xt::xtensor<float, 4>::from_shape(
      {std::size_t(B), std::size_t(Hq), std::size_t(Lq), std::size_t(Dv)});
  lse = xt::xtensor<float, 3>::from_shape({std::size_t(B), std::size_t(Hq), std::size_t(Lq)});

  attention_problem p;
  p.q = contiguous<const float, 4>(q.data(), shape4(q));
  p.k = contiguous<const float, 4>(k.data(), shape4(k));
  p.v = contiguous<const float, 4>(v.data(), shape4(v));
  p.o = contiguous<float, 4>(o.data(), {B, Hq, Lq, Dv});
  p.lse = contiguous<float, 3>(lse.data(), {B, Hq, Lq});
  p.scale = opt.scale;
  p.causal = opt.causal;
  p.window_left = opt.window_left;
  p.window_right = opt.window_right;
  if (opt.block_mask.size() > 0 || opt.block_q != 0 || opt.block_k != 0) {
    p.block_mask = contiguous<const std::uint8_t, 4>(opt.block_mask.data(), shape4(opt.block_mask));
    if (p.block_mask.data == nullptr) {
      static const std::uint8_t kNone = 0;  // a zero-sized mask still needs a non-null pointer
      p.block_mask.data = &kNone;
    }
    p.block_q = opt.block_q;
    p.block_k = opt.block_k;
  }
  if (!opt.kv_len.empty()) {
    if (std::int64_t(opt.kv_len.size()) != B)  // one key length per batch entry
      throw problem_error("kv_len: expected " + std::to_string(B) + " entries, got " +
                          std::to_string(opt.kv_len.size()));
    p.kv_len = opt.kv_len.data();
  }
  p.dtype = opt.dtype;
  return p;
}

attention_result attention(const xt::xtensor<float, 4>& q, const xt::xtensor<float, 4>& k,
                           const xt::xtensor<float, 4>& v, const attention_options& opt,
                           backend b) {
  attention_result r;
  const attention_problem p = make_problem(q, k, v, opt, r.o, r.lse);
  r.used = attention(p, b);
  return r;
}

}  // namespace flashref
