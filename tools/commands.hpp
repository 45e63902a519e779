#pragma once
// Each subcommand of the flashref CLI registers itself on the app. A command's callback
// returns the process exit status: 0 success, 1 a contract or verification failure,
// 2 bad input (an error line has been printed).

#include <functional>
#include <memory>

#include <CLI/CLI.hpp>

namespace flashref::cli {

// Where a command stores its exit status; main() returns it.
using exit_slot = std::shared_ptr<int>;

void add_demo(CLI::App& app, exit_slot status);
void add_bench(CLI::App& app, exit_slot status);  // the CPU grid (bench.cpp)
void add_run(CLI::App& app, exit_slot status);
void add_check(CLI::App& app, exit_slot status);
void add_fixtures(CLI::App& app, exit_slot status);
void add_explain(CLI::App& app, exit_slot status);
void add_bench_gpu(CLI::App& app, exit_slot status);  // with the CUDA backend (bench_cuda.cpp)

}  // namespace flashref::cli
