#pragma once
// Sizes that cannot be trusted: element counts and byte counts computed without overflow, and
// the memory budget every allocation flashref makes for a problem is checked against *before*
// anything is allocated. A file that declares q, k, v of [1, 1, 2^24, 128] (a few KB on disk,
// 24 GiB in memory) is refused with one line instead of ending in std::bad_alloc.

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

namespace flashref {

// The product of the factors, or nothing when it does not fit (or a factor is negative).
std::optional<std::uint64_t> checked_product(std::initializer_list<std::uint64_t> factors);
std::optional<std::uint64_t> checked_sum(std::initializer_list<std::uint64_t> terms);

// The environment variable that sets the memory budget by hand: bytes, or a number with the
// suffix K, M, G or T (powers of 1024), e.g. FLASHREF_MEMORY_LIMIT=2G.
inline constexpr const char* kMemoryLimitVariable = "FLASHREF_MEMORY_LIMIT";

// The most bytes one problem's own storage may take, and where that figure comes from.
struct memory_budget {
  std::uint64_t bytes = 0;
  std::string
      source;  // "physical memory", "RLIMIT_AS", "cgroup memory.max", "FLASHREF_MEMORY_LIMIT"
};

// FLASHREF_MEMORY_LIMIT when it is set (a malformed value throws problem_error naming it);
// otherwise the smallest of the machine's physical memory (sysconf), the process's address
// space and data limits (getrlimit RLIMIT_AS, RLIMIT_DATA) and its cgroup's memory.max. Read
// again on every call, so a test may change the variable.
memory_budget current_memory_budget();

// Throws problem_error "<what>: expected at most <budget> bytes (<source>), got <bytes> bytes
// (<detail>)" when `bytes` exceeds the budget; `bytes` = nullopt means the count overflowed.
void check_allocation(const std::string& what, std::optional<std::uint64_t> bytes,
                      const std::string& detail);

}  // namespace flashref
