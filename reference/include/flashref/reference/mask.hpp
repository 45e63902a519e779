#pragma once
// The visibility rule of SPEC §2 in one place, as a plain struct usable by host and device
// code, plus tile classification for the tiled paths: a tile (rows [q0, q1) x keys [k0, k1))
// is `empty` (skip it: no load, no exponent), `full` (no element mask needed) or `partial`
// (apply the element mask). Classification is conservative: `partial` is always safe.

#include <cstdint>

#include "flashref/reference/config.hpp"

namespace flashref {

struct attention_problem;

// Causal alignment (SPEC §2): none; bottom-right, key j <= i + (Lk - Lq); top-left, j <= i.
enum class causal_mode { none, bottom_right, top_left };

enum class tile_class : int { empty = 0, partial = 1, full = 2 };

// Key interval [lo, hi) allowed to one query row by causal, window and kv_len.
struct key_range {
  std::int64_t lo;
  std::int64_t hi;
};

struct mask_spec {
  std::int64_t len_q = 0;
  std::int64_t len_k = 0;
  causal_mode causal = causal_mode::none;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  const std::int32_t* kv_len = nullptr;  // (B) or null
  // Block mask (B, Hq, nqb, nkb) seen through strides; a broadcast dimension has stride 0.
  const std::uint8_t* block_mask = nullptr;
  std::int64_t bm_stride_b = 0, bm_stride_h = 0, bm_stride_qb = 0, bm_stride_kb = 0;
  std::int64_t block_q = 0, block_k = 0;

  // The keys of batch b that exist for its rows: [0, key_end(b)), min(Lk, kv_len[b]). Keys at
  // or past it are never loaded.
  FLASHREF_INLINE std::int64_t key_end(std::int64_t b) const {
    std::int64_t end = len_k;
    if (kv_len != nullptr && kv_len[b] < end) end = kv_len[b];
    return end;
  }

  // Causal, window and kv_len constrain a row to one interval; both ends are non-decreasing
  // in the row index, which is what makes tile classification cheap.
  FLASHREF_INLINE key_range row_range(std::int64_t b, std::int64_t i) const {
    const std::int64_t diag = i + (len_k - len_q);  // the bottom-right aligned diagonal
    std::int64_t lo = 0;
    std::int64_t hi = key_end(b);
    if (causal == causal_mode::bottom_right && diag + 1 < hi) hi = diag + 1;
    if (causal == causal_mode::top_left && i + 1 < hi) hi = i + 1;
    // Windows may be as wide as 2^63 - 1: compared as distances from the diagonal, so that
    // diag + window is formed only when it lies inside [lo, hi].
    if (window_right >= 0 && window_right < hi - diag - 1) hi = diag + window_right + 1;
    if (window_left >= 0 && window_left < diag - lo) lo = diag - window_left;
    return {lo, hi};
  }

  // The transpose of row_range: the query rows [lo, hi) that see key j by causal, window and
  // kv_len (empty, hi <= lo, for a key at or past len_k or kv_len[b]). The rows that see a key
  // form one interval because both ends of a row's interval are non-decreasing in the row. For
  // the dK, dV passes, which hold keys and walk query rows. Windows may be as wide as
  // 2^63 - 1: a bound is formed only where it lies inside [0, len_q].
  FLASHREF_INLINE key_range query_range(std::int64_t b, std::int64_t j) const {
    if (j < 0 || j >= len_k || (kv_len != nullptr && j >= kv_len[b])) return {0, 0};
    const std::int64_t t = j - (len_k - len_q);  // the row whose diagonal is key j
    std::int64_t lo = 0;
    std::int64_t hi = len_q;
    if (causal == causal_mode::bottom_right && t > lo) lo = t;  // j <= i + (Lk - Lq)
    if (causal == causal_mode::top_left && j > lo) lo = j;      // j <= i
    // j <= diag + window_right, i.e. i >= t - window_right.
    if (window_right >= 0 && window_right < t - lo) lo = t - window_right;
    // j >= diag - window_left, i.e. i <= t + window_left.
    if (window_left >= 0 && window_left < hi - 1 - t) hi = t + window_left + 1;
    return {lo, hi};
  }

  FLASHREF_INLINE bool block_visible(std::int64_t b, std::int64_t h, std::int64_t qb,
                                     std::int64_t kb) const {
    return block_mask[b * bm_stride_b + h * bm_stride_h + qb * bm_stride_qb + kb * bm_stride_kb] !=
           0;
  }

