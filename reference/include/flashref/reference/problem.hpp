#pragma once
// The attention problem of SPEC §2: tensors as pointer + shape + strides (in elements), the
// masks, and validation. Both [B, H, L, D] and [B, L, H, D] storage are described by strides,
// so neither layout needs a copy.

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "flashref/reference/mask.hpp"  // causal_mode

namespace flashref {

// The one exception type for malformed problems, files and options. Its message names the
// field, the expected and the actual value: "block_mask: expected shape [1, 4, 16, 16], got ...".
class problem_error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A strided view of R dimensions. Index arithmetic is in elements.
template <class T, int R>
struct strided {
  T* data = nullptr;
  std::array<std::int64_t, R> shape{};
  std::array<std::int64_t, R> stride{};

  std::int64_t size() const {
    std::int64_t n = 1;
    for (auto s : shape)
      n *= s;
    return n;
  }
  template <class... I>
  T& operator()(I... idx) const {
    static_assert(sizeof...(I) == R, "one index per dimension");
    const std::array<std::int64_t, R> at{static_cast<std::int64_t>(idx)...};
    std::int64_t off = 0;
    for (int d = 0; d < R; ++d)
      off += at[d] * stride[d];
    return data[off];
  }
};

template <class T, int R>
std::array<std::int64_t, R> row_major_strides(const std::array<std::int64_t, R>& shape) {
  std::array<std::int64_t, R> st{};
  std::int64_t acc = 1;
  for (int d = R - 1; d >= 0; --d) {
    st[d] = acc;
    acc *= shape[d];
  }
  return st;
}

// A contiguous row-major view.
template <class T, int R>
strided<T, R> contiguous(T* data, std::array<std::int64_t, R> shape) {
  return {data, shape, row_major_strides<T, R>(shape)};
}

// A view over [B, L, H, D] storage (FlashAttention's layout) presented as [B, H, L, D].
template <class T>
strided<T, 4> from_blhd(T* data, std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t D) {
  return {data, {B, H, L, D}, {L * H * D, D, H * D, 1}};
}

// The dtype the inputs are meant to have. Host problems always carry float32 storage; a value
// other than float32 says that every input value is exactly representable in that dtype and
// lets a backend use its low-precision path (the CUDA tensor-core kernels).
enum class input_dtype { float32, bfloat16, float16 };

const char* to_string(causal_mode c);
const char* to_string(input_dtype t);
causal_mode parse_causal(const std::string& s);  // "none" | "bottom_right" | "top_left"
input_dtype parse_input_dtype(const std::string& s);

struct attention_problem {
  strided<const float, 4> q;  // (B, Hq, Lq, D)
  strided<const float, 4> k;  // (B, Hk, Lk, D)
  strided<const float, 4> v;  // (B, Hk, Lk, Dv)
  strided<float, 4> o;        // (B, Hq, Lq, Dv)   output
  strided<float, 3> lse;      // (B, Hq, Lq)       output, natural log; data may be null

  std::optional<double> scale;  // default 1/sqrt(D)
  causal_mode causal = causal_mode::none;
  std::int64_t window_left = -1;   // -1: unbounded on the left
  std::int64_t window_right = -1;  // -1: unbounded on the right

  // Block mask [Bm, Hm, ceil(Lq/block_q), ceil(Lk/block_k)], Bm ∈ {1, B}, Hm ∈ {1, Hq};
  // absent when block_mask.data is null. Non-zero means visible.
  strided<const std::uint8_t, 4> block_mask;
  std::int64_t block_q = 0;
  std::int64_t block_k = 0;

  const std::int32_t* kv_len = nullptr;  // (B) optional: keys j >= kv_len[b] are invisible

  input_dtype dtype = input_dtype::float32;

  std::int64_t batch() const { return q.shape[0]; }
  std::int64_t heads_q() const { return q.shape[1]; }
  std::int64_t heads_k() const { return k.shape[1]; }
  std::int64_t len_q() const { return q.shape[2]; }
  std::int64_t len_k() const { return k.shape[2]; }
  std::int64_t head_dim() const { return q.shape[3]; }
  std::int64_t head_dim_v() const { return v.shape[3]; }
  // Query heads per key/value head (GQA/MQA): query head h reads key/value head h / group.
  std::int64_t group_size() const { return heads_k() > 0 ? heads_q() / heads_k() : 1; }
  bool has_block_mask() const { return block_mask.data != nullptr; }
  double softmax_scale() const {
    return scale ? *scale : (head_dim() > 0 ? 1.0 / std::sqrt(double(head_dim())) : 1.0);
  }
};

// Throws problem_error naming the first offending field. A problem with zero-sized dimensions
// is valid (an empty result, or rows with no visible key).
void validate(const attention_problem& p);
// The same, less the output views: for readers of the inputs such as the naive reference.
void validate_inputs(const attention_problem& p);

// Multiply-adds counted per SPEC §8: 2 * (D + Dv) per visible (query, key) pair.
double dense_flops(const attention_problem& p);

}  // namespace flashref
