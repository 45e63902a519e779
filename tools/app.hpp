#pragma once
// The flashref app: every command registered, and the one place that turns a parse error or a
// problem_error into one line on stderr and exit status 2. main() is these two calls; the fuzz
// harness of the option parser builds the same app.

#include <memory>

#include "commands.hpp"

namespace flashref::cli {

// The app with every command this build has; each command's callback stores its exit status
// in `status`.
std::unique_ptr<CLI::App> make_app(exit_slot status);

// Parses argv and runs the chosen command: the process exit status (0 success, 1 a failed
// check, 2 bad input, with one line on stderr).
int run(CLI::App& app, const exit_slot& status, int argc, const char* const* argv);

}  // namespace flashref::cli
