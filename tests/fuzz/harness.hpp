#pragma once
// What every fuzz harness holds to: a malformed input may only end in flashref::problem_error
// (the one line the CLI prints with exit status 2). Anything else — a crash, a sanitizer
// report, another exception, an allocation libFuzzer finds too large — is a finding.

#include <stdlib.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "flashref/reference/problem.hpp"

// Every harness runs under a memory budget far below libFuzzer's RSS limit, so that an input
// declaring a large problem is refused by flashref's own check (problem_error) before anything
// is allocated; an allocation flashref makes past that check shows as std::bad_alloc (ASan's
// allocator_may_return_null=1) or as the RSS limit, both findings.
inline constexpr const char* kFuzzMemoryLimit = "256M";

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ::setenv("FLASHREF_MEMORY_LIMIT", kFuzzMemoryLimit, 1);
  return 0;
}

namespace flashref::fuzz {

// Runs `body`; a problem_error is the expected way to refuse input, any other exception aborts
// with its message so that libFuzzer records the input.
template <class F>
void expect_refusal_only(F&& body) {
  try {
    body();
  } catch (const problem_error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: an exception other than problem_error: %s\n", e.what());
    std::abort();
  }
}

// Aborts (a finding) when a promise of the contract is broken.
inline void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz: broken promise: %s\n", what);
    std::abort();
  }
}

// Runs `body`, which must not throw at all (the input was well-formed by construction).
template <class F>
void require_no_throw(F&& body, const char* what) {
  try {
    body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: %s threw: %s\n", what, e.what());
    std::abort();
  }
}

}  // namespace flashref::fuzz
