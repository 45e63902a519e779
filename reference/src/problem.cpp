#include "flashref/reference/problem.hpp"

#include <cmath>
#include <limits>
#include <sstream>
#include <string>

#include "flashref/reference/mask.hpp"

namespace flashref {

namespace {

constexpr std::uint64_t kMaxIndex = std::uint64_t(std::numeric_limits<std::int64_t>::max());

// "[2, 4, 128, 64]"; a negative entry is printed as '*' (a free dimension).
template <std::size_t R>
std::string shape_str(const std::array<std::int64_t, R>& s) {
  std::ostringstream os;
  os << '[';
  for (std::size_t d = 0; d < R; ++d) {
    if (d) os << ", ";
    if (s[d] < 0) {
      os << '*';
    } else {
      os << s[d];
    }
  }
  os << ']';
  return os.str();
}

// "[4096, 0, -64, 1]": every entry as it is (strides may be zero or negative).
template <std::size_t R>
std::string numbers_str(const std::array<std::int64_t, R>& s) {
  std::string out = "[";
  for (std::size_t d = 0; d < R; ++d)
    out += (d ? ", " : "") + std::to_string(s[d]);
  return out + "]";
}

[[noreturn]] void fail(const std::string& field, const std::string& expected,
                       const std::string& got) {
  throw problem_error(field + ": expected " + expected + ", got " + got);
}

template <class T, int R>
void check_view(const char* name, const strided<T, R>& v) {
  for (auto n : v.shape)
    if (n < 0) fail(name, "non-negative dimensions", shape_str(v.shape));
  // Sizes and offsets are int64 everywhere: the element count and the furthest element's
  // offset must fit one (a corrupt descriptor must not overflow the index arithmetic).
  std::uint64_t count = 1;
  for (auto n : v.shape) {
    if (__builtin_mul_overflow(count, std::uint64_t(n), &count) || count > kMaxIndex)
      fail(name, "at most 2^63 - 1 elements", shape_str(v.shape) + " (the count overflows)");
  }
  if (count == 0) return;
  std::uint64_t reach = 0;
  for (int d = 0; d < R; ++d) {
    const std::uint64_t step =
        v.stride[d] < 0 ? 0 - std::uint64_t(v.stride[d]) : std::uint64_t(v.stride[d]);
    std::uint64_t span = 0;
    if (v.stride[d] == std::numeric_limits<std::int64_t>::min() ||
        __builtin_mul_overflow(std::uint64_t(v.shape[d] - 1), step, &span) ||
        __builtin_add_overflow(reach, span, &reach) || reach > kMaxIndex) {
      fail(name, "element offsets below 2^63",
           "shape " + shape_str(v.shape) + " with strides " + numbers_str(v.stride));
    }
  }
  if (v.data == nullptr)
    fail(name, "a data pointer for " + std::to_string(count) + " elements", "null");
}

// Compare against an expected shape in which -1 means "any".
template <class T, int R>
void check_shape(const char* name, const strided<T, R>& v, std::array<std::int64_t, R> expected) {
  for (int d = 0; d < R; ++d) {
    if (expected[d] >= 0 && v.shape[d] != expected[d]) {
      fail(name, "shape " + shape_str(expected), shape_str(v.shape));
    }
  }
}

// ceil(a / b) for a >= 0, b > 0, without forming a + b - 1 (b may be as large as 2^63 - 1).
std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return a == 0 ? 0 : (a - 1) / b + 1;
}

}  // namespace

const char* to_string(causal_mode c) {
  switch (c) {
    case causal_mode::none:
      return "none";
    case causal_mode::bottom_right:
      return "bottom_right";
    case causal_mode::top_left:
      return "top_left";
  }
  return "?";
}

const char* to_string(input_dtype t) {
  switch (t) {
    case input_dtype::float32:
      return "float32";
    case input_dtype::bfloat16:
      return "bfloat16";
    case input_dtype::float16:
      return "float16";
  }
  return "?";
}

causal_mode parse_causal(const std::string& s) {
  if (s == "none") return causal_mode::none;
  if (s == "bottom_right") return causal_mode::bottom_right;
  if (s == "top_left") return causal_mode::top_left;
  fail("causal", "one of none, bottom_right, top_left", "'" + s + "'");
}

