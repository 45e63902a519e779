// flashref._core — the binding under the Python package: the umbrella's attention(problem,
// backend) over arrays passed in place (numpy through the buffer protocol, torch through
// DLPack), merge_partials, and the C++ fixture reader and judge behind flashref.fixtures and
// flashref.check. The Python layer (python/flashref) allocates the outputs and checks what it
// can cheaply; everything else is checked here, with the library's one-line messages.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flashref/flashref.hpp"
#include "flashref/testdata/check.hpp"
#include "flashref/testdata/fixture.hpp"

#if defined(FLASHREF_HAVE_CUDA)
#include "flashref/cuda/attention.hpp"
#include "flashref/cuda/backward.hpp"
#endif

namespace nb = nanobind;

namespace flashref::python {

namespace {

using array = nb::ndarray<nb::ro>;  // an input of any dtype, device and strides
using out_array = nb::ndarray<>;    // an output, written in place
constexpr int kHost = nb::device::cpu::value;
constexpr int kCuda = nb::device::cuda::value;

// A dtype or device no backend (or not the chosen one) takes: raised as TypeError.
class type_error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

std::string dtype_name(nb::dlpack::dtype t) {
  using code = nb::dlpack::dtype_code;
  const std::string bits = std::to_string(t.bits);
  switch (code(t.code)) {
    case code::Float:
      return "float" + bits;
    case code::Bfloat:
      return "bfloat" + bits;
    case code::Int:
      return "int" + bits;
    case code::UInt:
      return "uint" + bits;
    case code::Bool:
      return "bool";
    default:
      return "dtype code " + std::to_string(t.code) + " of " + bits + " bits";
  }
}

bool is(nb::dlpack::dtype t, nb::dlpack::dtype_code c, int bits) {
  return t.code == std::uint8_t(c) && t.bits == bits && t.lanes == 1;
}
bool is_float32(nb::dlpack::dtype t) {
  return is(t, nb::dlpack::dtype_code::Float, 32);
}

std::string device_name(int type, int id) {
  if (type == kHost) return "cpu";
  if (type == kCuda) return "cuda:" + std::to_string(id);
  return "DLPack device type " + std::to_string(type);
}
std::string device_name(const array& a) {
  return device_name(a.device_type(), a.device_id());
}

std::string shape_text(const array& a) {
  std::string s = "[";
  for (std::size_t d = 0; d < a.ndim(); ++d)
    s += (d ? ", " : "") + std::to_string(a.shape(d));
  return s + "]";
}

void expect_ndim(const char* field, const array& a, std::size_t ndim, const char* dims) {
  if (a.ndim() != ndim) {
    throw problem_error(std::string(field) + ": expected " + std::to_string(ndim) + " dimensions " +
                        dims + ", got " + std::to_string(a.ndim()) + " (shape " + shape_text(a) +
                        ")");
  }
}

// The backends that take a dtype for inputs in host or device memory, for the messages.
std::string takers(input_dtype want, bool device) {
  std::string s;
  for (const backend_info& b : backends()) {
    const bool dtype_ok = std::find(b.dtypes.begin(), b.dtypes.end(), want) != b.dtypes.end();
    const bool memory_ok = !device || b.id == backend::cuda;
    if (dtype_ok && memory_ok && b.built)
      s += (s.empty() ? "" : ", ") + std::string(to_string(b.id));
  }
  return s.empty() ? "none built into this library" : s;
}

std::optional<input_dtype> as_input_dtype(nb::dlpack::dtype t) {
  if (is_float32(t)) return input_dtype::float32;
  if (is(t, nb::dlpack::dtype_code::Bfloat, 16)) return input_dtype::bfloat16;
  if (is(t, nb::dlpack::dtype_code::Float, 16)) return input_dtype::float16;
  return std::nullopt;
}

// Shape and strides of a 4-D tensor seen as [B, H, L, D]; blhd storage swaps dims 1 and 2.
template <class View>
void view4(View& v, const array& a, bool blhd) {
  for (int d = 0; d < 4; ++d) {
    v.shape[std::size_t(d)] = std::int64_t(a.shape(std::size_t(d)));
    v.stride[std::size_t(d)] = a.stride(std::size_t(d));
  }
  if (blhd) {
    std::swap(v.shape[1], v.shape[2]);
    std::swap(v.stride[1], v.stride[2]);
  }
}

template <class View>
void view_n(View& v, const array& a) {
  for (std::size_t d = 0; d < a.ndim(); ++d) {
    v.shape[d] = std::int64_t(a.shape(d));
    v.stride[d] = a.stride(d);
  }
}

struct call {
  const array& q;
  const array& k;
  const array& v;
  const array& o;
  const std::optional<array>& lse;
  std::optional<double> scale;
  causal_mode causal;
  std::int64_t window_left, window_right;
  const std::optional<array>& block_mask;
  std::int64_t block_q, block_k;
  const std::optional<array>& kv_len;
  bool blhd;
};

// Every tensor of a call in the memory of q (host, or the same CUDA device).
void expect_same_device(const call& c) {
  const auto same = [&](const char* field, const array& a) {
    if (a.device_type() != c.q.device_type() || a.device_id() != c.q.device_id())
      throw type_error(std::string(field) + ": expected the device of q (" + device_name(c.q) +
                       "), got " + device_name(a));
  };
  same("k", c.k);
  same("v", c.v);
  same("o", c.o);
  if (c.lse) same("lse", *c.lse);
  if (c.block_mask) same("block_mask", *c.block_mask);
  if (c.kv_len) same("kv_len", *c.kv_len);
}

void expect_masks(const call& c) {
  if (c.block_mask) {
    expect_ndim("block_mask", *c.block_mask, 4, "(Bm, Hm, nqb, nkb)");
    const auto t = c.block_mask->dtype();
    if (!is(t, nb::dlpack::dtype_code::UInt, 8) && !is(t, nb::dlpack::dtype_code::Bool, 8))
      throw type_error("block_mask: expected dtype uint8 or bool, got " + dtype_name(t));
  }
  if (c.kv_len) {
    expect_ndim("kv_len", *c.kv_len, 1, "(B)");
    if (!is(c.kv_len->dtype(), nb::dlpack::dtype_code::Int, 32))
      throw type_error("kv_len: expected dtype int32, got " + dtype_name(c.kv_len->dtype()));
    if (c.kv_len->ndim() == 1 && c.kv_len->shape(0) > 1 && c.kv_len->stride(0) != 1)
      throw problem_error("kv_len: expected a contiguous array, got stride " +
                          std::to_string(c.kv_len->stride(0)));
  }
}

template <class Problem>
void fill_masks(Problem& p, const call& c) {
  p.scale = c.scale;
  p.causal = c.causal;
  p.window_left = c.window_left;
  p.window_right = c.window_right;
  p.block_q = c.block_q;
  p.block_k = c.block_k;
}

// The masks of a problem (host, or the CUDA device entry's): the block mask and key lengths
// read in place.
template <class Problem>
void attach_masks(Problem& p, const call& c) {
  fill_masks(p, c);
  if (c.block_mask) {
    p.block_mask.data = static_cast<const std::uint8_t*>(c.block_mask->data());
    view_n(p.block_mask, *c.block_mask);
  }
  if (c.kv_len) {
    if (std::int64_t(c.kv_len->shape(0)) != p.q.shape[0])
      throw problem_error("kv_len: expected shape [" + std::to_string(p.q.shape[0]) + "], got " +
                          shape_text(*c.kv_len));
    p.kv_len = static_cast<const std::int32_t*>(c.kv_len->data());
  }
}

// The call's q, k, v, o, lse and masks as the library's float views over the caller's
// pointers (data and layout only: the dtypes are the caller's to check, and a device pointer is
// never dereferenced here).
attention_problem tensor_views(const call& c) {
  attention_problem p;
  p.q.data = static_cast<const float*>(c.q.data());
  p.k.data = static_cast<const float*>(c.k.data());
  p.v.data = static_cast<const float*>(c.v.data());
  p.o.data = static_cast<float*>(const_cast<void*>(c.o.data()));
  view4(p.q, c.q, c.blhd);
  view4(p.k, c.k, c.blhd);
  view4(p.v, c.v, c.blhd);
  view4(p.o, c.o, c.blhd);
  if (c.lse) {
    p.lse.data = static_cast<float*>(const_cast<void*>(c.lse->data()));
    view_n(p.lse, *c.lse);
  }
  attach_masks(p, c);
  return p;
}

// Host memory: the float32 problem of the umbrella, for any backend, over the caller's arrays.
attention_problem host_problem(const call& c) {
  for (const auto& [field, a] :
       {std::pair{"q", &c.q}, std::pair{"k", &c.k}, std::pair{"v", &c.v}, std::pair{"o", &c.o}}) {
    if (!is_float32(a->dtype())) {
      const std::optional<input_dtype> t = as_input_dtype(a->dtype());
      const bool f64 = is(a->dtype(), nb::dlpack::dtype_code::Float, 64);
      throw type_error(std::string(field) + ": expected dtype float32 in host memory, got " +
                       dtype_name(a->dtype()) +
                       (t ? " (" + dtype_name(a->dtype()) + " inputs: in device memory on " +
                                takers(*t, true) + ")"
                        : f64 ? " (float64 inputs: the reference backend, backend=\"reference\")"
                              : ""));
    }
  }
  if (c.lse && !is_float32(c.lse->dtype()))
    throw type_error("lse: expected dtype float32, got " + dtype_name(c.lse->dtype()));
  return tensor_views(c);
}

backend run_host(const call& c, backend chosen) {
  const attention_problem p = host_problem(c);
  nb::gil_scoped_release unlocked;
  return attention(p, chosen);
}

// --- float64 on the reference backend (for torch.autograd.gradcheck): the naive float64
// reference on inputs that are float64 arrays holding float32 values, since every problem
// stores float32. The values are narrowed (a copy) and must survive it exactly.

// a (4-D, float64, [B, H, L, X] or blhd) as a contiguous [B, H, L, X] float32 tensor.
xt::xtensor<float, 4> narrow(const char* field, const array& a, bool blhd) {
  if (!is(a.dtype(), nb::dlpack::dtype_code::Float, 64) || a.device_type() != kHost)
    throw type_error(std::string(field) + ": expected float64 in host memory (as q), got " +
                     dtype_name(a.dtype()) + " on " + device_name(a));
  strided<const double, 4> in;
  in.data = static_cast<const double*>(a.data());
  view4(in, a, blhd);
  xt::xtensor<float, 4> out =
      xt::empty<float>({std::size_t(in.shape[0]), std::size_t(in.shape[1]),
                        std::size_t(in.shape[2]), std::size_t(in.shape[3])});
  for (std::int64_t b = 0; b < in.shape[0]; ++b)
    for (std::int64_t h = 0; h < in.shape[1]; ++h)
      for (std::int64_t i = 0; i < in.shape[2]; ++i)
        for (std::int64_t d = 0; d < in.shape[3]; ++d) {
          const double x = in(b, h, i, d);
          const float f = static_cast<float>(x);
          if (double(f) != x && !std::isnan(x)) {
            throw problem_error(std::string(field) + "[" + std::to_string(b) + ", " +
                                std::to_string(h) + ", " + std::to_string(i) + ", " +
                                std::to_string(d) +
                                "]: expected a float64 value exactly representable in float32 "
                                "(the reference reads float32 inputs), got " +
                                testdata::number(x));
          }
          out(std::size_t(b), std::size_t(h), std::size_t(i), std::size_t(d)) = f;
        }
  return out;
}

// Writes row-major [B, H, L, X] values into the float64 output a ([B, H, L, X] or blhd).
void widen_into(const char* field, const std::vector<double>& values, const array& a, bool blhd) {
  if (!is(a.dtype(), nb::dlpack::dtype_code::Float, 64))
    throw type_error(std::string(field) + ": expected dtype float64, got " + dtype_name(a.dtype()));
  strided<double, 4> out;
  out.data = static_cast<double*>(const_cast<void*>(a.data()));
  view4(out, a, blhd);
  if (std::size_t(out.size()) != values.size())
    throw problem_error(std::string(field) + ": expected " + std::to_string(values.size()) +
                        " elements, got " + std::to_string(out.size()));
  std::size_t n = 0;
  for (std::int64_t b = 0; b < out.shape[0]; ++b)
    for (std::int64_t h = 0; h < out.shape[1]; ++h)
      for (std::int64_t i = 0; i < out.shape[2]; ++i)
        for (std::int64_t d = 0; d < out.shape[3]; ++d)
          out(b, h, i, d) = values[n++];
}

// The inputs of a float64 call, narrowed, with the problem over them (no output views).
struct narrowed {
  xt::xtensor<float, 4> q, k, v;
  attention_problem p;
};

void narrow_inputs(narrowed& n, const call& c) {
  n.q = narrow("q", c.q, c.blhd);
  n.k = narrow("k", c.k, c.blhd);
  n.v = narrow("v", c.v, c.blhd);
  const auto shape = [](const xt::xtensor<float, 4>& x) {
    return std::array<std::int64_t, 4>{std::int64_t(x.shape(0)), std::int64_t(x.shape(1)),
                                       std::int64_t(x.shape(2)), std::int64_t(x.shape(3))};
  };
  n.p.q = contiguous<const float, 4>(n.q.data(), shape(n.q));
  n.p.k = contiguous<const float, 4>(n.k.data(), shape(n.k));
  n.p.v = contiguous<const float, 4>(n.v.data(), shape(n.v));
  attach_masks(n.p, c);
}

// O (float64, in the call's layout) and LSE (float64 [B, H, Lq]) of the naive reference.
void reference64(const call& c) {
  narrowed n;
  narrow_inputs(n, c);
  nb::gil_scoped_release unlocked;
  const reference::golden g = reference::naive_attention(n.p);
  widen_into("o", g.o, c.o, c.blhd);
  if (c.lse) {
    const array& lse = *c.lse;
    if (!is(lse.dtype(), nb::dlpack::dtype_code::Float, 64) || lse.size() != g.lse.size())
      throw problem_error("lse: expected float64 of " + std::to_string(g.lse.size()) +
                          " elements, got " + dtype_name(lse.dtype()) + " of " +
                          std::to_string(lse.size()));
    strided<double, 3> out;
    out.data = static_cast<double*>(const_cast<void*>(lse.data()));
    view_n(out, lse);
    std::size_t i = 0;
    for (std::int64_t b = 0; b < out.shape[0]; ++b)
      for (std::int64_t h = 0; h < out.shape[1]; ++h)
        for (std::int64_t r = 0; r < out.shape[2]; ++r)
          out(b, h, r) = g.lse[i++];
  }
}

// The element types of a call on device memory: q, k, v one of float32, bfloat16, float16; o
// float32 or q's; lse float32. Checked before anything reaches the device (TypeError naming
// the field).
struct device_dtypes {
  input_dtype in;  // q, k, v
  input_dtype o;
};

// "float32 or <in>", for the outputs and gradients that take either.
std::string float32_or(input_dtype in) {
  return in == input_dtype::float32 ? "float32" : std::string("float32 or ") + to_string(in);
}

device_dtypes expect_device_dtypes(const call& c) {
  const std::optional<input_dtype> in = as_input_dtype(c.q.dtype());
  if (!in)
    throw type_error("q: expected dtype float32, bfloat16 or float16, got " +
                     dtype_name(c.q.dtype()));
  for (const auto& [field, a] : {std::pair{"k", &c.k}, std::pair{"v", &c.v}}) {
    if (as_input_dtype(a->dtype()) != in)
      throw type_error(std::string(field) + ": expected dtype " + to_string(*in) +
                       " (the dtype of q), got " + dtype_name(a->dtype()));
  }
  const std::optional<input_dtype> out = as_input_dtype(c.o.dtype());
  if (out != input_dtype::float32 && out != in)
    throw type_error("o: expected dtype " + float32_or(*in) + ", got " + dtype_name(c.o.dtype()));
  if (c.lse && !is_float32(c.lse->dtype()))
    throw type_error("lse: expected dtype float32, got " + dtype_name(c.lse->dtype()));
  return {*in, *out};
}

#if defined(FLASHREF_HAVE_CUDA)
// The forward's tensors and masks of a call as the device entry's problem, in place.
void fill_device_problem(cuda::device_problem& p, const call& c, const device_dtypes& t) {
  p.q = {const_cast<void*>(c.q.data()), t.in};
  p.k = {const_cast<void*>(c.k.data()), t.in};
  p.v = {const_cast<void*>(c.v.data()), t.in};
  p.o = {const_cast<void*>(c.o.data()), t.o};
  view4(p.q, c.q, c.blhd);
  view4(p.k, c.k, c.blhd);
  view4(p.v, c.v, c.blhd);
  view4(p.o, c.o, c.blhd);
  if (c.lse) {
    p.lse = {const_cast<void*>(c.lse->data()), input_dtype::float32};
    view_n(p.lse, *c.lse);
  }
  attach_masks(p, c);
}

// Device memory: the CUDA backend's device entry on the caller's stream.
void run_device(const call& c, const device_dtypes& t, std::uintptr_t stream) {
  cuda::device_problem p;
  fill_device_problem(p, c, t);
  nb::gil_scoped_release unlocked;
  cuda::attention(p, reinterpret_cast<cudaStream_t>(stream));
}
#endif

// The checks every call passes before it reaches a backend.
void expect_call(const call& c) {
  const char* dims = c.blhd ? "(B, L, H, D)" : "(B, H, L, D)";
  expect_ndim("q", c.q, 4, dims);
  expect_ndim("k", c.k, 4, dims);
  expect_ndim("v", c.v, 4, dims);
  expect_ndim("o", c.o, 4, dims);
  if (c.lse) expect_ndim("lse", *c.lse, 3, "(B, H, Lq)");
  expect_same_device(c);
  expect_masks(c);
}

// q in CUDA memory, for a backend that takes device memory (TypeError otherwise).
void expect_device_backend(const array& q, backend chosen) {
  if (q.device_type() != kCuda)
    throw type_error("q: expected host or CUDA memory, got " + device_name(q));
  if (chosen != backend::cuda && chosen != backend::automatic) {
    throw type_error(std::string("q: expected host memory for backend ") + to_string(chosen) +
                     ", got " + device_name(q) +
                     " (device memory: " + takers(input_dtype::float32, true) + ")");
  }
}

// The call of an entry (forward, backward, timing) from its arguments, with the checks every
// call passes before it reaches a backend.
call checked_call(const array& q, const array& k, const array& v, const array& o,
                  const std::optional<array>& lse, std::optional<double> scale,
                  const std::string& causal, std::int64_t window_left, std::int64_t window_right,
                  const std::optional<array>& block_mask, std::int64_t block_q,
                  std::int64_t block_k, const std::optional<array>& kv_len, bool blhd) {
  const call c{q,
               k,
               v,
               o,
               lse,
               scale,
               parse_causal(causal),
               window_left,
               window_right,
               block_mask,
               block_q,
               block_k,
               kv_len,
               blhd};
  expect_call(c);
  return c;
}

// attention(q, k, v, o, lse, ...) -> the name of the backend that ran.
const char* attention_into(const array& q, const array& k, const array& v, const array& o,
                           const std::optional<array>& lse, std::optional<double> scale,
                           const std::string& causal, std::int64_t window_left,
                           std::int64_t window_right, const std::optional<array>& block_mask,
                           std::int64_t block_q, std::int64_t block_k,
                           const std::optional<array>& kv_len, const std::string& backend_name,
                           bool blhd, std::uintptr_t stream) {
  const call c = checked_call(q, k, v, o, lse, scale, causal, window_left, window_right, block_mask,
                              block_q, block_k, kv_len, blhd);
  const backend chosen = parse_backend(backend_name);
  if (q.device_type() == kHost && chosen == backend::reference &&
      is(q.dtype(), nb::dlpack::dtype_code::Float, 64)) {
    reference64(c);
    return to_string(backend::reference);
  }
  if (q.device_type() == kHost) return to_string(run_host(c, resolve(chosen)));
  expect_device_backend(q, chosen);
  const device_dtypes t = expect_device_dtypes(c);
#if defined(FLASHREF_HAVE_CUDA)
  resolve(backend::cuda);  // built and a device present, or the reason why not
  run_device(c, t, stream);
  return to_string(backend::cuda);
#else
  (void)t;
  (void)stream;
  resolve(backend::cuda);  // throws: names why the CUDA backend is unavailable
  return to_string(backend::cuda);
#endif
}

// --- the backward pass (SPEC §9) -------------------------------------------------------------

struct grads_call {
  const array& d_o;
  const array& dq;
  const array& dk;
  const array& dv;
};

// The backward's dO, dQ, dK, dV as float views over the caller's pointers, as tensor_views.
attention_gradients gradient_views(const grads_call& g, bool blhd) {
  attention_gradients grads;
  grads.d_o.data = static_cast<const float*>(g.d_o.data());
  grads.dq.data = static_cast<float*>(const_cast<void*>(g.dq.data()));
  grads.dk.data = static_cast<float*>(const_cast<void*>(g.dk.data()));
  grads.dv.data = static_cast<float*>(const_cast<void*>(g.dv.data()));
  view4(grads.d_o, g.d_o, blhd);
  view4(grads.dq, g.dq, blhd);
  view4(grads.dk, g.dk, blhd);
  view4(grads.dv, g.dv, blhd);
  return grads;
}

void expect_grads(const call& c, const grads_call& g) {
  const char* dims = c.blhd ? "(B, L, H, D)" : "(B, H, L, D)";
  if (!c.lse) throw problem_error("lse: expected the forward's LSE for the backward, got None");
  for (const auto& [field, a] : {std::pair{"do", &g.d_o}, std::pair{"dq", &g.dq},
                                 std::pair{"dk", &g.dk}, std::pair{"dv", &g.dv}}) {
    expect_ndim(field, *a, 4, dims);
    if (a->device_type() != c.q.device_type() || a->device_id() != c.q.device_id())
      throw type_error(std::string(field) + ": expected the device of q (" + device_name(c.q) +
                       "), got " + device_name(*a));
  }
}

// float64 on the reference backend: the naive float64 backward on narrowed inputs.
void reference64_backward(const call& c, const grads_call& g) {
  narrowed n;
  narrow_inputs(n, c);
  const xt::xtensor<float, 4> d_o = narrow("do", g.d_o, c.blhd);
  const strided<const float, 4> d_o_view = contiguous<const float, 4>(
      d_o.data(), {std::int64_t(d_o.shape(0)), std::int64_t(d_o.shape(1)),
                   std::int64_t(d_o.shape(2)), std::int64_t(d_o.shape(3))});
  nb::gil_scoped_release unlocked;
  const reference::golden_gradients gold = reference::naive_attention_backward(n.p, d_o_view);
  widen_into("dq", gold.dq, g.dq, c.blhd);
  widen_into("dk", gold.dk, g.dk, c.blhd);
  widen_into("dv", gold.dv, g.dv, c.blhd);
}

// The element types of a backward's own tensors on device memory: do float32 or q's dtype;
// dq, dk, dv one dtype, float32 or q's (TypeError naming the field).
struct device_gradient_dtypes {
  input_dtype d_o;
  input_dtype grads;  // dq, dk, dv
};

device_gradient_dtypes expect_device_gradient_dtypes(const grads_call& g, input_dtype in) {
  const auto float32_or_in = [&](const char* field, const array& a) {
    const std::optional<input_dtype> t = as_input_dtype(a.dtype());
    if (t != input_dtype::float32 && t != in)
      throw type_error(std::string(field) + ": expected dtype " + float32_or(in) +
                       " (the dtype of q), got " + dtype_name(a.dtype()));
    return *t;
  };
  const input_dtype d_o = float32_or_in("do", g.d_o);
  const input_dtype grads = float32_or_in("dq", g.dq);
  for (const auto& [field, a] : {std::pair{"dk", &g.dk}, std::pair{"dv", &g.dv}}) {
    if (as_input_dtype(a->dtype()) != grads)
      throw type_error(std::string(field) + ": expected dtype " + to_string(grads) +
                       " (the dtype of dq), got " + dtype_name(a->dtype()));
  }
  return {d_o, grads};
}

// The library's shape rules of the backward (validate_backward, with its messages) on a call
// over device memory, applied on the host before the device is touched: the views carry the
// caller's pointers, never dereferenced here; kv_len, whose values live in device memory, is
// left out (its shape is checked).
void validate_device_backward(const call& c, const grads_call& g) {
  attention_problem p = tensor_views(c);
  p.kv_len = nullptr;
  validate_backward(p, gradient_views(g, c.blhd));
}

#if defined(FLASHREF_HAVE_CUDA)
// Device memory: the CUDA backward's device entry on the caller's stream, over the caller's
// tensors in place. Its workspace (Delta, B·Hq·Lq floats; dQ's sums where the Hopper kernel
// forms dQ beside dK and dV, fixed point or, with `deterministic` false, float32) is allocated
// and freed on that stream by the entry (cudaMallocAsync).
void run_device_backward(const call& c, const grads_call& g, const device_dtypes& t,
                         const device_gradient_dtypes& gt, bool deterministic,
                         std::uintptr_t stream) {
  cuda::device_backward_problem p;
  p.deterministic = deterministic;
  fill_device_problem(p.forward, c, t);
  p.d_o = {const_cast<void*>(g.d_o.data()), gt.d_o};
  p.d_q = {const_cast<void*>(g.dq.data()), gt.grads};
  p.d_k = {const_cast<void*>(g.dk.data()), gt.grads};
  p.d_v = {const_cast<void*>(g.dv.data()), gt.grads};
  view4(p.d_o, g.d_o, c.blhd);
  view4(p.d_q, g.dq, c.blhd);
  view4(p.d_k, g.dk, c.blhd);
  view4(p.d_v, g.dv, c.blhd);
  nb::gil_scoped_release unlocked;
  cuda::attention_backward(p, reinterpret_cast<cudaStream_t>(stream));
}
#endif

// attention_backward(q, k, v, o, lse, do, dq, dk, dv, ...) -> the name of the backend that ran.
const char* attention_backward_into(const array& q, const array& k, const array& v, const array& o,
                                    const std::optional<array>& lse, const array& d_o,
                                    const array& dq, const array& dk, const array& dv,
                                    std::optional<double> scale, const std::string& causal,
                                    std::int64_t window_left, std::int64_t window_right,
                                    const std::optional<array>& block_mask, std::int64_t block_q,
                                    std::int64_t block_k, const std::optional<array>& kv_len,
                                    const std::string& backend_name, bool blhd, bool deterministic,
                                    std::uintptr_t stream) {
  const call c = checked_call(q, k, v, o, lse, scale, causal, window_left, window_right, block_mask,
                              block_q, block_k, kv_len, blhd);
  const grads_call g{d_o, dq, dk, dv};
  expect_grads(c, g);
  const backend chosen = parse_backend(backend_name);
  if (q.device_type() != kHost) {
    expect_device_backend(q, chosen);
    const device_dtypes t = expect_device_dtypes(c);
    const device_gradient_dtypes gt = expect_device_gradient_dtypes(g, t.in);
    validate_device_backward(c, g);
#if defined(FLASHREF_HAVE_CUDA)
    resolve(backend::cuda);  // built and a device present, or the reason why not
    run_device_backward(c, g, t, gt, deterministic, stream);
#else
    (void)gt;
    (void)deterministic;
    (void)stream;
    resolve(backend::cuda);  // throws: names why the CUDA backend is unavailable
#endif
    return to_string(backend::cuda);
  }
  if (chosen == backend::reference && is(q.dtype(), nb::dlpack::dtype_code::Float, 64)) {
    reference64_backward(c, g);
    return to_string(backend::reference);
  }
  const attention_problem p = host_problem(c);
  for (const auto& [field, a] :
       {std::pair{"do", &d_o}, std::pair{"dq", &dq}, std::pair{"dk", &dk}, std::pair{"dv", &dv}}) {
    if (!is_float32(a->dtype()))
      throw type_error(std::string(field) + ": expected dtype float32 in host memory, got " +
                       dtype_name(a->dtype()));
  }
  const attention_gradients grads = gradient_views(g, blhd);
  nb::gil_scoped_release unlocked;
  return to_string(attention_backward(p, grads, chosen));
}

// For the binding's benchmark: the median time of `repeats` calls of the C++ entry
// attention(problem, backend) on the problem attention_into would run (host memory only), timed
// in C++, so that a Python timing of flashref.attention can be set against it.
double entry_seconds(const array& q, const array& k, const array& v, const array& o,
                     const std::optional<array>& lse, std::optional<double> scale,
                     const std::string& causal, std::int64_t window_left, std::int64_t window_right,
                     const std::optional<array>& block_mask, std::int64_t block_q,
                     std::int64_t block_k, const std::optional<array>& kv_len,
                     const std::string& backend_name, bool blhd, int repeats) {
  const call c = checked_call(q, k, v, o, lse, scale, causal, window_left, window_right, block_mask,
                              block_q, block_k, kv_len, blhd);
  if (q.device_type() != kHost) throw type_error("q: expected host memory, got " + device_name(q));
  const backend chosen = parse_backend(backend_name);
  const attention_problem p = host_problem(c);
  std::vector<double> times(std::size_t(std::max(repeats, 1)));
  nb::gil_scoped_release unlocked;
  attention(p, chosen);  // warm-up
  for (double& t : times) {
    const auto start = std::chrono::steady_clock::now();
    attention(p, chosen);
    t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  std::nth_element(times.begin(), times.begin() + std::ptrdiff_t(times.size() / 2), times.end());
  return times[times.size() / 2];
}

// --- the allocating entries of flashref.attention and flashref.attention_backward -------------
// q decides the kind of the results: numpy arrays for a numpy q, torch tensors on q's device for
// a torch q. All the per-tensor work of a call is done here, in one call from Python: the import
// of each argument, the allocation of the outputs; the checks are the *_into entries'.

// The Python objects a call uses, looked up once and kept for the life of the process (never
// released, so that nothing of them runs at interpreter exit).
struct numpy_api {
  PyObject* ndarray;  // the type numpy.ndarray
  PyObject* empty;    // numpy.empty
  PyObject* float32;  // numpy.dtype("float32")
  PyObject* float64;
};

struct torch_api {
  PyObject* tensor;        // the type torch.Tensor
  PyObject* empty;         // torch.empty
  PyObject* to_dlpack;     // torch.utils.dlpack.to_dlpack (torch._C._to_dlpack, C code)
  PyObject* float32;       // torch.float32
  PyObject* float64;       //
  PyObject* dtype_device;  // ("dtype", "device"): the keywords of the torch.empty calls
};

PyObject* keep(nb::object o) {
  return o.release().ptr();
}

// Two threads may both look the objects up on a first call (an import may release the GIL):
// they find the same objects, and one set is kept.
const numpy_api& numpy_objects() {
  static const numpy_api* api = nullptr;
  if (!api) {
    const nb::module_ np = nb::module_::import_("numpy");
    api = new numpy_api{keep(np.attr("ndarray")), keep(np.attr("empty")),
                        keep(np.attr("dtype")("float32")), keep(np.attr("dtype")("float64"))};
  }
  return *api;
}

// torch's objects, or nullptr while torch is not imported (then no tensor exists).
const torch_api* torch_objects() {
  static const torch_api* api = nullptr;
  if (!api) {
    PyObject* modules = PySys_GetObject("modules");  // borrowed
    if (!modules || !PyDict_Check(modules) || !PyDict_GetItemString(modules, "torch"))
      return nullptr;
    const nb::module_ torch = nb::module_::import_("torch");
    api = new torch_api{keep(torch.attr("Tensor")),
                        keep(torch.attr("empty")),
                        keep(nb::module_::import_("torch.utils.dlpack").attr("to_dlpack")),
                        keep(torch.attr("float32")),
                        keep(torch.attr("float64")),
                        keep(nb::make_tuple("dtype", "device"))};
  }
  return api;
}

bool is_tensor(const torch_api* t, nb::handle x) {
  if (!t) return false;
  const int r = PyObject_IsInstance(x.ptr(), t->tensor);
  if (r < 0) throw nb::python_error();  // an __instancecheck__ that raised
  return r == 1;
}

// "list", or "ndarray of dtype object" for an array of a dtype no DLPack consumer takes.
std::string python_type_name(nb::handle x) {
  std::string s = nb::cast<std::string>(nb::handle(x.type()).attr("__name__"));
  if (nb::hasattr(x, "dtype"))
    s += std::string(" of dtype ") + nb::str(nb::object(x.attr("dtype"))).c_str();
  return s;
}

// One argument, read in place. A torch tensor goes through torch's C exporter: nanobind's import
// would call Tensor.__dlpack__, Python code that asks torch for the current device and streams
// on every call (and, on PyTorch releases whose default is stream=None, makes the default stream
// wait on the current one), several microseconds per tensor; the binding needs none of it, it
// reads the data in place and enqueues on the stream it is given. Anything else goes through
// nanobind (DLPack, the buffer protocol). The array shares the argument's memory.
array import_array(const char* field, nb::handle x, const torch_api* t) {
  if (is_tensor(t, x)) {
    const nb::object capsule = nb::steal(PyObject_CallOneArg(t->to_dlpack, x.ptr()));
    if (!capsule.is_valid()) throw nb::python_error();
    return nb::cast<array>(capsule, false);
  }
  array a;
  if (!nb::try_cast<array>(x, a, false))
    throw type_error(std::string(field) + ": expected a numpy array or a torch tensor, got " +
                     python_type_name(x));
  return a;
}

std::optional<array> import_optional(const char* field, nb::handle x, const torch_api* t) {
  if (x.is_none()) return std::nullopt;
  return import_array(field, x, t);
}

// The outputs of a call on q: numpy arrays (numpy.empty) or torch tensors on q's device
// (torch.empty). O and the gradients are float32, float64 for float64 inputs on the reference
// backend (which computes in float64, for gradcheck), q's dtype for torch tensors in CUDA memory
// (float32, bfloat16, float16); LSE is float32, float64 as O on the reference backend. A q of
// any other dtype gets float32 outputs, and the checks of the call name what it should be.
class outputs {
 public:
  outputs(nb::handle q, const array& qa, const torch_api* torch_q, backend chosen)
      : torch_(torch_q) {
    const bool f64 = qa.device_type() == kHost && chosen == backend::reference &&
                     is(qa.dtype(), nb::dlpack::dtype_code::Float, 64);
    PyObject* f32 = torch_ ? torch_->float32 : numpy_objects().float32;
    PyObject* wide = f64 ? (torch_ ? torch_->float64 : numpy_objects().float64) : f32;
    o_dtype_ = nb::borrow(wide);
    lse_dtype_ = nb::borrow(wide);
    if (torch_) {
      device_ = q.attr("device");
      if (qa.device_type() == kCuda) o_dtype_ = q.attr("dtype");
    }
  }

  nb::object o(nb::handle shape) const { return empty(shape, o_dtype_); }
  nb::object lse(nb::handle shape) const { return empty(shape, lse_dtype_); }

 private:
  nb::object empty(nb::handle shape, nb::handle dtype) const {
    PyObject* r = nullptr;
    if (torch_) {
      PyObject* args[] = {shape.ptr(), dtype.ptr(), device_.ptr()};
      r = PyObject_Vectorcall(torch_->empty, args, 1, torch_->dtype_device);
    } else {
      PyObject* args[] = {shape.ptr(), dtype.ptr()};
      r = PyObject_Vectorcall(numpy_objects().empty, args, 2, nullptr);
    }
    if (!r) throw nb::python_error();
    return nb::steal(r);
  }

  const torch_api* torch_;  // nullptr for numpy outputs
  nb::object device_;       // q.device, for torch
  nb::object o_dtype_, lse_dtype_;
};

// The frameworks of a call's arguments: torch's objects where torch is imported (any argument
// may be a tensor), and whether q is a tensor; TypeError when q is neither a numpy array nor a
// tensor, as the Python layer says it.
struct frameworks {
  const torch_api* torch;
  bool torch_q;
};

frameworks frameworks_of(nb::handle q) {
  const torch_api* t = torch_objects();
  if (Py_TYPE(q.ptr()) == reinterpret_cast<PyTypeObject*>(numpy_objects().ndarray))
    return {t, false};
  if (!is_tensor(t, q))
    throw type_error("q: expected a numpy array or a torch tensor, got " + python_type_name(q));
  return {t, true};
}

nb::tuple shape_of(const array& a) {
  nb::list s;
  for (std::size_t d = 0; d < a.ndim(); ++d)
    s.append(a.shape(d));
  return nb::tuple(s);
}

// attention(q, k, v, ...) -> o, or (o, lse) with return_lse: flashref.attention's call.
nb::object attention_alloc(nb::handle q, nb::handle k, nb::handle v, std::optional<double> scale,
                           const std::string& causal, std::int64_t window_left,
                           std::int64_t window_right, nb::handle block_mask, std::int64_t block_q,
                           std::int64_t block_k, nb::handle kv_len, const std::string& backend_name,
                           bool blhd, bool return_lse, std::uintptr_t stream) {
  const frameworks f = frameworks_of(q);
  const array qa = import_array("q", q, f.torch);
  const array va = import_array("v", v, f.torch);
  // O's shape is made of q's and v's: their ranks first (the others' are the entry's to check).
  expect_ndim("q", qa, 4, blhd ? "(B, L, H, D)" : "(B, H, L, D)");
  expect_ndim("v", va, 4, blhd ? "(B, L, H, Dv)" : "(B, H, L, Dv)");
  const std::size_t B = qa.shape(0), d1 = qa.shape(1), d2 = qa.shape(2), Dv = va.shape(3);
  const outputs out(q, qa, f.torch_q ? f.torch : nullptr, parse_backend(backend_name));
  const nb::object o = out.o(nb::make_tuple(B, d1, d2, Dv));  // q's layout
  const nb::object lse = return_lse ? out.lse(nb::make_tuple(B, blhd ? d2 : d1, blhd ? d1 : d2))
                                    : nb::none();  // (B, Hq, Lq)
  const array ka = import_array("k", k, f.torch);
  const array oa = import_array("o", o, f.torch);
  const std::optional<array> lsea = import_optional("lse", lse, f.torch);
  const std::optional<array> mask = import_optional("block_mask", block_mask, f.torch);
  const std::optional<array> lengths = import_optional("kv_len", kv_len, f.torch);
  attention_into(qa, ka, va, oa, lsea, scale, causal, window_left, window_right, mask, block_q,
                 block_k, lengths, backend_name, blhd, stream);
  if (return_lse) return nb::make_tuple(o, lse);
  return o;
}

// attention_backward(q, k, v, o, lse, do, ...) -> (dq, dk, dv), shaped as q, k and v, in the
// dtype of the forward's O on q: flashref.attention_backward's call.
nb::tuple attention_backward_alloc(nb::handle q, nb::handle k, nb::handle v, nb::handle o,
                                   nb::handle lse, nb::handle d_o, std::optional<double> scale,
                                   const std::string& causal, std::int64_t window_left,
                                   std::int64_t window_right, nb::handle block_mask,
                                   std::int64_t block_q, std::int64_t block_k, nb::handle kv_len,
                                   const std::string& backend_name, bool blhd, bool deterministic,
                                   std::uintptr_t stream) {
  const frameworks f = frameworks_of(q);
  const array qa = import_array("q", q, f.torch);
  const array ka = import_array("k", k, f.torch);
  const array va = import_array("v", v, f.torch);
  const outputs out(q, qa, f.torch_q ? f.torch : nullptr, parse_backend(backend_name));
  const nb::object dq = out.o(shape_of(qa));
  const nb::object dk = out.o(shape_of(ka));
  const nb::object dv = out.o(shape_of(va));
  const array oa = import_array("o", o, f.torch);
  const std::optional<array> lsea = import_optional("lse", lse, f.torch);
  const array doa = import_array("do", d_o, f.torch);
  const array dqa = import_array("dq", dq, f.torch);
  const array dka = import_array("dk", dk, f.torch);
  const array dva = import_array("dv", dv, f.torch);
  const std::optional<array> mask = import_optional("block_mask", block_mask, f.torch);
  const std::optional<array> lengths = import_optional("kv_len", kv_len, f.torch);
  attention_backward_into(qa, ka, va, oa, lsea, doa, dqa, dka, dva, scale, causal, window_left,
                          window_right, mask, block_q, block_k, lengths, backend_name, blhd,
                          deterministic, stream);
  return nb::make_tuple(dq, dk, dv);
}

// merge(o_a, lse_a, o_b, lse_b, o, lse): SPEC §5 row by row over C-contiguous arrays of one
// float dtype; o (rows, Dv) and lse (rows) may alias an input.
template <class T>
void merge_rows(const array& o_a, const array& lse_a, const array& o_b, const array& lse_b,
                const out_array& o, const out_array& lse, std::int64_t rows, std::int64_t dv) {
  const T* oa = static_cast<const T*>(o_a.data());
  const T* ob = static_cast<const T*>(o_b.data());
  const T* la = static_cast<const T*>(lse_a.data());
  const T* lb = static_cast<const T*>(lse_b.data());
  T* oo = static_cast<T*>(o.data());
  T* lo = static_cast<T*>(lse.data());
  nb::gil_scoped_release unlocked;
  for (std::int64_t r = 0; r < rows; ++r)
    lo[r] = merge_partials<T>(oa + r * dv, la[r], ob + r * dv, lb[r], dv, oo + r * dv);
}

void merge_into(const array& o_a, const array& lse_a, const array& o_b, const array& lse_b,
                const out_array& o, const out_array& lse) {
  const nb::dlpack::dtype t = o_a.dtype();
  if (!is_float32(t) && !is(t, nb::dlpack::dtype_code::Float, 64))
    throw type_error("o_a: expected dtype float32 or float64, got " + dtype_name(t));
  const std::size_t rows = lse_a.size();
  const std::size_t dv = o_a.ndim() > 0 ? o_a.shape(o_a.ndim() - 1) : 0;
  for (const auto& [field, a, n] :
       {std::tuple{"o_a", &o_a, rows * dv}, std::tuple{"lse_a", &lse_a, rows},
        std::tuple{"o_b", &o_b, rows * dv}, std::tuple{"lse_b", &lse_b, rows}}) {
    if (a->device_type() != kHost)
      throw type_error(std::string(field) + ": expected host memory, got " + device_name(*a));
    if (a->dtype() != t)
      throw type_error(std::string(field) + ": expected dtype " + dtype_name(t) +
                       " (the dtype of o_a), got " + dtype_name(a->dtype()));
    if (a->size() != n)
      throw problem_error(std::string(field) + ": expected " + std::to_string(n) +
                          " elements, got " + std::to_string(a->size()));
  }
  if (o.dtype() != t || lse.dtype() != t || o.size() != rows * dv || lse.size() != rows)
    throw problem_error("merge: expected outputs of the inputs' dtype and sizes");
  if (t == nb::dtype<float>()) {
    merge_rows<float>(o_a, lse_a, o_b, lse_b, o, lse, std::int64_t(rows), std::int64_t(dv));
  } else {
    merge_rows<double>(o_a, lse_a, o_b, lse_b, o, lse, std::int64_t(rows), std::int64_t(dv));
  }
}

// A fixture read by the C++ reader, with the file it came from.
struct fixture_handle {
  testdata::fixture fx;
  std::filesystem::path path;
};

// The HDF5 library is not built thread-safe: one reader at a time, other threads (and the
// GIL) free meanwhile.
fixture_handle read_fixture(const std::string& path) {
  static std::mutex hdf5;
  const std::lock_guard<std::mutex> one_at_a_time(hdf5);
  return {testdata::read_fixture(path), path};
}

// Read-only numpy views of a fixture's storage, kept alive by the fixture handle.
template <class T>
nb::ndarray<nb::numpy, const T> numpy_view(const T* data, const std::vector<std::size_t>& shape,
                                           nb::handle owner) {
  return nb::ndarray<nb::numpy, const T>(data, shape.size(), shape.data(), owner);
}

template <class T, std::size_t R>
nb::ndarray<nb::numpy, const T> numpy_view(const xt::xtensor<T, R>& x, nb::handle owner) {
  return numpy_view(x.data(), std::vector<std::size_t>(x.shape().begin(), x.shape().end()), owner);
}

template <class T>
nb::ndarray<nb::numpy, const T> numpy_view(const std::vector<T>& x, nb::handle owner) {
  return numpy_view(x.data(), {x.size()}, owner);
}

std::vector<std::size_t> golden_o_shape(const reference::golden& g) {
  return {std::size_t(g.o_shape[0]), std::size_t(g.o_shape[1]), std::size_t(g.o_shape[2]),
          std::size_t(g.o_shape[3])};
}

// a is C-contiguous (what the Python layer hands over for judging).
void expect_contiguous(const char* field, const array& a) {
  std::int64_t want = 1;
  for (std::size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) > 1 && a.stride(d) != want)
      throw problem_error(std::string(field) + ": expected a C-contiguous array, got strides");
    want *= std::int64_t(a.shape(d));
  }
}

// a holds C-contiguous float64 values (what the Python layer hands over).
void expect_float64_contiguous(const char* field, const array& a) {
  if (!is(a.dtype(), nb::dlpack::dtype_code::Float, 64) || a.device_type() != kHost)
    throw type_error(std::string(field) + ": expected float64 in host memory, got " +
                     dtype_name(a.dtype()) + " on " + device_name(a));
  expect_contiguous(field, a);
}

// The judge of `flashref check` on one result: o (and lse) as C-contiguous float64 arrays of
// the golden shapes; o_dtype and lse_dtype say how the caller's result was stored.
testdata::check_row check(const fixture_handle& h, const array& o, const std::optional<array>& lse,
                          const std::optional<array>& dq, const std::optional<array>& dk,
                          const std::optional<array>& dv, const std::string& o_dtype,
                          const std::string& lse_dtype, const std::string& judged,
                          std::size_t keep_worst) {
  const reference::golden& g = h.fx.golden;
  const auto expect = [](const char* field, const array& a, const std::vector<std::size_t>& shape) {
    bool ok = a.ndim() == shape.size();
    for (std::size_t d = 0; ok && d < shape.size(); ++d)
      ok = a.shape(d) == shape[d];
    if (!ok) {
      std::string want = "[";
      for (std::size_t d = 0; d < shape.size(); ++d)
        want += (d ? ", " : "") + std::to_string(shape[d]);
      throw problem_error(std::string(field) + ": expected shape " + want +
                          "] (the golden result), got " + shape_text(a));
    }
  };
  const std::vector<std::size_t> o_shape = golden_o_shape(g);
  expect("o", o, o_shape);
  expect_float64_contiguous("o", o);
  if (lse) {
    expect("lse", *lse, {o_shape[0], o_shape[1], o_shape[2]});
    expect_float64_contiguous("lse", *lse);
  }
  testdata::check_row row = testdata::row_for(h.fx, h.path.stem().string());
  row.judged = judged;
  row.o_dtype = o_dtype;
  row.lse_dtype = lse ? lse_dtype : "";
  const double* lse_data = lse ? static_cast<const double*>(lse->data()) : nullptr;
  // Gradients: C-contiguous float32 of the golden shapes (the Python layer converts).
  testdata::judged_gradients grads;
  const auto gradient = [&](const char* field, const std::optional<array>& x,
                            const std::array<std::int64_t, 4>& shape) -> const float* {
    if (!x) return nullptr;
    if (!h.fx.grads)
      throw problem_error(std::string(field) + ": expected no gradient (the fixture " + h.fx.name +
                          " has no /golden/" + field + "), got one");
    expect(field, *x,
           {std::size_t(shape[0]), std::size_t(shape[1]), std::size_t(shape[2]),
            std::size_t(shape[3])});
    if (!is_float32(x->dtype()) || x->device_type() != kHost)
      throw type_error(std::string(field) + ": expected float32 in host memory, got " +
                       dtype_name(x->dtype()));
    expect_contiguous(field, *x);
    return static_cast<const float*>(x->data());
  };
  const std::array<std::int64_t, 4> none{};
  grads.dq = gradient("dq", dq, h.fx.grads ? h.fx.grads->q_shape : none);
  grads.dk = gradient("dk", dk, h.fx.grads ? h.fx.grads->k_shape : none);
  grads.dv = gradient("dv", dv, h.fx.grads ? h.fx.grads->v_shape : none);
  nb::gil_scoped_release unlocked;
  testdata::judge(row, h.fx, {static_cast<const double*>(o.data()), lse_data, o.size()}, h.path,
                  keep_worst, grads);
  return row;
}

}  // namespace

}  // namespace flashref::python

