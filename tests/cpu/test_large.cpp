// 64-bit offsets on every CPU path. K and V of more than 2^32 elements (16 GiB each) cost next
// to nothing here: they live in an anonymous mapping whose untouched pages all read as the
// kernel's shared zero page, and only the few pages holding the keys that matter are written.
// A 32-bit offset anywhere — a row index times a stride, a tile's base, a split-KV chunk —
// would read a zero key where the test put a non-zero one, or fault, instead of giving the
// closed-form answer. Plus decoding (Lq = 1) over L = 1,048,576 real keys against the naive
// reference.
#include <sys/mman.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "../common/check.hpp"
#include "flashref/cpu/attention.hpp"
#include "flashref/reference/conformance.hpp"

namespace {

// An anonymous read-write mapping of `floats` zeros that only grows when written.
class zero_mapping {
 public:
  explicit zero_mapping(std::size_t floats) : bytes_(floats * sizeof(float)) {
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    REQUIRE(p != MAP_FAILED);
    data_ = static_cast<float*>(p);
  }
  ~zero_mapping() { ::munmap(data_, bytes_); }
  zero_mapping(const zero_mapping&) = delete;
  zero_mapping& operator=(const zero_mapping&) = delete;
  float* data() const { return data_; }

 private:
  std::size_t bytes_;
  float* data_ = nullptr;
};

constexpr std::int64_t kD = 128;
constexpr std::int64_t kTail = 256;                            // the non-zero keys, at the end
constexpr std::int64_t kLk = (std::int64_t(1) << 25) + kTail;  // K: 2^32 + 32768 elements
constexpr std::int64_t kBlockK = std::int64_t(1) << 16;

float key_value(std::int64_t j) {  // K[j, 0] of a tail key: its score against q = (a, 0, ...)
  return 0.5f * float(j % 7) - 1.0f;
}
float value_value(std::int64_t j, std::int64_t d) {
  return float((j * 31 + d * 17) % 13) / 8.0f - 0.75f;
}

}  // namespace

TEST_CASE("cpu: K and V of more than 2^32 elements are indexed with 64-bit offsets",
          "[cpu][large]") {
  const std::int64_t Lq = GENERATE(1, 8);  // the row kernel (decode) and the tile kernel
  const bool window = GENERATE(false, true);
  CAPTURE(Lq, window);
  const zero_mapping k(std::size_t(kLk * kD)), v(std::size_t(kLk * kD));
  for (std::int64_t j = kLk - kTail; j < kLk; ++j) {
    k.data()[j * kD] = key_value(j);
    for (std::int64_t d = 0; d < kD; ++d)
      v.data()[j * kD + d] = value_value(j, d);
  }
  std::vector<float> q(std::size_t(Lq * kD), 0.0f), o(std::size_t(Lq * kD), NAN),
      lse(std::size_t(Lq), NAN);
  for (std::int64_t i = 0; i < Lq; ++i)
    q[std::size_t(i * kD)] = 1.0f + 0.25f * float(i);

  flashref::attention_problem p;
  p.q = flashref::contiguous<const float, 4>(q.data(), {1, 1, Lq, kD});
  p.k = flashref::contiguous<const float, 4>(k.data(), {1, 1, kLk, kD});
  p.v = flashref::contiguous<const float, 4>(v.data(), {1, 1, kLk, kD});
  p.o = flashref::contiguous<float, 4>(o.data(), {1, 1, Lq, kD});
  p.lse = flashref::contiguous<float, 3>(lse.data(), {1, 1, Lq});
  REQUIRE(p.k.size() > (std::int64_t(1) << 32));
  // Visible: either the first and the last block of 2^16 keys (a block mask), or each row's
  // last kTail keys and no more (a window, bottom-right aligned). Everything between is never
  // loaded, so the test reads a few MB of the 32 GiB mapped.
  const std::int64_t nkb = (kLk + kBlockK - 1) / kBlockK;
  std::vector<std::uint8_t> mask(std::size_t(nkb), 0);
  std::int64_t zeros_seen = 0;  // visible keys with score 0 and value 0
  if (window) {
    p.window_left = kTail - Lq;  // row i sees keys [Lk - Lq + i - left, Lk - Lq + i]
    p.window_right = 0;
  } else {
    mask.front() = mask.back() = 1;
    p.block_mask = flashref::contiguous<const std::uint8_t, 4>(mask.data(), {1, 1, 1, nkb});
    p.block_q = 64;
    p.block_k = kBlockK;
    zeros_seen = kBlockK;
  }
  flashref::cpu::attention(p);

  // Closed form in float64: the tail keys j score scale * q0 * K[j, 0]; the zero keys score 0
  // and add exp(0) = 1 each to the sum and nothing to O.
  const double scale = 1.0 / std::sqrt(double(kD));
  flashref::reference::golden g;
  g.o_shape = {1, 1, Lq, kD};
  double max_v = 0;
  for (std::int64_t i = 0; i < Lq; ++i) {
    const double q0 = 1.0 + 0.25 * double(i);
    const std::int64_t first = window ? kLk - Lq + i - p.window_left : kLk - kTail;
    const std::int64_t last = window ? kLk - Lq + i : kLk - 1;
    double sum = double(zeros_seen);
    std::vector<double> acc(std::size_t(kD), 0.0);
    for (std::int64_t j = first; j <= last; ++j) {
      const double w = std::exp(scale * q0 * double(key_value(j)));
      sum += w;
      for (std::int64_t d = 0; d < kD; ++d) {
        acc[std::size_t(d)] += w * double(value_value(j, d));
        max_v = std::max(max_v, std::abs(double(value_value(j, d))));
      }
    }
    for (std::int64_t d = 0; d < kD; ++d)
      g.o.push_back(acc[std::size_t(d)] / sum);
    g.lse.push_back(std::log(sum));
  }
  const flashref::conformance_report rep = flashref::compare(
      g, o.data(), lse.data(), flashref::default_tolerance(flashref::input_dtype::float32, max_v));
  FLASHREF_REQUIRE_CONFORMS(rep);
  CHECK(rep.lse_judged);
}

TEST_CASE("cpu: decoding over L = 1,048,576 keys equals the naive reference", "[cpu][large]") {
  flashref::test::problem_shape s;
  s.B = 1, s.Hq = 2, s.Hk = 1, s.Lq = 1, s.Lk = std::int64_t(1) << 20, s.D = 64, s.Dv = 64;
  flashref::problem_data d = flashref::test::random_problem(s, 20);
  const flashref::cpu::plan pl = flashref::cpu::make_plan(d.problem(), {});
  CHECK(pl.kv_splits > 1);  // the split-KV path, with its merge
  flashref::cpu::attention(d.problem());
  FLASHREF_REQUIRE_CONFORMS(flashref::test::check_against_naive(d));
}
