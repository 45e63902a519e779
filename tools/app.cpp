#include "app.hpp"

#include <cstdio>
#include <exception>

#include "flashref/reference/problem.hpp"

namespace flashref::cli {

std::unique_ptr<CLI::App> make_app(exit_slot status) {
  auto app = std::make_unique<CLI::App>(
      "flashref: tiled attention with an exact reference, golden fixtures and checks");
  app->require_subcommand(1);
  add_demo(*app, status);
#if defined(FLASHREF_HAVE_CPU_BENCH)
  add_bench(*app, status);
#endif
  add_run(*app, status);
  add_check(*app, status);
  add_fixtures(*app, status);
  add_explain(*app, status);
#if defined(FLASHREF_HAVE_CUDA)
  add_bench_gpu(*app, status);
#endif
  return app;
}

int run(CLI::App& app, const exit_slot& status, int argc, const char* const* argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "flashref: %s (see --help)\n", e.what());
    return 2;
  } catch (const flashref::problem_error& e) {
    std::fprintf(stderr, "flashref: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flashref: %s\n", e.what());
    return 2;
  }
  return *status;
}

}  // namespace flashref::cli