input_dtype parse_input_dtype(const std::string& s) {
  if (s == "float32") return input_dtype::float32;
  if (s == "bfloat16") return input_dtype::bfloat16;
  if (s == "float16") return input_dtype::float16;
  fail("input_dtype", "one of float32, bfloat16, float16", "'" + s + "'");
}

void validate(const attention_problem& p) {
  validate_inputs(p);
  check_view("o", p.o);
  check_shape("o", p.o, {p.batch(), p.heads_q(), p.len_q(), p.head_dim_v()});
  if (p.lse.data != nullptr) {
    check_view("lse", p.lse);
    check_shape("lse", p.lse, {p.batch(), p.heads_q(), p.len_q()});
  }
}

void validate_inputs(const attention_problem& p) {
  check_view("q", p.q);
  check_view("k", p.k);
  check_view("v", p.v);
  const std::int64_t B = p.batch(), Hq = p.heads_q(), Lq = p.len_q(), D = p.head_dim();
  // K shares batch and head dim with Q; V shares batch, heads and length with K.
  check_shape("k", p.k, {B, -1, -1, D});
  const std::int64_t Hk = p.heads_k(), Lk = p.len_k();
  check_shape("v", p.v, {B, Hk, Lk, -1});
  // GQA/MQA: query head h reads key/value head h / (Hq / Hk).
  if (Hq > 0 && (Hk == 0 || Hq % Hk != 0)) {
    fail("k", "a head count dividing Hq = " + std::to_string(Hq), "Hk = " + std::to_string(Hk));
  }
  if (p.scale && !std::isfinite(*p.scale))
    fail("scale", "a finite number", std::to_string(*p.scale));
  if (p.window_left < -1) fail("window_left", ">= -1 (-1 = off)", std::to_string(p.window_left));
  if (p.window_right < -1) fail("window_right", ">= -1 (-1 = off)", std::to_string(p.window_right));

  if (p.has_block_mask()) {
    // Mask block sizes are part of the problem: any positive size is valid.
    if (p.block_q <= 0) fail("block_q", "a positive block size", std::to_string(p.block_q));
    if (p.block_k <= 0) fail("block_k", "a positive block size", std::to_string(p.block_k));
    check_view("block_mask", p.block_mask);
    const auto& s = p.block_mask.shape;
    // Batch and head dimensions broadcast from 1.
    const std::array<std::int64_t, 4> expected{s[0] == 1 ? 1 : B, s[1] == 1 ? 1 : Hq,
                                               ceil_div(Lq, p.block_q), ceil_div(Lk, p.block_k)};
    if (s != expected) fail("block_mask", "shape " + shape_str(expected), shape_str(s));
  } else if (p.block_q != 0 || p.block_k != 0) {
    fail("block_mask", "a mask when block_q/block_k are set",
         "none (block_q = " + std::to_string(p.block_q) +
             ", block_k = " + std::to_string(p.block_k) + ")");
  }
  if (p.kv_len != nullptr) {
    for (std::int64_t b = 0; b < B; ++b) {
      if (p.kv_len[b] < 0 || p.kv_len[b] > Lk) {
        fail("kv_len[" + std::to_string(b) + "]", "a value in [0, " + std::to_string(Lk) + "]",
             std::to_string(p.kv_len[b]));
      }
    }
  }
}

double dense_flops(const attention_problem& p) {
  return 2.0 * double(p.batch()) * double(p.heads_q()) * double(p.len_q()) * double(p.len_k()) *
         double(p.head_dim() + p.head_dim_v());
}

mask_spec make_mask_spec(const attention_problem& p) {
  mask_spec m;
  m.len_q = p.len_q();
  m.len_k = p.len_k();
  m.causal = p.causal;
  m.window_left = p.window_left;
  m.window_right = p.window_right;
  m.kv_len = p.kv_len;
  if (p.has_block_mask()) {
    const auto& bm = p.block_mask;
    m.block_mask = bm.data;
    m.bm_stride_b = bm.shape[0] == 1 ? 0 : bm.stride[0];
    m.bm_stride_h = bm.shape[1] == 1 ? 0 : bm.stride[1];
    m.bm_stride_qb = bm.stride[2];
    m.bm_stride_kb = bm.stride[3];
    m.block_q = p.block_q;
    m.block_k = p.block_k;
  }
  return m;
}

}  // namespace flashref
