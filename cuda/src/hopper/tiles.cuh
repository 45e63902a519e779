#pragma once
// Tile sizes, the shared-memory layout and the barriers of the Hopper kernel, and the wgmma
// descriptors that address its tiles.
//
// One block: kC consumer warpgroups of 64 query rows each (two, 128 rows; three, 192 rows, at
// D = 64: block_shape below) against key tiles of 64 to 176 keys (tile_keys below). Q (kTileQ, D)
// is loaded once; K and V (kTileK, D) stream through kStages stages. Every tile is stored as D / 64
// boxes of (rows, 64) in the 128-byte swizzle layout (sm90.cuh), one TMA box each.

#include <cstddef>
#include <cstdint>

#include "../common.cuh"  // kFullWarp
#include "sm90.cuh"

namespace flashref::cuda::detail::sm90 {

inline constexpr int kRowsPerConsumer = 64;  // query rows per consumer warpgroup
inline constexpr int kConsumers = 2;         // consumer warpgroups of the backward's blocks
inline constexpr int kThreads = 128 * (1 + kConsumers);
inline constexpr int kBoxCols = 64;      // 16-bit elements per 128-byte swizzled row
inline constexpr int kAtomBytes = 1024;  // 8 rows of 128 bytes
// Registers per thread after setmaxnreg: the producer warpgroup gives, the consumers take from
// what it gave. A block of three warpgroups starts with 65536 / 384 = 168 per thread, so the
// budget balances when (168 - kProducerRegs) * 128 >= (kConsumerRegs - 168) * 256; otherwise
// setmaxnreg.inc waits forever.
inline constexpr int kLaunchRegs = 168;

// The forward's block of kC consumer warpgroups against key tiles of kK keys: its query rows,
// threads and registers. Two consumers (128 rows) at D = 128 and 256, and at D = 64 under a
// block mask; three (192 rows) at D = 64 without one, where the softmax's instruction stream,
// not the tensor cores, sets the pace and a third warp per scheduler hides more of it
// (cuda/NOTES.md, h8; hopper.cu's hopper_consumers says when). With four warpgroups the block
// starts at 128 registers per thread: the producer keeps 56, enough for a walk over a range of
// key tiles (range_walker) but not for tile_walker, and each consumer gets 152. Key tiles of
// more than 128 keys (D = 128, long rows, no band and no block mask: tile_keys) hold S (kK / 2
// floats per thread) beside the last tile's P and O: their consumers take 240 (at 216 and 232
// ptxas spilled 236 and 144 bytes), the producer walking a range in the 24 left.
template <int kC, int kK = 128>
struct block_shape {
  static_assert(kC == 2 || kC == 3, "two or three consumer warpgroups");
  static constexpr int kConsumers = kC;
  static constexpr int kTileQ = kRowsPerConsumer * kC;
  static constexpr int kThreads = 128 * (1 + kC);
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;  // 168 or 128
  static constexpr bool kWide = kK > 128;
  // Consumers of 240 registers beside a producer of 24: the wide tiles, and D = 256's 80-key
  // tiles (no block mask; their only head dim), whose overlapped loop holds O (128 registers),
  // S (40) and the last tile's P (20). Their Q descriptors are formed in each call
  // (consumer.cuh's qk_product) and their rows' end afresh for the epilogue.
  static constexpr bool kLarge = kWide || kK == 80;
  // Consumers short of registers for their loop: those above, and the three-consumer block's
  // (D = 64 in the overlapped loop: O 32, S 64 and the last tile's P 32 of their 160). Their Q
  // descriptors are formed in each call and their rows' end afresh for the epilogue too.
  static constexpr bool kTight = kLarge || kC == 3;
  // Takes a block mask: its producer walks with tile_walker (the other producers walk a range
  // instead; the host sends block masks to the two-consumer block of 64- or 128-key tiles).
  static constexpr bool kBlockMask = kC == 2 && !kLarge;
  // Producer / consumer registers: 32 / 160 in the three-consumer block (at 56 / 152 ptxas
  // serialised its overlapped loop's wgmma, C7512; at 32 the producer counts no Q loads,
  // barriers::kQByState; cuda/NOTES.md h34), 24 / 240 where kLarge, else 72 / 216.
  static constexpr int kProducerRegs = kC == 3 ? 32 : kLarge ? 24 : 72;
  static constexpr int kConsumerRegs = kC == 3 ? 160 : kLarge ? 240 : 216;
  static_assert((kLaunchRegs - kProducerRegs) * 128 >= (kConsumerRegs - kLaunchRegs) * 128 * kC,
                "the consumers take no more registers than the producer gives");
};

// Keys per tile for head dim d. At D = 128, 176 where the rows are long (kWideMinKeys keys or
// more; kWideCausalMinKeys under a causal mask, whose rows average half as many) and no window
// or block mask bands them (as FlashAttention-3 takes without a mask: a longer tile spreads each
// tile's fixed costs, the waits, the row maxima's shuffles and the rescale's vote, over more
// keys; dense L = 16384 +8 to +12 %, L = 8192 +7 %, L = 4096 +3.5 %; causal L = 16384 +5 %,
// L = 8192 +6 %, L = 4096 -1.6 %); 128 for `narrow` rows: shorter ones (dense L = 1024 7 %
// slower, 6 tiles per row with the last one partial against 8 whole ones; L = 2048 3 %
// slower), under a window (a 176-key tile straddles both of its edges, so more of its keys are
// computed only to be masked), and under a block mask (a 176-key tile straddles the 128-key
// mask blocks). At D = 256, where O alone takes 128 registers per thread, 80 (S: 40 registers;
// the most keys that two stages leave room for beside Q), or 64 under a block mask: a tile of 80
// keys straddles the usual 128-key mask blocks, which turned most tiles partial and cost
// 2.6-4 x (cuda/NOTES.md, h12), where 64-key tiles stay inside one block. At D = 64, 128.
inline constexpr std::int64_t kWideMinKeys = 4096;
inline constexpr std::int64_t kWideCausalMinKeys = 8192;
constexpr int tile_keys(int d, bool block_mask, bool narrow) {
  if (d == 256) return block_mask ? 64 : 80;
  if (d == 128) return block_mask || narrow ? 128 : 176;
  return 128;
}

// The key side of a block: K and V tiles of kK keys and their stages, the same for any number
// of consumers.
template <int kD, int kK>
struct key_tiles {
  static_assert(kD % kBoxCols == 0, "whole 64-column boxes");
  static_assert(kK % 16 == 0 && kK <= 256, "whole k16 steps of P V, one TMA box of rows");
  static constexpr int kBoxes = kD / kBoxCols;
  // The consumers overlap one tile's P V with the next tile's softmax at D = 128 and at D = 256
  // without a block mask (80-key tiles; consumer.cuh), holding tile j's K and tile j - 1's V at
  // once; K and V are released apart (barriers), so that 2 stages still let the producer load
  // a tile ahead: 2 stages (225 KiB with two Q buffers and the staged O at D = 128, 128 keys;
  // 209 KiB with one Q at 176; 225 KiB with Q at D = 256, 80 keys). D = 64 has 3 stages,
  // released whole (its three-consumer block overlaps too: tiles::kOverlapped); D = 256 under a
  // block mask (64-key tiles) runs in sequence with 2.
  static constexpr int kTileK = kK;  // keys per tile
  static constexpr bool kOverlap = kD == 128 || (kD == 256 && kK == 80);
  static constexpr int kStages = kD == 64 ? 3 : 2;
  // K and V of a stage released apart (barriers) where the overlap runs in 2 stages; elsewhere
  // a stage is released whole, which the third stage makes room for (and which takes fewer
  // registers: the split, measured at 128 keys, spilled the D = 64 and 256 consumers).
  static constexpr bool kSplitRelease = kOverlap && kStages == 2;
  static constexpr int kKVBoxBytes = kTileK * 128;       // (kTileK, 64)
  static constexpr int kKVBytes = kBoxes * kKVBoxBytes;  // one of K or V, one stage
};

// The whole block: Q of kC consumers beside the key side, in two buffers where they fit beside
// the stages (the two-consumer blocks at D = 64 and at D = 128 with 128-key tiles; the
// three-consumer block's consumers have no registers for it): the producer then loads the next work
// item's Q while the consumers still read this one's, instead of after their last S = Q K^T,
// and the next item's first K and V tiles no longer queue behind that wait.
template <int kD, int kC, int kK>
struct tiles : key_tiles<kD, kK> {
  using keys = key_tiles<kD, kK>;
  static constexpr int kTileQ = block_shape<kC, kK>::kTileQ;
  static constexpr int kQBoxBytes = kTileQ * 128;  // (kTileQ, 64) 16-bit elements
  static constexpr int kQBytes = keys::kBoxes * kQBoxBytes;
  static constexpr int kQStages = kC == 2 && kK <= 128 && kD <= 128 ? 2 : 1;
  // sm_90's 227 KiB per block, less a little for the barriers' static shared memory.
  static constexpr int kMaxSmemBytes = 227 * 1024 - 512;
  // Q, K and V, with room to align the base to an atom.
  static constexpr int kInputBytes =
      kQStages * kQBytes + 2 * keys::kStages * keys::kKVBytes + kAtomBytes;
  // O of the block in 16 bits, staged for its TMA store (epilogue.cuh's store_rows_staged) where
  // it fits beside them in a two-consumer block: D = 64, and D = 128 with 128-key tiles (the
  // three-consumer block's consumers spilled with it). Each consumer's 64 rows are
  // kBoxes boxes of (64, 64) in the 128-byte swizzle layout, as Q's.
  static constexpr int kOBoxBytes = kRowsPerConsumer * 128;
  static constexpr int kOBytes = kC * keys::kBoxes * kOBoxBytes;
  static constexpr bool kStageO = kC == 2 && kInputBytes + kOBytes <= kMaxSmemBytes;
  // Each item's last tile marked (stage_info's kTileLast) instead of a stage closing the item:
  // in the overlapped loop of 128-key tiles, and in the serial loop of D = 64's two-consumer
  // block (block masks, causal rows over at most 1024 queries). The 240-register consumers
  // (block_shape::kLarge) have no register to keep the flag across a tile (ptxas spilled 144
  // bytes with 176-key tiles, 76 with D = 256's 80-key tiles); in the serial loop of
  // D = 64's three-consumer block and of D = 256 (then still in sequence at 80 keys) the flag
  // spilled too (8 to 28 bytes, however it was kept; the three-consumer block measured 2-6 % slower
  // with it, cuda/NOTES.md h28).
  static constexpr bool kMarksLast =
      !block_shape<kC, kK>::kLarge && (keys::kOverlap || (kD == 64 && kC == 2));
  // The consumers' loop (consumer.cuh): overlapped where key_tiles says, and in D = 64's
  // three-consumer block (no block mask: dense, causal from 1025 queries, windows), measured
  // 4.5-9 % faster there (cuda/NOTES.md h34); in sequence in D = 64's two-consumer block, where
  // the overlap measured 0-4 % slower (h27), and at D = 256 under a block mask.
  static constexpr bool kOverlapped = keys::kOverlap || (kD == 64 && kC == 3);
  // Dynamic shared memory.
  static constexpr int kSmemBytes = kInputBytes + (kStageO ? kOBytes : 0);
  static_assert(kSmemBytes <= kMaxSmemBytes, "the tiles fit one block's shared memory");
};

// A (rows, kD) tile at row `row` of head h, batch b of a (D, L, H, B) tensor map: its kD / 64
// boxes (kBoxBytes each) by TMA, the bytes counted on `bar`.
template <int kD, int kBoxBytes>
__device__ __forceinline__ void tma_load_tile(unsigned char* dst, const CUtensorMap* map, int row,
                                              int h, int b, std::uint64_t* bar) {
  for (int c = 0; c < kD / kBoxCols; ++c)
    tma_load_4d(dst + c * kBoxBytes, map, c * kBoxCols, row, h, b, bar);
}

// What the producer tells the consumers about the key tile in a stage. Where the block marks
// its items' last tiles (tiles::kMarksLast), an item's last tile says so (kTileLast) and
// no stage is spent on closing an item that has tiles: the next item's first K and V load into
// the stage after it, and a consumer learns that its item ends without waiting for a stage that
// the other consumers must free first. Elsewhere each item's tiles are followed by a stage with
// tile = kNoMoreTiles. An item with no visible key has that stage alone, and the block's last
// item is followed by a stage with work = kNoMoreWork.
struct alignas(16) stage_info {
  int tile;   // key tile index, or kNoMoreTiles
  int flags;  // kTileFull, kTileLast
  int work;   // the work item (scheduler.cuh) the tile belongs to, or kNoMoreWork
  int unused;
};
// stage_info::flags: every (row, key) pair of the tile is visible (no element mask); the item's
// last tile.
inline constexpr int kTileFull = 1;
inline constexpr int kTileLast = 2;
inline constexpr int kNoMoreTiles = -1;
inline constexpr int kNoMoreWork = -1;

// Stage s's descriptor as a consumer warp reads it: lane 0 loads it and hands it to the other
// lanes. The load and the warp's later arrival on empty[s] (made by lane 0) are then in one
// thread, ordered by program order and the barrier's release; the producer rewrites the slot
// only after that barrier completes. The load is inline PTX so that the compiler cannot
// execute it on every lane and keep lane 0's value (a plain load it hoisted out of the branch:
// harmless, but a read racecheck reports against the producer's next write). Every descriptor
// (this one, the backward's bwd_stage_info) is three ints and a fourth of padding, `unused`.
template <class Info>
__device__ __forceinline__ Info read_stage_slot(const Info& slot) {
  static_assert(sizeof(Info) == 16 && alignof(Info) == 16 && offsetof(Info, unused) == 12,
                "three ints and padding, one 16-byte load");
  int w[4] = {0, 0, 0, 0};
  if ((threadIdx.x & 31) == 0) {
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "r"(smem_addr(&slot))
                 : "memory");
  }
  Info info{};
  int* fields = reinterpret_cast<int*>(&info);
#pragma unroll
  for (int f = 0; f < 3; ++f)
    fields[f] = __shfl_sync(kFullWarp, w[f], 0);
  return info;
}

