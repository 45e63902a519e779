// The device entry's pointer checks (before any launch: a kernel that faults on an illegal
// address poisons the CUDA context for the whole process) and the stream-ordered scratch of the
// scan of V.

#include "guards.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "flashref/cuda/attention.hpp"
#include "flashref/cuda/backward.hpp"
#include "flashref/reference/problem.hpp"

namespace flashref::cuda {

namespace {

// The driver functions the range check needs, found through the runtime (no link to libcuda);
// null where the driver lacks them.
struct driver_api {
  PFN_cuMemGetAddressRange_v3020 address_range = nullptr;
  PFN_cuMemRetainAllocationHandle_v11000 retain_handle = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
};

template <class F>
F driver_function(const char* name, unsigned version) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &ptr, version, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();  // leave no error behind for the next launch check
    return nullptr;
  }
  return reinterpret_cast<F>(ptr);
}

const driver_api& driver() {
  static const driver_api api{
      driver_function<PFN_cuMemGetAddressRange_v3020>("cuMemGetAddressRange", 3020),
      driver_function<PFN_cuMemRetainAllocationHandle_v11000>("cuMemRetainAllocationHandle", 11000),
      driver_function<PFN_cuMemRelease_v10020>("cuMemRelease", 10020)};
  return api;
}

// Bytes [lo, hi) around a view's pointer that the view reaches (lo <= 0 with negative strides);
// none for an empty view, which is never read. validate() has bounded the element offsets.
struct byte_extent {
  std::int64_t lo = 0, hi = 0;
};

template <std::size_t R>
std::optional<byte_extent> extent_of(const std::array<std::int64_t, R>& shape,
                                     const std::array<std::int64_t, R>& stride,
                                     std::int64_t elem_bytes) {
  std::int64_t lo = 0, hi = 0;
  for (std::size_t d = 0; d < R; ++d) {
    if (shape[d] == 0) return std::nullopt;
    const std::int64_t span = (shape[d] - 1) * stride[d];
    (span < 0 ? lo : hi) += span;
  }
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const auto bytes = [&](std::int64_t elems) {  // saturating: no allocation is that large
    return elems > kMax / elem_bytes - 1 ? kMax : elems * elem_bytes;
  };
  return byte_extent{lo < 0 ? -bytes(-lo) : 0, bytes(hi + 1)};
}

// The allocation holding `addr` as the driver knows it, [base, base + size).
bool allocation_of(CUdeviceptr addr, CUdeviceptr& base, std::size_t& size) {
  const driver_api& api = driver();
  if (api.address_range == nullptr || api.address_range(&base, &size, addr) != CUDA_SUCCESS) {
    return false;
  }
  return true;
}

// Is `addr` in memory mapped through the virtual memory management API (cuMemCreate /
// cuMemMap), where the driver reports each mapped chunk as its own range?
bool mapped_chunk(CUdeviceptr addr) {
  const driver_api& api = driver();
  if (api.retain_handle == nullptr || api.release == nullptr) return false;
  CUmemGenericAllocationHandle handle{};
  if (api.retain_handle(&handle, reinterpret_cast<void*>(addr)) != CUDA_SUCCESS) return false;
  api.release(handle);
  return true;
}

// The view's bytes lie inside the allocation of its pointer, where the driver knows it (device
// and managed memory; a pointer it reports no range for is let through). Chunks of one
// reservation mapped side by side count as one allocation (as a caching allocator with
// expandable segments maps them).
void check_inside_allocation(const char* name, const void* data, const byte_extent& e) {
  const auto p = reinterpret_cast<CUdeviceptr>(data);
  CUdeviceptr base = 0;
  std::size_t size = 0;
  if (!allocation_of(p, base, size)) return;
  CUdeviceptr first = base, end = base + size;
  const std::uint64_t before = std::uint64_t(0) - std::uint64_t(e.lo);  // e.lo <= 0
  const std::uint64_t after = std::uint64_t(e.hi);
  const auto next_chunk = [](CUdeviceptr at, CUdeviceptr& b, std::size_t& s) {
    return mapped_chunk(at) && allocation_of(at, b, s) && mapped_chunk(b);
  };
  while (p - first < before && first > 0 && mapped_chunk(first)) {
    CUdeviceptr b = 0;
    std::size_t s = 0;
    if (!next_chunk(first - 1, b, s) || b + s != first) break;
    first = b;
  }
  while (end - p < after && mapped_chunk(end - 1)) {
    CUdeviceptr b = 0;
    std::size_t s = 0;
    if (!next_chunk(end, b, s) || b != end) break;
    end = b + s;
  }
  if (p - first < before) {
    throw problem_error(std::string(name) + ": expected the view's bytes from " +
                        std::to_string(e.lo) + " to " + std::to_string(e.hi) +
                        " around the pointer inside its device allocation, got an allocation " +
                        "that starts " + std::to_string(p - first) + " bytes before it");
  }
  if (end - p < after) {
    throw problem_error(std::string(name) + ": expected the view's " + std::to_string(e.hi) +
                        " bytes from the pointer inside its device allocation, got an " +
                        "allocation that ends " + std::to_string(end - p) + " bytes past it");
  }
}

