// Fuzz harness: the flashref command line. The bytes are split at NUL bytes into arguments
// (at most kMaxArgs) and parsed by the very app `flashref` builds, stopped before any command
// runs: what is fuzzed is CLI11's parsing, the option types, validators,
// defaults and subcommand structure, which may only refuse with a CLI parse error (exit 2)
// or problem_error. Commands themselves are fuzzed through their inputs' harnesses.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "app.hpp"
#include "harness.hpp"

namespace {

constexpr std::size_t kMaxArgs = 32;

// Thrown once the whole command line is parsed and checked, before any command runs.
struct parsed {};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> args{"flashref"};
  std::string cur;
  for (std::size_t i = 0; i < size && args.size() <= kMaxArgs; ++i) {
    if (data[i] == 0) {
      args.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(char(data[i]));
    }
  }
  if (args.size() <= kMaxArgs) args.push_back(cur);
  std::vector<const char*> argv;
  for (const std::string& a : args)
    argv.push_back(a.c_str());

  auto status = std::make_shared<int>(0);
  const auto app = flashref::cli::make_app(status);
  // The app's own parse-complete callback runs after every option of every subcommand was
  // converted and validated, and before the chosen command's action: stop there.
  app->parse_complete_callback([] { throw parsed{}; });
  flashref::fuzz::expect_refusal_only([&] {
    try {
      app->parse(int(argv.size()), argv.data());
    } catch (const parsed&) {
    } catch (const CLI::Error&) {  // --help, a parse error: exit 0 or 2 with one line
    }
  });
  return 0;
}