// The block's shared memory: tiles in the dynamic part (atom-aligned), barriers beside.
template <int kD, int kC, int kK>
struct shared_tiles {
  using t = tiles<kD, kC, kK>;
  unsigned char* q;  // (kQStages, kTileQ, kD), each as kBoxes boxes
  unsigned char* k;  // (kStages, kTileK, kD)
  unsigned char* v;  // (kStages, kTileK, kD), then with t::kStageO O's (kC, kBoxes, 64, 64)

  __device__ explicit shared_tiles(unsigned char* raw) {
    const std::uint32_t base = smem_addr(raw);
    unsigned char* aligned = raw + ((kAtomBytes - base % kAtomBytes) % kAtomBytes);
    q = aligned;
    k = q + t::kQStages * t::kQBytes;
    v = k + t::kStages * t::kKVBytes;
  }
  // Consumer warpgroup wg's O staging, its kBoxes boxes one after another.
  __device__ unsigned char* o_rows(int wg) const {
    return v + t::kStages * t::kKVBytes + wg * t::kBoxes * t::kOBoxBytes;
  }
  __device__ unsigned char* q_stage(int slot) const { return q + slot * t::kQBytes; }
  __device__ unsigned char* k_stage(int s) const { return k + s * t::kKVBytes; }
  __device__ unsigned char* v_stage(int s) const { return v + s * t::kKVBytes; }

