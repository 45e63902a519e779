// flashref — the command-line tool. Exit status: 0 success, 1 a failed check, 2 bad input.
#include <cstdio>
#include <exception>
#include <memory>

#include "commands.hpp"
#include "flashref/reference/problem.hpp"

int main(int argc, char** argv) {
  CLI::App app{"flashref: tiled attention with an exact reference, golden fixtures and checks"};
  app.require_subcommand(1);
  auto status = std::make_shared<int>(0);
  flashref::cli::add_demo(app, status);
#if defined(FLASHREF_HAVE_CPU_BENCH)
  flashref::cli::add_bench(app, status);
#endif
  flashref::cli::add_run(app, status);
  flashref::cli::add_check(app, status);
  flashref::cli::add_fixtures(app, status);
  flashref::cli::add_explain(app, status);
#if defined(FLASHREF_HAVE_CUDA)
  flashref::cli::add_bench_gpu(app, status);
#endif
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
