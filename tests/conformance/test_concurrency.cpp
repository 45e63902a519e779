// Concurrency: flashref::attention called from 8 threads at once, each with its own problem
// (different shapes, masks, layouts), on every available host backend and through the
// xtensor entry, gives bit for bit what the same calls give one after another. Nothing in the
// library is shared between calls but read-only tables; the tsan preset runs these tests under
// ThreadSanitizer. (The CUDA backend's own version, on one stream per thread, is in
// tests/cuda.)
#include <catch2/catch.hpp>

#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "../common/problem.hpp"
#include "flashref/flashref.hpp"

using flashref::causal_mode;
using flashref::test::problem_shape;

namespace {

constexpr int kThreads = 8;

// Thread t's problem: every thread a different shape and mask.
problem_shape shape_of(int t) {
  problem_shape s;
  s.B = 1 + t % 2, s.Hk = 1 + t % 3, s.Hq = s.Hk * (1 + t % 2);
  s.Lq = 1 + 37 * t, s.Lk = 64 + 45 * t, s.D = 8 + 8 * (t % 3), s.Dv = 16 - 4 * (t % 2);
  s.causal = t % 3 == 0 ? causal_mode::bottom_right : causal_mode::none;
  if (t % 2 == 1) s.block_q = 16 + t, s.block_k = 24, s.block_density = 0.4;
  if (t % 4 == 2) s.window_left = 20, s.window_right = 3;
  s.use_kv_len = t % 5 == 4;
  s.blhd = t % 3 == 1;
  return s;
}

bool bitwise_equal(const flashref::attention_outputs& a, const flashref::attention_outputs& b) {
  return a.o.size() == b.o.size() && a.lse.size() == b.lse.size() &&
         std::memcmp(a.o.data(), b.o.data(), a.o.size() * sizeof(float)) == 0 &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("concurrency: 8 threads at once give the serial results, bit for bit", "[concurrency]") {
  for (const flashref::backend be : {flashref::backend::reference, flashref::backend::cpu}) {
    CAPTURE(flashref::to_string(be));
    std::vector<flashref::problem_data> serial, parallel;
    for (int t = 0; t < kThreads; ++t) {
      serial.push_back(flashref::test::random_problem(shape_of(t), 100 + std::uint64_t(t)));
      parallel.push_back(serial.back());
      flashref::attention(serial.back().problem(), be);
    }
    constexpr int kRounds = 3;  // each thread runs its problem several times, overlapping others
    std::vector<std::string> errors(kThreads);
    std::vector<int> mismatches(kThreads, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        try {
          for (int r = 0; r < kRounds; ++r) {
            flashref::problem_data d = parallel[std::size_t(t)];
            flashref::test::poison_outputs(d);
            flashref::attention(d.problem(), be);
            if (!bitwise_equal(d, serial[std::size_t(t)])) ++mismatches[std::size_t(t)];
          }
        } catch (const std::exception& e) {
          errors[std::size_t(t)] = e.what();
        }
      });
    }
    for (std::thread& th : threads)
      th.join();
    for (int t = 0; t < kThreads; ++t) {
      CAPTURE(t, shape_of(t).describe());
      CHECK(errors[std::size_t(t)].empty());
      CHECK(mismatches[std::size_t(t)] == 0);
    }
  }
}

TEST_CASE("concurrency: the xtensor entry from 8 threads at once", "[concurrency]") {
  std::vector<xt::xtensor<float, 4>> qs, ks, vs;
  std::vector<flashref::attention_options> opts;
  std::vector<flashref::attention_result> serial;
  for (int t = 0; t < kThreads; ++t) {
    problem_shape s = shape_of(t);
    s.blhd = false;  // the xtensor entry takes [B, H, L, D]
    const flashref::problem_data d = flashref::test::random_problem(s, 200 + std::uint64_t(t));
    qs.push_back(d.q), ks.push_back(d.k), vs.push_back(d.v), opts.push_back(d.opt);
    serial.push_back(
        flashref::attention(qs.back(), ks.back(), vs.back(), opts.back(), flashref::backend::cpu));
  }
  std::vector<flashref::attention_result> parallel(kThreads);
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::size_t i = std::size_t(t);
      try {
        parallel[i] = flashref::attention(qs[i], ks[i], vs[i], opts[i], flashref::backend::cpu);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  for (std::thread& th : threads)
    th.join();
  for (int t = 0; t < kThreads; ++t) {
    const std::size_t i = std::size_t(t);
    CAPTURE(t);
    CHECK(errors[i].empty());
    CHECK(bitwise_equal(parallel[i], serial[i]));
  }
}