  // Q rows of consumer warpgroup `wg` in Q buffer `slot`, k-step `ks` (16 columns of the head
  // dim).
  __device__ std::uint64_t q_desc(int slot, int wg, int ks) const {
    return sw128_advance(q_desc0(slot, wg), q_step(ks));
  }
  // q_desc(slot, wg, 0): k-step ks is sw128_advance(q_desc0, q_step(ks)), an add.
  __device__ std::uint64_t q_desc0(int slot, int wg) const {
    return sw128_desc(smem_addr(q_stage(slot)) + wg * kRowsPerConsumer * 128, 16, kAtomBytes);
  }
  // Q's k-step ks from k-step 0, in bytes.
  __device__ static constexpr std::uint32_t q_step(int ks) {
    return sw128_k_step<t::kQBoxBytes>(ks);
  }
  // All t::kTileK keys of stage s, k-step ks over the head dim.
  __device__ std::uint64_t k_desc(int s, int ks) const {
    return sw128_advance(sw128_desc(smem_addr(k_stage(s)), 16, kAtomBytes),
                         sw128_k_step<t::kKVBoxBytes>(ks));
  }
  // Keys [16 kk, 16 kk + 16) of stage s, every column of the head dim (MN-major).
  __device__ std::uint64_t v_desc(int s, int kk) const {
    return sw128_advance(sw128_desc(smem_addr(v_stage(s)), t::kKVBoxBytes, kAtomBytes),
                         kk * 16 * 128);
  }
};

