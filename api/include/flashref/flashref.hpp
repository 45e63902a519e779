#pragma once
// flashref's public entry: attention(problem, backend). A thin umbrella above the backends —
// it chooses one and forwards. The meaning of every case is defined in reference/ (see
// docs/semantics.md); every backend reproduces it within the tolerances stated there.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <xtensor/xtensor.hpp>

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
};

// The concrete backends (reference, cpu, cuda), in that order.
std::vector<backend_info> backends();

// automatic -> cuda when built and a device is present, else cpu when built, else reference.
// A concrete backend that is not built or not available throws problem_error.
backend resolve(backend b);

// Computes p.o and p.lse; returns the backend that ran.
backend attention(const attention_problem& p, backend b = backend::automatic);

// --- xtensor convenience layer -----------------------------------------------------------

struct attention_options {
  std::optional<double> scale;
  causal_mode causal = causal_mode::none;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  xt::xtensor<std::uint8_t, 4> block_mask;  // (Bm, Hm, nqb, nkb); empty = no block mask
  std::int64_t block_q = 0;
  std::int64_t block_k = 0;
  std::vector<std::int32_t> kv_len;  // (B) or empty
  input_dtype dtype = input_dtype::float32;
};

struct attention_result {
  xt::xtensor<float, 4> o;    // (B, Hq, Lq, Dv)
  xt::xtensor<float, 3> lse;  // (B, Hq, Lq)
  backend used = backend::reference;
};

// q: (B, Hq, Lq, D), k: (B, Hk, Lk, D), v: (B, Hk, Lk, Dv).
attention_result attention(const xt::xtensor<float, 4>& q, const xt::xtensor<float, 4>& k,
                           const xt::xtensor<float, 4>& v, const attention_options& opt = {},
                           backend b = backend::automatic);

// The problem descriptor over xtensor inputs and outputs (no copies).
attention_problem make_problem(const xt::xtensor<float, 4>& q, const xt::xtensor<float, 4>& k,
                               const xt::xtensor<float, 4>& v, const attention_options& opt,
                               xt::xtensor<float, 4>& o, xt::xtensor<float, 3>& lse);

}  // namespace flashref
