#pragma once
// flashref's public entry: attention(problem, backend). A thin umbrella above the backends —
// it chooses one and forwards. The meaning of every case is defined in reference/ (see
// docs/semantics.md); every backend reproduces it within the tolerances stated there.

#include <string>
#include <vector>

#include "flashref/reference/backward.hpp"
#include "flashref/reference/data.hpp"
#include "flashref/reference/merge.hpp"
#include "flashref/reference/naive.hpp"
#include "flashref/reference/problem.hpp"
#include "flashref/reference/spec.hpp"
#include "flashref/reference/tiled.hpp"

namespace flashref {

enum class backend { reference, cpu, cuda, automatic };

const char* to_string(backend b);
backend parse_backend(const std::string& s);  // throws problem_error naming "backend"

struct backend_info {
  backend id;
  bool built;          // compiled into this library
  bool available;      // usable now (for CUDA: a device is present)
  std::string reason;  // why not, when unavailable
  // The input dtypes the backend has a path of its own for (others it computes in float32);
  // the conformance suite runs every one of them with that dtype's tolerance.
  std::vector<input_dtype> dtypes;
  // Has a backward pass (attention_backward); the conformance suite runs it over the catalogue.
  bool backward = false;
  std::string backward_reason;  // why not, when it has none
};

// The concrete backends (reference, cpu, cuda), in that order.
std::vector<backend_info> backends();

// automatic -> cuda when built and a device is present, else cpu when built, else reference.
// A concrete backend that is not built or not available throws problem_error.
backend resolve(backend b);

// Computes p.o and p.lse; returns the backend that ran.
backend attention(const attention_problem& p, backend b = backend::automatic);

// The backward pass (SPEC §9): p.o and p.lse hold the forward's O and LSE (read, not written);
// writes g.dq, g.dk, g.dv and returns the backend that ran. automatic picks the first available
// backend with a backward in the order cuda, cpu, reference; a concrete backend without one
// throws problem_error saying so.
backend attention_backward(const attention_problem& p, const attention_gradients& g,
                           backend b = backend::automatic);

// --- xtensor convenience layer (the options and the owning types live in reference/data.hpp)

struct attention_result : attention_outputs {
  backend used = backend::reference;
};

// q: (B, Hq, Lq, D), k: (B, Hk, Lk, D), v: (B, Hk, Lk, Dv).
attention_result attention(const xt::xtensor<float, 4>& q, const xt::xtensor<float, 4>& k,
                           const xt::xtensor<float, 4>& v, const attention_options& opt = {},
                           backend b = backend::automatic);

struct gradients_result {
  xt::xtensor<float, 4> dq;  // (B, Hq, Lq, D)
  xt::xtensor<float, 4> dk;  // (B, Hk, Lk, D)
  xt::xtensor<float, 4> dv;  // (B, Hk, Lk, Dv)
  backend used = backend::reference;
};

// q, k, v as for attention(); o: (B, Hq, Lq, Dv) and lse: (B, Hq, Lq) the forward's results;
// d_o: (B, Hq, Lq, Dv) the upstream gradient.
gradients_result attention_backward(const xt::xtensor<float, 4>& q, const xt::xtensor<float, 4>& k,
                                    const xt::xtensor<float, 4>& v, const xt::xtensor<float, 4>& o,
                                    const xt::xtensor<float, 3>& lse,
                                    const xt::xtensor<float, 4>& d_o,
                                    const attention_options& opt = {},
                                    backend b = backend::automatic);

}  // namespace flashref
