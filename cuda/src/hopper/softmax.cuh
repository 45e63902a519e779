#pragma once
// The online softmax of reference/.../online_softmax.hpp at the level of one thread's
// accumulator fragment. Each thread holds two rows (row0 and row0 + 8) of a consumer
// warpgroup's tile, each row's keys spread over the four lanes of a quad; the row state is the
// reference's online_softmax<float>, and each step below calls its named steps:
//
//   exp_old = row.update_max(block_max)   m_new = max(m_old, block_max); exp(m_old - m_new)
//   acc *= exp_old; row.rescale(exp_old)  rescale O and the running sum
//   p = exp(s - exp_base(m))              the reference's prob(), written as one exp2 with the
//                                         max pre-scaled by log2(e) (the only step not called
//                                         through the struct); masked keys (-inf) give 0
//   row.absorb(sum p)                     this thread's share of the row's sum
//   row.finalize()                        after the quad's shares are added: (1/s or 0, lse)
//
// The guard is the struct's exp_base(): a row with no visible key so far never forms
// -inf - (-inf). The mma.sync kernel (tensor_core.cu) takes the same steps.
//
// With a positive softmax scale the scores arrive unscaled (score_scale below): the block max
// of the raw scores times the scale is the max of the scaled scores, bit for bit (rounding is
// monotonic), and the scale joins the exponent's FMA, so that no separate multiply per score
// is needed.

#include "../common.cuh"

namespace flashref::cuda::detail::sm90 {

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// How the scores of a tile meet the softmax scale. With scale > 0 the mask leaves them raw
// (pre = 1), the softmax multiplies each row's block max by the scale (max) and forms
// p = 2^(s (scale log2 e) - base log2 e) with one FMA (exp2); any other scale (zero, negative:
// the max of the raw scores is then not that of the scaled ones, and -inf times it is not
// -inf) is applied to each score by the mask first (pre = scale, max = 1, exp2 = log2 e).
struct score_scale {
  bool folded;
  float pre, max, exp2;

  __device__ explicit score_scale(float scale)
      : folded(scale > 0.f),
        pre(folded ? 1.f : scale),
        max(folded ? scale : 1.f),
        exp2(folded ? scale * kLog2e : kLog2e) {}
};

struct fragment_softmax {
  online_softmax<float> row[2];  // rows row0 and row0 + 8; s is this thread's share

  // s: masked scores (kN / 4 n8 blocks), scaled by sc.pre -> unnormalised probabilities, in
  // place. exp_old[r]: the factor by which the caller must rescale row r of its accumulator.
  template <int kN>
  __device__ __forceinline__ void step(float (&s)[kN], float (&exp_old)[2], const score_scale& sc) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float block_max = -INFINITY;
#pragma unroll
      for (int nb = 0; nb < kN / 4; ++nb)
        block_max = fmaxf(block_max, fmaxf(s[4 * nb + 2 * r], s[4 * nb + 2 * r + 1]));
      // The four lanes of a quad hold the row's keys between them.
      block_max = fmaxf(block_max, __shfl_xor_sync(kFullWarp, block_max, 1));
      block_max = fmaxf(block_max, __shfl_xor_sync(kFullWarp, block_max, 2));
      exp_old[r] = row[r].update_max(block_max * sc.max);  // -inf stays -inf: sc.max > 0
      row[r].rescale(exp_old[r]);
      // p = exp(s sc.max - base) = 2^(s sc.exp2 - base log2e), base = exp_base(m) (0 while
      // m == -inf); a masked key's -inf gives 0.
      const float base_log2 = online_softmax<float>::exp_base(row[r].m) * kLog2e;
      float p_sum = 0.f;
#pragma unroll
      for (int nb = 0; nb < kN / 4; ++nb) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& x = s[4 * nb + 2 * r + c];
          x = exp2_approx(fmaf(x, sc.exp2, -base_log2));
          p_sum += x;
        }
      }
      row[r].absorb(p_sum);
    }
  }

  // The quad's shares of each row's sum added, then the reference's finalize.
  __device__ __forceinline__ void finalize(finalized<float> (&out)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row[r].s += __shfl_xor_sync(kFullWarp, row[r].s, 1);
      row[r].s += __shfl_xor_sync(kFullWarp, row[r].s, 2);
      out[r] = row[r].finalize();
    }
  }
};

// acc (accumulator fragment, kN / 4 n8 blocks) *= exp_old of each row, left out where no row of
// the warp moved its max (every factor 1: x * 1 is x, so the bits are those of the multiply).
// Once a row's max has settled this is most tiles: with scores that are alike across the keys,
// a warp's 16 rows see a new max in about 16 / j of tile j, so the multiplies of O (kN per
// thread, against kN / 2 ... kN exponentials at D = 256 ... 64) run on a few tiles out of many.
// rows_moved is the vote (whether a row of the warp has a factor other than 1), scale_rows the
// multiplies.
__device__ __forceinline__ bool rows_moved(const float (&exp_old)[2]) {
  return __any_sync(kFullWarp, exp_old[0] != 1.f || exp_old[1] != 1.f);
}
template <int kN>
__device__ __forceinline__ void scale_rows(float (&acc)[kN], const float (&exp_old)[2]) {
#pragma unroll
  for (int i = 0; i < kN; ++i)
    acc[i] *= exp_old[(i % 4) / 2];
}
template <int kN>
__device__ __forceinline__ void rescale_rows(float (&acc)[kN], const float (&exp_old)[2]) {
  if (rows_moved(exp_old)) scale_rows(acc, exp_old);
}

}  // namespace flashref::cuda::detail::sm90
