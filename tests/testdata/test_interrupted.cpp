// Interrupted writes: `flashref run` and `flashref fixtures regenerate` killed with SIGKILL at
// random moments, many times. Every output is then either absent (or, when it existed before,
// its previous version) or complete and valid — never a partial file. What a kill may leave
// is a hidden temporary (".NAME.XXXXXX.tmp") next to the output, which no reader mistakes for
// an output.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../common/problem.hpp"
#include "flashref/testdata/cases.hpp"
#include "helpers.hpp"

namespace h5 = flashref::testdata::h5;
namespace td = flashref::testdata;
namespace fs = std::filesystem;
using flashref::test::temp_dir;
using flashref::test::testdata_dir;

namespace {

using clock_type = std::chrono::steady_clock;

// Starts `flashref args...` with stdout and stderr discarded.
pid_t spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  std::string exe = FLASHREF_CLI;
  argv.push_back(exe.data());
  std::vector<std::string> copy = args;
  for (std::string& a : copy)
    argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(nullptr);  // the child must not write this process's buffered output again
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, STDOUT_FILENO);
    ::dup2(null, STDERR_FILENO);
    ::execv(exe.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

// Runs to completion: the exit status and the seconds it took.
std::pair<int, double> run_whole(const std::vector<std::string>& args) {
  const auto t0 = clock_type::now();
  const pid_t pid = spawn(args);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1,
          std::chrono::duration<double>(clock_type::now() - t0).count()};
}

// Starts the command and kills it with SIGKILL after `seconds` (or lets it finish first).
// Returns true when the kill landed before the process ended.
bool run_and_kill(const std::vector<std::string>& args, double seconds) {
  const pid_t pid = spawn(args);
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  const bool killed = ::waitpid(pid, nullptr, WNOHANG) == 0;
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return killed && WIFSIGNALED(status);
}

bool is_temporary(const std::string& name) {
  return name.size() > 5 && name[0] == '.' && name.compare(name.size() - 4, 4, ".tmp") == 0;
}

bool same_bytes(const xt::xtensor<double, 4>& a, const xt::xtensor<double, 4>& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

}  // namespace

TEST_CASE("interrupted: flashref run killed at random moments leaves a whole result or none",
          "[interrupted]") {
  temp_dir dir;
  // A problem that takes a while to read, run and write (a few MB each way).
  flashref::test::problem_shape s;
  s.B = 2, s.Hq = 8, s.Hk = 4, s.Lq = 1024, s.Lk = 1024, s.D = 64, s.Dv = 64;
  s.causal = flashref::causal_mode::bottom_right;
  const flashref::problem_data in = flashref::test::random_problem(s, 5);
  const fs::path problem = dir / "problem.h5";
  h5::write_atomically(problem, [&](h5::file& f) {
    h5::dump(f, "/inputs/q", in.q);
    h5::dump(f, "/inputs/k", in.k);
    h5::dump(f, "/inputs/v", in.v);
    h5::write_attr(f, "/", "causal", "bottom_right");
  });
  const fs::path out = dir / "out" / "r.h5";
  fs::create_directories(out.parent_path());
  const std::vector<std::string> args = {
      "run", "--problem", problem.string(), "--out", out.string(), "--backend", "cpu"};
  const auto [rc, seconds] = run_whole(args);
  REQUIRE(rc == 0);
  flashref::reference::golden shape;  // only its o_shape is read
  shape.o_shape = {s.B, s.Hq, s.Lq, s.Dv};
  const td::result whole = td::read_result(out, shape);
  // The previous version some runs start from: a valid result of zeros.
  const xt::xtensor<float, 4> zeros_o =
      xt::zeros<float>({std::size_t(s.B), std::size_t(s.Hq), std::size_t(s.Lq), std::size_t(s.Dv)});
  const xt::xtensor<float, 3> zeros_lse =
      xt::zeros<float>({std::size_t(s.B), std::size_t(s.Hq), std::size_t(s.Lq)});

  std::mt19937_64 rng(16);
  std::uniform_real_distribution<double> when(0.0, 1.5 * seconds);
  // Runs until 30 kills have landed mid-way (a loaded machine stretches some runs and shortens
  // others, so a fixed number of attempts would make the count a matter of luck), at most 240.
  constexpr int kMidway = 30, kMaxRuns = 240;
  int runs = 0, killed = 0, absent = 0, old_version = 0, complete = 0;
  for (int n = 0; killed < kMidway && n < kMaxRuns; ++n, ++runs) {
    std::error_code ec;
    fs::remove(out, ec);
    const bool had_previous = n % 2 == 1;
    if (had_previous) td::write_result(out, zeros_o, zeros_lse, "previous");
    const double at = when(rng);
    CAPTURE(n, at, seconds, had_previous);
    killed += run_and_kill(args, at);
    if (!fs::exists(out)) {
      CHECK_FALSE(had_previous);  // a previous version is never removed
      ++absent;
      continue;
    }
    const td::result r = td::read_result(out, shape);  // complete and valid, or it throws
    if (td::read_result_info(out).backend == "previous") {
      CHECK(had_previous);
      ++old_version;
    } else {
      CHECK(same_bytes(r.o, whole.o));
      ++complete;
    }
    for (const auto& e : fs::directory_iterator(out.parent_path())) {
      const std::string name = e.path().filename().string();
      CHECK((name == "r.h5" || is_temporary(name)));
    }
  }
  CAPTURE(killed, absent, old_version, complete);
  WARN("run: " << killed << " of " << runs << " runs killed mid-way; outputs absent " << absent
               << ", previous version " << old_version << ", complete " << complete);
  // The kills must have hit the run mid-way often enough to mean something.
  CHECK(killed >= kMidway);
  CHECK(absent + old_version > 0);
}

TEST_CASE("interrupted: fixtures regenerate killed at random moments leaves whole fixtures",
          "[interrupted]") {
  temp_dir dir;
  const fs::path out = dir / "fixtures";
  const std::vector<std::string> args = {"fixtures", "regenerate", out.string()};
  const auto [rc, seconds] = run_whole(args);
  REQUIRE(rc == 0);
  fs::remove_all(out);

  std::mt19937_64 rng(17);
  std::uniform_real_distribution<double> when(0.0, seconds);
  constexpr int kMidway = 6, kMaxRuns = 48;  // as above: until 6 kills landed mid-way
  int runs = 0, killed = 0, checked = 0;
  for (int n = 0; killed < kMidway && n < kMaxRuns; ++n, ++runs) {
    if (n % 3 == 0) fs::remove_all(out);  // otherwise over the files of earlier rounds
    const double at = when(rng);
    CAPTURE(n, at, seconds);
    killed += run_and_kill(args, at);
    if (!fs::exists(out)) continue;
    for (const auto& e : fs::directory_iterator(out)) {
      const std::string name = e.path().filename().string();
      CAPTURE(name);
      if (is_temporary(name)) continue;
      REQUIRE(e.path().extension() == ".h5");
      // Bit-identical to the committed fixture (less the generator's version string).
      const h5::file expected = h5::file::open(testdata_dir() / name);
      const h5::file actual = h5::file::open(e.path());
      CHECK(h5::diff(expected, actual, {"generator"}).empty());
      ++checked;
    }
  }
  CAPTURE(killed, checked);
  WARN("regenerate: " << killed << " of " << runs << " runs killed mid-way; " << checked
                      << " fixtures found whole, none partial");
  CHECK(killed >= kMidway);
  CHECK(checked > 0);
}