// One pointer: memory the current device can read at that address, and large enough for the
// view where the driver can tell. A view with no element is never read and not checked.
void check_pointer(const char* name, const void* data, const std::optional<byte_extent>& e,
                   int device) {
  if (!e) return;
  if (data == nullptr) {
    throw problem_error(std::string(name) +
                        ": expected a pointer to device memory, got a null pointer");
  }
  cudaPointerAttributes a{};
  const cudaError_t err = cudaPointerGetAttributes(&a, data);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw problem_error(std::string(name) +
                        ": expected a pointer to device memory, got one CUDA does not know (" +
                        cudaGetErrorName(err) + ")");
  }
  switch (a.type) {
    case cudaMemoryTypeDevice:
      if (a.device != device) {
        throw problem_error(std::string(name) + ": expected memory of the current device " +
                            std::to_string(device) + ", got memory of device " +
                            std::to_string(a.device));
      }
      break;
    case cudaMemoryTypeManaged:
      break;
    case cudaMemoryTypeHost:  // page-locked host memory: readable where mapped at this address
      if (a.devicePointer != data) {
        throw problem_error(std::string(name) +
                            ": expected a pointer to device memory, got a page-locked host "
                            "pointer the device does not map at that address");
      }
      break;
    case cudaMemoryTypeUnregistered:
      throw problem_error(std::string(name) +
                          ": expected a pointer to device memory, got a host pointer");
  }
  check_inside_allocation(name, data, *e);
}

std::int64_t elem_bytes(input_dtype t) {
  return t == input_dtype::float32 ? 4 : 2;
}

template <int R>
void check_tensor(const char* name, const device_tensor<R>& t, int device) {
  check_pointer(name, t.data, extent_of<R>(t.shape, t.stride, elem_bytes(t.dtype)), device);
}

int current_device() {
  int device = 0;
  const cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw problem_error(std::string("device: expected a usable CUDA device, got ") +
                        cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
  return device;
}

void check_forward_memory(const device_problem& p, int device) {
  check_tensor("q", p.q, device);
  check_tensor("k", p.k, device);
  check_tensor("v", p.v, device);
  check_tensor("o", p.o, device);
  if (p.lse.data != nullptr) check_tensor("lse", p.lse, device);
  if (p.block_mask.data != nullptr) {
    check_pointer("block_mask", p.block_mask.data,
                  extent_of<4>(p.block_mask.shape, p.block_mask.stride, 1), device);
  }
  if (p.kv_len != nullptr) {
    const std::int64_t B = p.q.shape[0];
    check_pointer("kv_len", p.kv_len,
                  B > 0 ? std::optional<byte_extent>(byte_extent{0, B * 4}) : std::nullopt, device);
  }
}

}  // namespace

void check_device_memory(const device_problem& p) {
  check_forward_memory(p, current_device());
}

void check_device_memory(const device_backward_problem& p) {
  const int device = current_device();
  check_forward_memory(p.forward, device);
  check_tensor("d_o", p.d_o, device);
  check_tensor("d_q", p.d_q, device);
  check_tensor("d_k", p.d_k, device);
  check_tensor("d_v", p.d_v, device);
  if (p.workspace != nullptr && p.workspace_bytes > 0) {
    check_pointer("workspace", p.workspace, byte_extent{0, std::int64_t(p.workspace_bytes)},
                  device);
  }
}

namespace detail {

namespace {

// flashref's pool on `device`, made on first use; null where the device has no stream-ordered
// allocator. When the streams synchronize it keeps everything it has mapped (the forward's flags
// are a few KiB, the backward's workspace about B·Hq·Lq·(D + 3) words), as a caching allocator
// does: the next call of the same size maps nothing. An allocation that fails anywhere on the
// device makes the driver take back what pools hold unused (tests/cuda/test_faults.cpp).
cudaMemPool_t scratch_pool(int device) {
  constexpr std::uint64_t kRetainBytes = ~std::uint64_t(0);
  static std::mutex mutex;
  static std::map<int, cudaMemPool_t> pools;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = pools.find(device);
  if (found != pools.end()) return found->second;
  int supported = 0;
  cudaMemPool_t pool = nullptr;
  if (cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device) == cudaSuccess &&
      supported != 0) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    std::uint64_t retain = kRetainBytes;
    if (cudaMemPoolCreate(&pool, &props) != cudaSuccess ||
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &retain) != cudaSuccess) {
      pool = nullptr;
    }
  }
  (void)cudaGetLastError();
  pools[device] = pool;
  return pool;
}

}  // namespace

// The pool of the current device, or null.
cudaMemPool_t current_pool() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return scratch_pool(device);
}

bool stream_scratch::available() {
  return current_pool() != nullptr;
}

stream_scratch::stream_scratch(const char* field, std::size_t bytes, cudaStream_t stream)
    : stream_(stream) {
  const cudaMemPool_t pool = current_pool();
  const cudaError_t e =
      pool == nullptr ? cudaErrorNotSupported : cudaMallocFromPoolAsync(&ptr_, bytes, pool, stream);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    ptr_ = nullptr;
    throw problem_error(std::string(field) + ": expected " + std::to_string(bytes) +
                        " bytes of stream-ordered device memory, got " + cudaGetErrorName(e) +
                        " (" + cudaGetErrorString(e) + ")");
  }
}

stream_scratch::~stream_scratch() {
  if (ptr_ != nullptr) cudaFreeAsync(ptr_, stream_);
}

int sm_count() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 1;
  }
  return sms;
}

}  // namespace detail

}  // namespace flashref::cuda
