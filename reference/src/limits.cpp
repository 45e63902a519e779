#include "flashref/reference/limits.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <utility>

#include "flashref/reference/problem.hpp"  // problem_error

namespace flashref {

namespace {

constexpr std::uint64_t kUnlimited = std::numeric_limits<std::uint64_t>::max();

// "123", "64K", "2G" (powers of 1024) -> bytes; nothing when malformed or out of range.
std::optional<std::uint64_t> parse_bytes(const std::string& s) {
  if (s.empty() || s[0] < '0' || s[0] > '9') return std::nullopt;
  std::size_t pos = 0;
  std::uint64_t n = 0;
  for (; pos < s.size() && s[pos] >= '0' && s[pos] <= '9'; ++pos) {
    std::uint64_t tens = 0;
    if (__builtin_mul_overflow(n, 10, &tens) ||
        __builtin_add_overflow(tens, std::uint64_t(s[pos] - '0'), &n))
      return std::nullopt;
  }
  if (pos == s.size()) return n;
  if (pos + 1 != s.size()) return std::nullopt;
  int shift = 0;
  switch (s[pos]) {
    case 'K':
      shift = 10;
      break;
    case 'M':
      shift = 20;
      break;
    case 'G':
      shift = 30;
      break;
    case 'T':
      shift = 40;
      break;
    default:
      return std::nullopt;
  }
  return checked_product({n, std::uint64_t(1) << shift});
}

// The first line of a cgroup file holding a byte count or "max".
std::uint64_t cgroup_limit(const char* path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return kUnlimited;
  return parse_bytes(line).value_or(kUnlimited);
}

std::string with_units(std::uint64_t bytes) {
  const char* unit[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double x = double(bytes);
  int u = 0;
  while (x >= 1024.0 && u < 6) {
    x /= 1024.0;
    ++u;
  }
  if (u == 0) return std::to_string(bytes) + " bytes";
  char buf[48];
  std::snprintf(buf, sizeof buf, "%llu bytes (%.1f %s)", static_cast<unsigned long long>(bytes), x,
                unit[u]);
  return buf;
}

}  // namespace

std::optional<std::uint64_t> checked_product(std::initializer_list<std::uint64_t> factors) {
  std::uint64_t n = 1;
  for (const std::uint64_t f : factors)
    if (__builtin_mul_overflow(n, f, &n)) return std::nullopt;
  return n;
}

std::optional<std::uint64_t> checked_sum(std::initializer_list<std::uint64_t> terms) {
  std::uint64_t n = 0;
  for (const std::uint64_t t : terms)
    if (__builtin_add_overflow(n, t, &n)) return std::nullopt;
  return n;
}

memory_budget current_memory_budget() {
  if (const char* env = std::getenv(kMemoryLimitVariable); env != nullptr && *env != '\0') {
    const auto n = parse_bytes(env);
    if (!n) {
      throw problem_error(std::string(kMemoryLimitVariable) +
                          ": expected a byte count such as 4096, 512M or 2G, got '" + env + "'");
    }
    return {*n, kMemoryLimitVariable};
  }
  memory_budget b{kUnlimited, "no limit known"};
  const auto take = [&](std::uint64_t n, const char* source) {
    if (n < b.bytes) b = {n, source};
  };
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0)
    take(checked_product({std::uint64_t(pages), std::uint64_t(page)}).value_or(kUnlimited),
         "physical memory");
  for (const auto& [resource, name] :
       {std::pair{RLIMIT_AS, "RLIMIT_AS"}, std::pair{RLIMIT_DATA, "RLIMIT_DATA"}}) {
    rlimit r{};
    if (::getrlimit(resource, &r) == 0 && r.rlim_cur != RLIM_INFINITY)
      take(std::uint64_t(r.rlim_cur), name);
  }
  take(cgroup_limit("/sys/fs/cgroup/memory.max"), "cgroup memory.max");
  take(cgroup_limit("/sys/fs/cgroup/memory/memory.limit_in_bytes"), "cgroup memory limit");
  return b;
}

void check_allocation(const std::string& what, std::optional<std::uint64_t> bytes,
                      const std::string& detail) {
  const memory_budget b = current_memory_budget();
  if (bytes && *bytes <= b.bytes) return;
  const std::string got =
      bytes ? with_units(*bytes) : std::string("more than 2^64 bytes (the size overflows)");
  throw problem_error(what + ": expected at most " + with_units(b.bytes) + " (" + b.source +
                      "), got " + got + " (" + detail + ")");
}

}  // namespace flashref
