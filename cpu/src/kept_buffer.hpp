#pragma once
// Scratch of tens or hundreds of MB kept from one call to the next: a fresh allocation has the
// operating system zero each of its pages on first touch, which measured 14 % of a bf16
// block-sparse forward (the packed K and Vᵀ; D = 128, L = 4096, 16 heads, density 0.05, AMX,
// 2 threads) and 8-10 % of a float32 block-sparse backward (the partial dQs, one thread,
// density 0.05). One buffer is kept for the whole process, whichever path used it last: the
// largest one handed back that is no larger than kMaxKeptBytes, so that no more than that is
// held between calls. A call that finds it taken (by another thread) or too small allocates its
// own. Its contents never matter: each user writes every element it reads.

#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>

#include "kernel.hpp"

namespace flashref::cpu::detail {

class kept_buffer {
 public:
  static constexpr std::size_t kMaxKeptBytes = std::size_t(512) << 20;
  struct buffer {
    std::unique_ptr<unsigned char, free_deleter> data;
    std::size_t bytes = 0;
  };

  static kept_buffer& instance() {
    static kept_buffer kept;
    return kept;
  }
  // A buffer of at least `bytes` bytes, 2 MiB-aligned (large_buffer).
  buffer take(std::size_t bytes) {
    {
      const std::lock_guard<std::mutex> lock(m_);
      if (kept_.data != nullptr && kept_.bytes >= bytes) return std::move(kept_);
    }
    buffer b;
    b.data.reset(large_buffer<unsigned char>(bytes));
    b.bytes = bytes;
    return b;
  }
  void give_back(buffer b) {
    if (b.data == nullptr || b.bytes > kMaxKeptBytes) return;
    const std::lock_guard<std::mutex> lock(m_);
    if (kept_.data == nullptr || b.bytes >= kept_.bytes) kept_ = std::move(b);
  }

 private:
  std::mutex m_;
  buffer kept_;
};

// The kept buffer (or a fresh one) for one call, handed back when the call ends, by return or
// by exception.
class kept_lease {
 public:
  kept_lease() = default;
  explicit kept_lease(std::size_t bytes) : b_(kept_buffer::instance().take(bytes)) {}
  kept_lease(const kept_lease&) = delete;
  kept_lease& operator=(const kept_lease&) = delete;
  kept_lease& operator=(kept_lease&& other) noexcept {
    std::swap(b_, other.b_);
    return *this;
  }
  ~kept_lease() { kept_buffer::instance().give_back(std::move(b_)); }
  // The buffer as an array of T (large_buffer's 2 MiB alignment suits any T).
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(b_.data.get());
  }

 private:
  kept_buffer::buffer b_;
};

}  // namespace flashref::cpu::detail
