// The Hopper forward kernel (sm_90a; bf16 / fp16 inputs, fp32 accumulation), in the design of
// FlashAttention-3 (Shah et al. 2024): warp specialisation with TMA loads and wgmma.
//
// A block of three or four warpgroups computes 128 or 192 query rows of one (batch, head) at a
// time, one work item after another (persistent: one block per SM; scheduler.cuh):
//   warpgroup 0  producer (producer.cuh): one warp walks the visible key tiles and loads Q once
//                per item and K, V per tile with TMA into a ring of stages (mbarrier full /
//                empty) that runs on across items, so the next item's loads overlap the
//                current one's last products and epilogue;
//   warpgroups 1 .. kC  consumers (consumer.cuh), 64 rows each: S = Q K^T, mask, online
//                softmax, O += P V with P in registers, then the epilogue (epilogue.cuh).
//                Two consumers, or three at D = 64 (tiles.cuh's block_shape says when).
// setmaxnreg moves registers from the producer to the consumers. With `nonfinite_flags` each
// consumer warp also reports whether a value it stored was NaN or inf (epilogue.cuh): where the
// mask hides keys, the device entry's gate for a SIMT rerun that keeps a NaN or inf of V out of
// the rows that do not see its key (attention.cpp; cuda/NOTES.md). Tiles and barriers:
// tiles.cuh; the order of query tiles: scheduler.cuh; PTX wrappers: sm90.cuh, wgmma.cuh.
//
// The instructions are sm_90a only: other targets compile an empty kernel that the dispatcher
// never launches (it picks this kernel on compute capability 9.0 alone).

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "hopper/consumer.cuh"
#include "hopper/producer.cuh"
#include "hopper/scheduler.cuh"
#include "hopper/tensor_map.hpp"
#include "hopper/tiles.cuh"
#include "launch.hpp"