  // Is key j visible to query i of (batch b, query head h)?
  FLASHREF_INLINE bool visible(std::int64_t b, std::int64_t h, std::int64_t i,
                               std::int64_t j) const {
    const key_range r = row_range(b, i);
    if (j < r.lo || j >= r.hi) return false;
    return block_mask == nullptr || block_visible(b, h, i / block_q, j / block_k);
  }

  // Classify rows [q0, q1) x keys [k0, k1) (both non-empty).
  FLASHREF_INLINE tile_class classify(std::int64_t b, std::int64_t h, std::int64_t q0,
                                      std::int64_t q1, std::int64_t k0, std::int64_t k1) const {
    const key_range first = row_range(b, q0);
    const key_range last = row_range(b, q1 - 1);
    // Every row's interval ends before k0, or starts at or after k1.
    if (last.hi <= k0 || first.lo >= k1) return tile_class::empty;
    bool range_full = last.lo <= k0 && first.hi >= k1;
    if (block_mask == nullptr) return range_full ? tile_class::full : tile_class::partial;
    bool any = false, all = true;
    for (std::int64_t qb = q0 / block_q; qb <= (q1 - 1) / block_q; ++qb) {
      for (std::int64_t kb = k0 / block_k; kb <= (k1 - 1) / block_k; ++kb) {
        const bool on = block_visible(b, h, qb, kb);
        any = any || on;
        all = all && on;
      }
    }
    if (!any) return tile_class::empty;
    return (range_full && all) ? tile_class::full : tile_class::partial;
  }

  // classify() with the tile's block-mask rows qb = [q0 / block_q, (q1 - 1) / block_q] and
  // columns kb = [k0 / block_k, (k1 - 1) / block_k] (closed intervals; not read without a block
  // mask) formed by the caller: a GPU walker forms them without 64-bit division. (classify()
  // keeps its own body: the kernels that call it compile to the same code as before this one.)
  FLASHREF_INLINE tile_class classify_in_blocks(std::int64_t b, std::int64_t h, std::int64_t q0,
                                                std::int64_t q1, std::int64_t k0, std::int64_t k1,
                                                key_range qb, key_range kb) const {
    const key_range first = row_range(b, q0);
    const key_range last = row_range(b, q1 - 1);
    if (last.hi <= k0 || first.lo >= k1) return tile_class::empty;
    const bool range_full = last.lo <= k0 && first.hi >= k1;
    if (block_mask == nullptr) return range_full ? tile_class::full : tile_class::partial;
    bool any = false, all = true;
    for (std::int64_t i = qb.lo; i <= qb.hi; ++i) {
      for (std::int64_t j = kb.lo; j <= kb.hi; ++j) {
        const bool on = block_visible(b, h, i, j);
        any = any || on;
        all = all && on;
      }
    }
    if (!any) return tile_class::empty;
    return (range_full && all) ? tile_class::full : tile_class::partial;
  }

  // For a mask without a block mask (causal, window and kv_len alone): the key tiles of
  // tile_k keys that hold a visible key for rows [q0, q1) (non-empty), and whether one of them
  // is full, without classifying each. Every tile between the first row's first key and the
  // last row's last key holds one (both ends of a row's interval are non-decreasing in the
  // row), and classify() finds it non-empty with the class tile_full() gives: full when the
  // last row's interval starts at or before it and the first row's ends at or after it; a
  // tile running past len_k is never full (first.hi <= len_k). The tiles classify() keeps
  // beyond these (it is conservative where every row's interval is empty) hold no visible key.
  struct tile_span {
    std::int64_t tile_begin, tile_end;  // tiles [tile_begin, tile_end)
    std::int64_t full_begin, full_end;  // keys every row of [q0, q1) sees
  };
  FLASHREF_INLINE tile_span key_tiles(std::int64_t b, std::int64_t q0, std::int64_t q1,
                                      std::int64_t tile_k) const {
    const key_range first = row_range(b, q0);
    const key_range last = row_range(b, q1 - 1);
    tile_span t;
    t.tile_begin = first.lo / tile_k;
    t.tile_end = last.hi > first.lo ? (last.hi + tile_k - 1) / tile_k : t.tile_begin;
    t.full_begin = last.lo;
    t.full_end = first.hi;
    return t;
  }
  FLASHREF_INLINE static bool tile_full(const tile_span& t, std::int64_t k0, std::int64_t k1) {
    return k0 >= t.full_begin && k1 <= t.full_end;
  }
};

// The mask of a validated problem, with broadcast block-mask dimensions turned into stride 0.
mask_spec make_mask_spec(const attention_problem& p);

}  // namespace flashref
