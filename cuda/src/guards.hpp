#pragma once
// What the device entry does before and around its launches so that a caller's mistake
// becomes a problem_error and never a fault on the device: the pointer checks, and the small
// stream-ordered scratch of the scan of V (cuda/NOTES.md).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace flashref::cuda::detail {

// Device memory from flashref's own stream-ordered pool on `stream`'s device: allocated when
// constructed, freed (stream-ordered, after the work enqueued meanwhile) when destroyed. The
// pool keeps what it has mapped across synchronizations, so a call does not map memory again.
// Throws problem_error naming `field` when the memory cannot be had.
class stream_scratch {
 public:
  stream_scratch(const char* field, std::size_t bytes, cudaStream_t stream);
  ~stream_scratch();
  stream_scratch(const stream_scratch&) = delete;
  stream_scratch& operator=(const stream_scratch&) = delete;
  void* get() const { return ptr_; }
  // Does the current device have a stream-ordered allocator for it?
  static bool available();

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

// The number of SMs of the current device.
int sm_count();

}  // namespace flashref::cuda::detail
