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
  const std::vector<input_dtype> f32{input_dtype::float32};
  const std::vector<input_dtype> all{input_dtype::float32, input_dtype::bfloat16,
                                     input_dtype::float16};
  out.push_back({backend::reference, true, true, "", f32});
#if defined(FLASHREF_HAVE_CPU)
  out.push_back({backend::cpu, true, true, "", all});  // bf16/fp16: the CPU's half paths
#else
  out.push_back(
      {backend::cpu, false, false, "the CPU backend is not built into this library", all});
#endif
#if defined(FLASHREF_HAVE_CUDA)
  std::string why;
  const bool dev = cuda::device_available(&why);
  out.push_back({backend::cuda, true, dev, why, all});
#else
  out.push_back({backend::cuda, false, false,
                 "the CUDA backend is not built into this library (FLASHREF_CUDA=OFF or no nvcc)",
                 all});
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

attention_result attention(const xt::xtensor<float, 4>& q, const xt::xtensor<float, 4>& k,
                           const xt::xtensor<float, 4>& v, const attention_options& opt,
                           backend b) {
  attention_result r;
  const attention_problem p = make_problem(q, k, v, opt, r.o, r.lse);
  r.used = attention(p, b);
  return r;
}

}  // namespace flashref