template <int kStages, int kC, bool kSplit, int kQ>
struct barriers {
  static constexpr bool kSplitRelease = kSplit;
  static constexpr int kQStages = kQ;
  // The three-consumer producer's 32 registers have no room for a count of its Q loads (ptxas
  // kept it in local memory): there q_empty expects the producer's arrival too, which returns
  // the phase to wait for (producer.cuh), and phase 0 starts with the consumers' arrivals made
  // for them (no Q read yet).
  static constexpr bool kQByState = kC == 3 && kQ == 1;
  std::uint64_t q_full[kQ];
  std::uint64_t q_empty[kQ];  // one arrival per consumer warp: Q of the buffer's item is read
  std::uint64_t k_full[kStages];
  std::uint64_t v_full[kStages];
  // One arrival per consumer warp: with kSplit, K of the stage is read (after S = Q K^T) on
  // k_empty and V (after P V) on v_empty, so that the next tile's K loads while this tile's
  // P V runs; without, the whole stage on k_empty.
  std::uint64_t k_empty[kStages];
  std::uint64_t v_empty[kSplit ? kStages : 1];
  stage_info info[kStages];
  // Per consumer warp: 1 once a value it stored in O (or an out_scale) was NaN or inf.
  std::uint32_t nonfinite[4 * kC];

  __device__ void init() {
    for (int w = 0; w < 4 * kC; ++w)
      nonfinite[w] = 0;
    for (int b = 0; b < kQ; ++b) {
      mbar_init(&q_full[b], 1);
      if constexpr (kQByState) {
        mbar_init(&q_empty[b], 4 * kC + 1);
        mbar_arrive_count(&q_empty[b], 4 * kC);
      } else {
        mbar_init(&q_empty[b], 4 * kC);
      }
    }
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&k_full[s], 1);
      mbar_init(&v_full[s], 1);
      mbar_init(&k_empty[s], 4 * kC);
      if (kSplit) mbar_init(&v_empty[s], 4 * kC);
    }
    mbar_init_fence();
  }
};

// The barriers of the block for (kD, kC, kK).
template <int kD, int kC, int kK>
using block_barriers = barriers<tiles<kD, kC, kK>::kStages, kC, tiles<kD, kC, kK>::kSplitRelease,
                                tiles<kD, kC, kK>::kQStages>;

}  // namespace flashref::cuda::detail::sm90
