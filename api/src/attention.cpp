#include "flashref/flashref.hpp"

#include <array>
#include <string>
#include <type_traits>

#if defined(FLASHREF_HAVE_CPU)
#include "flashref/cpu/attention.hpp"
#include "flashref/cpu/backward.hpp"
#endif
#if defined(FLASHREF_HAVE_CUDA)
#include "flashref/cuda/attention.hpp"
#include "flashref/cuda/backward.hpp"
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
  const std::vector<input_dtype> f32{input_dtype::float32};
  const std::vector<input_dtype> all{input_dtype::float32, input_dtype::bfloat16,
                                     input_dtype::float16};
  out.push_back({backend::reference, true, true, "", f32, true, ""});
#if defined(FLASHREF_HAVE_CPU)
  out.push_back({backend::cpu, true, true, "", all, true, ""});  // bf16/fp16: the half paths
#else
  out.push_back(
      {backend::cpu, false, false, "the CPU backend is not built into this library", all});
#endif
#if defined(FLASHREF_HAVE_CUDA)
  std::string why;
  const bool dev = cuda::device_available(&why);
  out.push_back({backend::cuda, true, dev, why, all, true, ""});
#else
  out.push_back({backend::cuda, false, false,
                 "the CUDA backend is not built into this library (FLASHREF_CUDA=OFF or no nvcc)",
                 all, false, "the CUDA backend is not built into this library"});
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

backend attention_backward(const attention_problem& p, const attention_gradients& g, backend b) {
  const std::vector<backend_info> all = backends();
  backend use = b;
  if (b == backend::automatic) {
    use = backend::reference;
    for (backend pref : {backend::cuda, backend::cpu}) {
      bool found = false;
      for (const auto& info : all)
        found = found || (info.id == pref && info.available && info.backward);
      if (found) {
        use = pref;
        break;
      }
    }
  } else {
    use = resolve(b);
    for (const auto& info : all) {
      if (info.id == use && !info.backward)
        throw problem_error(std::string("backend: expected a backend with a backward pass, got '") +
                            to_string(use) + "' (" + info.backward_reason + ")");
    }
  }
  switch (use) {
#if defined(FLASHREF_HAVE_CPU)
    case backend::cpu:
      cpu::attention_backward(p, g);
      return use;
#endif
#if defined(FLASHREF_HAVE_CUDA)
    case backend::cuda:
      cuda::attention_backward(p, g);
      return use;
#endif
    default:
      reference::tiled_attention_backward(p, g);
      return backend::reference;
  }
}

attention_result attention(const xt::xtensor<float, 4>& q, const xt::xtensor<float, 4>& k,
                           const xt::xtensor<float, 4>& v, const attention_options& opt,
                           backend b) {
  attention_result r;
  const attention_problem p = make_problem(q, k, v, opt, r.o, r.lse);
  r.used = attention(p, b);
  return r;
}

gradients_result attention_backward(const xt::xtensor<float, 4>& q, const xt::xtensor<float, 4>& k,
                                    const xt::xtensor<float, 4>& v, const xt::xtensor<float, 4>& o,
                                    const xt::xtensor<float, 3>& lse,
                                    const xt::xtensor<float, 4>& d_o, const attention_options& opt,
                                    backend b) {
  auto dims = [](const auto& x) {
    std::array<std::int64_t, std::decay_t<decltype(x)>::rank> s{};
    for (std::size_t d = 0; d < s.size(); ++d)
      s[d] = std::int64_t(x.shape(d));
    return s;
  };
  auto shape_str = [](const auto& s) {
    std::string out = "[";
    for (std::size_t d = 0; d < s.size(); ++d)
      out += (d ? ", " : "") + std::to_string(s[d]);
    return out + "]";
  };
  // The problem over q, k, v with copies of o and lse as its forward results; make_problem
  // would reallocate a wrongly shaped one, so the shapes are checked against what it asks for.
  xt::xtensor<float, 4> o_in = o;
  xt::xtensor<float, 3> lse_in = lse;
  const attention_problem p = make_problem(q, k, v, opt, o_in, lse_in);
  if (o_in.shape() != o.shape())
    throw problem_error("o: expected shape " + shape_str(dims(o_in)) + ", got " +
                        shape_str(dims(o)));
  if (lse_in.shape() != lse.shape())
    throw problem_error("lse: expected shape " + shape_str(dims(lse_in)) + ", got " +
                        shape_str(dims(lse)));
  gradients_result r;
  r.dq = xt::xtensor<float, 4>::from_shape(q.shape());
  r.dk = xt::xtensor<float, 4>::from_shape(k.shape());
  r.dv = xt::xtensor<float, 4>::from_shape(v.shape());
  attention_gradients g;
  g.d_o = contiguous<const float, 4>(d_o.data(), dims(d_o));
  g.dq = contiguous<float, 4>(r.dq.data(), dims(r.dq));
  g.dk = contiguous<float, 4>(r.dk.data(), dims(r.dk));
  g.dv = contiguous<float, 4>(r.dv.data(), dims(r.dv));
  r.used = attention_backward(p, g, b);
  return r;
}

}  // namespace flashref
