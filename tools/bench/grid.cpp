#include "grid.hpp"

#include <algorithm>

#include "flashref/reference/problem.hpp"
#include "flashref/testdata/random.hpp"

namespace flashref::cli {

void bench_grid::validate(const std::vector<std::string>& allowed) const {
  if (tokens < 1) throw problem_error("tokens: expected >= 1, got " + std::to_string(tokens));
  if (model < 1) throw problem_error("model: expected >= 1, got " + std::to_string(model));
  if (block < 1) throw problem_error("block: expected >= 1, got " + std::to_string(block));
  for (std::int64_t L : lengths)
    if (L < 1 || tokens % L != 0)  // B = tokens / L batch entries
      throw problem_error("lengths: expected divisors of --tokens " + std::to_string(tokens) +
                          ", got " + std::to_string(L));
  for (std::int64_t D : head_dims)
    if (D < 1 || model % D != 0)  // Hq = model / D heads
      throw problem_error("head-dims: expected divisors of --model " + std::to_string(model) +
                          ", got " + std::to_string(D));
  for (double d : densities)
    if (!(d >= 0 && d <= 1))
      throw problem_error("densities: expected values in [0, 1], got " + std::to_string(d));
  for (const std::string& m : masks) {
    if (std::find(allowed.begin(), allowed.end(), m) != allowed.end()) continue;
    std::string list;
    for (std::size_t i = 0; i < allowed.size(); ++i)
      list += (i == 0 ? "" : i + 1 == allowed.size() ? " or " : ", ") + allowed[i];
    throw problem_error("masks: expected " + list + ", got '" + m + "'");
  }
}

std::vector<bench_point> bench_grid::points(const std::string& dtype) const {
  std::vector<bench_point> out;
  for (std::int64_t D : head_dims) {
    for (std::int64_t L : lengths) {
      bench_point base;
      base.B = tokens / L;
      base.Hq = base.Hk = model / D;
      base.Lq = base.Lk = L;
      base.D = base.Dv = D;
      base.block = block;
      base.dtype = dtype;
      for (const std::string& m : masks) {
        bench_point pt = base;
        pt.mask = m;
        if (m != "block_sparse") {
          out.push_back(pt);
          continue;
        }
        for (double d : densities) {
          pt.density = d;
          out.push_back(pt);
        }
      }
    }
  }
  return out;
}

std::vector<std::uint8_t> block_sparse_mask(std::int64_t Hq, std::int64_t L, std::int64_t block,
                                            double density, std::uint64_t seed) {
  constexpr std::int64_t kEmptyRowEvery = 8;  // query-block rows 7, 15, ... see nothing
  const std::int64_t nb = (L + block - 1) / block;
  const testdata::counter_rng rng(seed, std::uint64_t(L));
  std::vector<std::uint8_t> mask(std::size_t(Hq * nb * nb));
  for (std::int64_t h = 0; h < Hq; ++h)
    for (std::int64_t qb = 0; qb < nb; ++qb)
      for (std::int64_t kb = 0; kb < nb; ++kb) {
        const std::size_t idx = std::size_t((h * nb + qb) * nb + kb);
        mask[idx] = qb % kEmptyRowEvery != kEmptyRowEvery - 1 && rng.uniform(idx) < density;
      }
  return mask;
}

std::uint64_t mask_hash(const std::vector<std::uint8_t>& mask) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (std::uint8_t b : mask) {
    h ^= b;
    h *= 0x100000001b3ULL;
  }
  return h;
}

}  // namespace flashref::cli
