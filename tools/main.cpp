// flashref — the command-line tool. Exit status: 0 success, 1 a failed check, 2 bad input.
#include <memory>

#include "app.hpp"

int main(int argc, char** argv) {
  auto status = std::make_shared<int>(0);
  const auto app = flashref::cli::make_app(status);
  return flashref::cli::run(*app, status, argc, argv);
}
