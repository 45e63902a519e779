// flashref fixtures regenerate|verify|list — the golden HDF5 files of SPEC §6.

#include <cstdio>
#include <filesystem>
#include <string>

#include "commands.hpp"
#include "flashref/testdata/cases.hpp"

#ifndef FLASHREF_TESTDATA_DIR
#error "FLASHREF_TESTDATA_DIR (the source tree's testdata folder) must be defined by the build"
#endif

namespace flashref::cli {

namespace {

int regenerate_fixtures(const std::string& dir) {
  std::printf("regenerating %zu fixtures into %s\n", testdata::cases().size(), dir.c_str());
  testdata::regenerate(dir, [](std::size_t i, std::size_t n, const testdata::fixture& fx,
                               const std::filesystem::path& file, double seconds) {
    std::error_code ec;
    const auto bytes = std::filesystem::file_size(file, ec);
    std::printf("[%2zu/%zu] %-30s %8.1f KB %8.3f s\n", i + 1, n, fx.name.c_str(),
                ec ? 0.0 : double(bytes) / 1024.0, seconds);
    std::fflush(stdout);
  });
  return 0;
}

int verify_fixtures(const std::string& dir) {
  const std::vector<std::string> diffs = testdata::verify(dir);
  if (diffs.empty()) {
    std::printf("%zu fixtures in %s are bit-identical to a fresh regeneration\n",
                testdata::cases().size(), dir.c_str());
    return 0;
  }
  for (const std::string& d : diffs)
    std::printf("DIFF %s\n", d.c_str());
  std::printf(
      "%zu differences between %s and a fresh regeneration: the generator or the reference "
      "changed; run `flashref fixtures regenerate` only if the change is intended\n",
      diffs.size(), dir.c_str());
  return 1;
}

int list_fixtures() {
  for (const testdata::case_info& c : testdata::cases())
    std::printf("%-30s %s\n", c.name.c_str(), c.description.c_str());
  return 0;
}

}  // namespace

void add_fixtures(CLI::App& app, exit_slot status) {
  CLI::App* cmd =
      app.add_subcommand("fixtures", "Regenerate, verify or list the golden HDF5 fixtures");
  cmd->require_subcommand(1);

  auto regen_dir = std::make_shared<std::string>(FLASHREF_TESTDATA_DIR);
  CLI::App* regen =
      cmd->add_subcommand("regenerate", "Rewrite every fixture (each file atomically)");
  regen->add_option("dir", *regen_dir, "Folder of the fixtures")->capture_default_str();
  regen->callback([regen_dir, status] { *status = regenerate_fixtures(*regen_dir); });

  auto verify_dir = std::make_shared<std::string>(FLASHREF_TESTDATA_DIR);
  CLI::App* verify = cmd->add_subcommand(
      "verify",
      "Regenerate into a temporary folder and compare bit for bit (exit 1 on a difference)");
  verify->add_option("dir", *verify_dir, "Folder of the fixtures")->capture_default_str();
  verify->callback([verify_dir, status] { *status = verify_fixtures(*verify_dir); });

  CLI::App* list = cmd->add_subcommand("list", "The cases and what each one pins");
  list->callback([status] { *status = list_fixtures(); });
}

}  // namespace flashref::cli