NB_MODULE(_core, m) {
  using namespace flashref;
  using namespace flashref::python;
  m.doc() = "flashref's C++ core (use the flashref package, not this module)";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const type_error& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const problem_error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def("attention_into", &attention_into, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"),
        nb::arg("lse").none(), nb::arg("scale").none(), nb::arg("causal"), nb::arg("window_left"),
        nb::arg("window_right"), nb::arg("block_mask").none(), nb::arg("block_q"),
        nb::arg("block_k"), nb::arg("kv_len").none(), nb::arg("backend"), nb::arg("blhd"),
        nb::arg("stream"));
  m.def("attention_backward_into", &attention_backward_into, nb::arg("q"), nb::arg("k"),
        nb::arg("v"), nb::arg("o"), nb::arg("lse").none(), nb::arg("do"), nb::arg("dq"),
        nb::arg("dk"), nb::arg("dv"), nb::arg("scale").none(), nb::arg("causal"),
        nb::arg("window_left"), nb::arg("window_right"), nb::arg("block_mask").none(),
        nb::arg("block_q"), nb::arg("block_k"), nb::arg("kv_len").none(), nb::arg("backend"),
        nb::arg("blhd"), nb::arg("deterministic"), nb::arg("stream"));
  m.def("attention", &attention_alloc, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("scale").none(), nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"),
        nb::arg("block_mask").none(), nb::arg("block_q"), nb::arg("block_k"),
        nb::arg("kv_len").none(), nb::arg("backend"), nb::arg("blhd"), nb::arg("return_lse"),
        nb::arg("stream"));
  m.def("attention_backward", &attention_backward_alloc, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("o"), nb::arg("lse").none(), nb::arg("do"), nb::arg("scale").none(),
        nb::arg("causal"), nb::arg("window_left"), nb::arg("window_right"),
        nb::arg("block_mask").none(), nb::arg("block_q"), nb::arg("block_k"),
        nb::arg("kv_len").none(), nb::arg("backend"), nb::arg("blhd"), nb::arg("deterministic"),
        nb::arg("stream"));
  m.def("entry_seconds", &entry_seconds, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"),
        nb::arg("lse").none(), nb::arg("scale").none(), nb::arg("causal"), nb::arg("window_left"),
        nb::arg("window_right"), nb::arg("block_mask").none(), nb::arg("block_q"),
        nb::arg("block_k"), nb::arg("kv_len").none(), nb::arg("backend"), nb::arg("blhd"),
        nb::arg("repeats"));
  m.def("merge_into", &merge_into, nb::arg("o_a"), nb::arg("lse_a"), nb::arg("o_b"),
        nb::arg("lse_b"), nb::arg("o"), nb::arg("lse"));

  m.def("backends", [] {
    std::vector<nb::dict> out;
    for (const backend_info& b : backends()) {
      nb::dict d;
      d["name"] = to_string(b.id);
      d["built"] = b.built;
      d["available"] = b.available;
      d["reason"] = b.reason;
      std::vector<std::string> dtypes;
      for (input_dtype t : b.dtypes)
        dtypes.push_back(to_string(t));
      d["dtypes"] = dtypes;
      out.push_back(d);
    }
    return out;
  });
  // How the binding sees an array it is handed, imported as flashref.attention imports its
  // arguments (for tests of the zero-copy import).
  m.def("describe", [](nb::handle x) {
    const array a = import_array("array", x, torch_objects());
    nb::dict d;
    d["data"] = reinterpret_cast<std::uintptr_t>(a.data());
    std::vector<std::int64_t> shape, strides;
    for (std::size_t i = 0; i < a.ndim(); ++i) {
      shape.push_back(std::int64_t(a.shape(i)));
      strides.push_back(a.stride(i));
    }
    d["shape"] = shape;
    d["strides"] = strides;
    d["dtype"] = dtype_name(a.dtype());
    d["device"] = device_name(a);
    return d;
  });
  m.def("resolve", [](const std::string& name) { return to_string(resolve(parse_backend(name))); });

  nb::class_<fixture_handle>(m, "FixtureHandle")
      .def_prop_ro("path", [](const fixture_handle& h) { return h.path.string(); })
      .def_prop_ro("name", [](const fixture_handle& h) { return h.fx.name; })
      .def_prop_ro("description", [](const fixture_handle& h) { return h.fx.description; })
      .def_prop_ro("generator", [](const fixture_handle& h) { return h.fx.generator; })
      .def_prop_ro("seed", [](const fixture_handle& h) { return h.fx.seed; })
      .def_prop_ro("twin_of", [](const fixture_handle& h) { return h.fx.twin_of; })
      .def_prop_ro("scale",
                   [](const fixture_handle& h) { return h.fx.in.inputs().softmax_scale(); })
      .def_prop_ro("causal", [](const fixture_handle& h) { return to_string(h.fx.in.opt.causal); })
      .def_prop_ro("window_left", [](const fixture_handle& h) { return h.fx.in.opt.window_left; })
      .def_prop_ro("window_right", [](const fixture_handle& h) { return h.fx.in.opt.window_right; })
      .def_prop_ro("block_q", [](const fixture_handle& h) { return h.fx.in.opt.block_q; })
      .def_prop_ro("block_k", [](const fixture_handle& h) { return h.fx.in.opt.block_k; })
      .def_prop_ro("input_dtype",
                   [](const fixture_handle& h) { return to_string(h.fx.in.opt.dtype); })
      .def_prop_ro("atol", [](const fixture_handle& h) { return h.fx.tol.atol; })
      .def_prop_ro("rtol", [](const fixture_handle& h) { return h.fx.tol.rtol; })
      .def_prop_ro("atol_lse", [](const fixture_handle& h) { return h.fx.tol.atol_lse; })
      .def("arrays", [](nb::handle self) {
        const fixture_handle& h = nb::cast<const fixture_handle&>(self);
        nb::dict d;
        d["q"] = numpy_view(h.fx.in.q, self);
        d["k"] = numpy_view(h.fx.in.k, self);
        d["v"] = numpy_view(h.fx.in.v, self);
        if (h.fx.in.opt.block_mask.size() > 0 && h.fx.in.opt.block_q > 0)
          d["block_mask"] = numpy_view(h.fx.in.opt.block_mask, self);
        if (!h.fx.in.opt.kv_len.empty()) d["kv_len"] = numpy_view(h.fx.in.opt.kv_len, self);
        const std::vector<std::size_t> o_shape = golden_o_shape(h.fx.golden);
        d["o"] = numpy_view(h.fx.golden.o.data(), o_shape, self);
        d["lse"] = numpy_view(h.fx.golden.lse.data(), {o_shape[0], o_shape[1], o_shape[2]}, self);
        if (h.fx.in.d_o.size() > 0) d["do"] = numpy_view(h.fx.in.d_o, self);
        if (h.fx.grads) {
          const reference::golden_gradients& g = *h.fx.grads;
          const auto dims = [](const std::array<std::int64_t, 4>& x) {
            return std::vector<std::size_t>{std::size_t(x[0]), std::size_t(x[1]), std::size_t(x[2]),
                                            std::size_t(x[3])};
          };
          d["dq"] = numpy_view(g.dq.data(), dims(g.q_shape), self);
          d["dk"] = numpy_view(g.dk.data(), dims(g.k_shape), self);
          d["dv"] = numpy_view(g.dv.data(), dims(g.v_shape), self);
        }
        if (h.fx.trace) {
          d["trace_m"] = numpy_view(h.fx.trace->m, self);
          d["trace_s"] = numpy_view(h.fx.trace->s, self);
          d["trace_exp_old"] = numpy_view(h.fx.trace->exp_old, self);
        }
        return d;
      });
  m.def("read_fixture", &read_fixture, nb::arg("path"), nb::call_guard<nb::gil_scoped_release>());

  nb::class_<testdata::check_row>(m, "CheckRow")
      .def_ro("fixture", &testdata::check_row::fixture)
      .def_ro("judged", &testdata::check_row::judged)
      .def_ro("fixture_dtype", &testdata::check_row::fixture_dtype)
      .def_ro("o_dtype", &testdata::check_row::o_dtype)
      .def_ro("lse_dtype", &testdata::check_row::lse_dtype)
      .def_ro("message", &testdata::check_row::message)
      .def_ro("hints", &testdata::check_row::hints)
      .def_prop_ro("verdict", [](const testdata::check_row& r) { return to_string(r.v); })
      .def_prop_ro("atol", [](const testdata::check_row& r) { return r.tol.atol; })
      .def_prop_ro("rtol", [](const testdata::check_row& r) { return r.tol.rtol; })
      .def_prop_ro("atol_lse", [](const testdata::check_row& r) { return r.tol.atol_lse; })
      .def_prop_ro("counts",
                   [](const testdata::check_row& r) {
                     const conformance_report& c = r.rep;
                     nb::dict d;
                     d["rows"] = c.rows;
                     d["empty_rows"] = c.empty_rows;
                     d["empty_rows_bad"] = c.empty_rows_bad;
                     d["nan_rows"] = c.nan_rows;
                     d["inf_rows"] = c.inf_rows;
                     d["wrong_rows"] = c.wrong_rows;
                     d["bad_elements"] = c.bad_elements;
                     d["o_err_ratio"] = c.o_err_ratio;
                     d["lse_err_ratio"] = c.lse_judged ? nb::cast(c.lse_err_ratio) : nb::none();
                     d["max_abs_err"] = c.max_abs_err;
                     d["max_rel_err"] = c.max_rel_err;
                     d["max_lse_err"] = c.lse_judged ? nb::cast(c.max_lse_err) : nb::none();
                     d["lse_judged"] = c.lse_judged;
                     return d;
                   })
      .def_prop_ro("gradients_judged",
                   [](const testdata::check_row& r) { return r.grads.judged(); })
      .def("table", [](const testdata::check_row& r) {
        const std::vector<testdata::check_row> rows{r};
        return testdata::check_table(rows) + testdata::tolerance_lines(rows);
      });
  m.def("check", &check, nb::arg("fixture"), nb::arg("o"), nb::arg("lse").none(),
        nb::arg("dq").none(), nb::arg("dk").none(), nb::arg("dv").none(), nb::arg("o_dtype"),
        nb::arg("lse_dtype"), nb::arg("judged"), nb::arg("keep_worst"));
}