namespace flashref::cuda::detail {
namespace {

struct hopper_params {
  sm90::tensor_maps maps;
  // O's map for the TMA stores of the epilogue (kernels whose block stages O: tiles.cuh's
  // kStageO), where O is 16-bit with whole 16-byte rows; else not made, and o_tma false.
  CUtensorMap o_map;
  bool o_tma;
  kernel_params p;
  std::uint32_t* work_counter;  // zero at launch (scheduler.cuh), or null: a fixed stride
  int work_group;               // work_group_heads(p): the order of the work items
  // Null, or hopper_flag_count words: each consumer warp's "a value of O was NaN or inf"
  // (consumer.cuh), for the SIMT kernel's gate in place of a scan of V.
  std::uint32_t* nonfinite_flags;
};

template <class T, int kD, int kC, int kK>
__global__ void __launch_bounds__(sm90::block_shape<kC, kK>::kThreads, 1)
    hopper_kernel(const __grid_constant__ hopper_params hp) {
#if FLASHREF_SM90A
  using namespace sm90;
  using shape = block_shape<kC, kK>;
  extern __shared__ __align__(1024) unsigned char s_raw[];
  __shared__ block_barriers<kD, kC, kK> bar;
  const shared_tiles<kD, kC, kK> smem(s_raw);
  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  if (threadIdx.x == 0) {
    bar.init();
    tma_prefetch_map(&hp.maps.q);
    tma_prefetch_map(&hp.maps.k);
    tma_prefetch_map(&hp.maps.v);
    if (hp.o_tma) tma_prefetch_map(&hp.o_map);
  }
  __syncthreads();
  if (warpgroup == 0) {
    setmaxnreg_dec<shape::kProducerRegs>();
    if (threadIdx.x < 32) produce<T, kD, kC, kK>(hp, s_raw, bar);
  } else {
    setmaxnreg_inc<shape::kConsumerRegs>();
    consume<T, kD, kC, kK>(hp, warpgroup - 1, smem, bar);
  }
#else
  (void)hp;
  __trap();
#endif
}

// Persistent: one block per SM (the shared memory allows no second), or fewer for a small
// problem.
std::int64_t persistent_blocks(std::int64_t items, int sm_count) {
  return items < sm_count ? items : sm_count;
}

template <class T, int kD, int kC, int kK>
cudaError_t launch(const kernel_params& p, elem input, std::uint32_t* work_counter,
                   std::uint32_t* nonfinite_flags, int sm_count, cudaStream_t stream) {
  using t = sm90::tiles<kD, kC, kK>;
  hopper_params hp{};
  hp.p = p;
  hp.work_counter = work_counter;
  // Items whose work grows with the query tile (a causal mask or a window) go in work_place_of's
  // groups, heaviest first across each; the others keep one head's query tiles together (in a
  // fixed stride on neighbouring blocks, where groups measured 1-4 % slower; cuda/NOTES.md, h21).
  const bool graded =
      p.mask.causal != causal_mode::none || p.mask.window_left >= 0 || p.mask.window_right >= 0;
  hp.work_group = work_counter != nullptr && graded ? static_cast<int>(work_group_heads(p)) : 1;
  hp.nonfinite_flags = nonfinite_flags;
  cudaError_t e = sm90::make_map(&hp.maps.q, p.q, input, p.batch, p.heads_q, p.len_q, kD,
                                 p.q_stride, t::kTileQ);
  if (e == cudaSuccess) {
    e = sm90::make_map(&hp.maps.k, p.k, input, p.batch, p.heads_k, p.len_k, kD, p.k_stride,
                       t::kTileK);
  }
  if (e == cudaSuccess) {
    e = sm90::make_map(&hp.maps.v, p.v, input, p.batch, p.heads_k, p.len_k, kD, p.v_stride,
                       t::kTileK);
  }
  if (e != cudaSuccess) return e;
  hp.o_tma = false;
  if constexpr (t::kStageO) {
    // O in the input's 16-bit type, columns contiguous, base and strides whole 16 bytes (what a
    // TMA box needs; a map the driver refuses leaves the stores to the registers).
    if (p.out == input && row_store_of(p.o, p.o_stride, p.out) == row_store::packed16) {
      hp.o_tma = sm90::make_map(&hp.o_map, p.o, input, p.batch, p.heads_q, p.len_q, kD, p.o_stride,
                                sm90::kRowsPerConsumer) == cudaSuccess;
    }
  }
  constexpr int kSmem = t::kSmemBytes;
  e = cudaFuncSetAttribute(hopper_kernel<T, kD, kC, kK>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (e != cudaSuccess) return e;
  if (work_counter != nullptr) {
    e = cudaMemsetAsync(work_counter, 0, sizeof(std::uint32_t), stream);
    if (e != cudaSuccess) return e;
  }
  // Work items are numbered in 32 bits: 2^31 of them would need Q of at least 2^45 bytes.
  const std::int64_t items = sm90::work_items<t::kTileQ>(p);
  if (items > std::int64_t(INT32_MAX)) return cudaErrorInvalidValue;
  const std::int64_t blocks = persistent_blocks(items, sm_count);
  hopper_kernel<T, kD, kC, kK>
      <<<static_cast<unsigned>(blocks), sm90::block_shape<kC, kK>::kThreads, kSmem, stream>>>(hp);
  return cudaGetLastError();
}

// Consumer warpgroups of the block for p: 3 (192 query rows) at D = 64 where the three-consumer
// block takes the mask (block_shape::kBlockMask: its producer walks no block mask), unless
// causal over at most 1024 queries; else 2 (128 rows).
int hopper_consumers(const kernel_params& p) {
  if (p.head_dim != 64) return 2;
  if (p.mask.block_mask != nullptr && !sm90::block_shape<3>::kBlockMask) return 2;
  // A causal mask over at most 1024 queries: the diagonal's masked work grows with the taller
  // tile more than the third warpgroup gains (measured 8-9 % slower at Lq = 512 and 1024, 4 %
  // faster at 2048; cuda/NOTES.md, h8).
  if (p.mask.causal != causal_mode::none && p.len_q <= 1024) return 2;
  return 3;
}

}  // namespace

std::int64_t hopper_tile_rows(const kernel_params& p) {
  return sm90::kRowsPerConsumer * hopper_consumers(p);
}

std::int64_t hopper_flag_count(const kernel_params& p, int sm_count) {
  const int consumers = hopper_consumers(p);
  const std::int64_t items = consumers == 3 ? sm90::work_items<sm90::block_shape<3>::kTileQ>(p)
                                            : sm90::work_items<sm90::block_shape<2>::kTileQ>(p);
  return persistent_blocks(items, sm_count) * 4 * consumers;
}

cudaError_t launch_hopper(const kernel_params& p, elem input, std::uint32_t* work_counter,
                          std::uint32_t* nonfinite_flags, int sm_count, cudaStream_t stream) {
  // The instantiation for (kD, kC), its keys per tile (tiles.cuh's tile_keys, which depends
  // on whether a block mask is there and on whether the rows are narrow: banded by a window,
  // short, or causal and not long) and its element type.
  const bool block_mask = p.mask.block_mask != nullptr;
  const bool narrow = p.mask.window_left >= 0 || p.mask.window_right >= 0 ||
                      p.len_k < sm90::kWideMinKeys ||
                      (p.mask.causal != causal_mode::none && p.len_k < sm90::kWideCausalMinKeys);
  const auto typed = [&](auto d, auto c) {
    constexpr int kD = decltype(d)::value, kC = decltype(c)::value;
    const auto keyed = [&](auto k) {
      constexpr int kK = decltype(k)::value;
      return input == elem::f16 ? launch<__half, kD, kC, kK>(p, input, work_counter,
                                                             nonfinite_flags, sm_count, stream)
                                : launch<__nv_bfloat16, kD, kC, kK>(
                                      p, input, work_counter, nonfinite_flags, sm_count, stream);
    };
    if (block_mask) return keyed(std::integral_constant<int, sm90::tile_keys(kD, true, false)>{});
    if (narrow) return keyed(std::integral_constant<int, sm90::tile_keys(kD, false, true)>{});
    return keyed(std::integral_constant<int, sm90::tile_keys(kD, false, false)>{});
  };
  using two = std::integral_constant<int, 2>;
  if (p.head_dim == 64) {
    using d64 = std::integral_constant<int, 64>;
    return hopper_consumers(p) == 3 ? typed(d64{}, std::integral_constant<int, 3>{})
                                    : typed(d64{}, two{});
  }
  if (p.head_dim == 256) return typed(std::integral_constant<int, 256>{}, two{});
  return typed(std::integral_constant<int, 128>{}, two{});
}

}  // namespace flashref::cuda::detail
