// Regeneration and bit-identity verification of the committed fixtures.

#include <algorithm>
#include <chrono>

#include "flashref/testdata/cases.hpp"
#include "flashref/testdata/files.hpp"

namespace flashref::testdata {

namespace fs = std::filesystem;

void regenerate(const fs::path& dir, const progress_fn& progress) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir)) {
    throw problem_error(dir.string() + ": expected a folder for the fixtures, got " +
                        (ec ? ec.message() : std::string("something else")));
  }
  const auto& all = cases();
  for (std::size_t i = 0; i < all.size(); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const fixture fx = generate(all[i].name);
    const fs::path file = dir / (fx.name + ".h5");
    write_fixture(file, fx);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (progress) progress(i, all.size(), fx, file, secs);
  }
}

std::vector<std::string> verify(const fs::path& dir) {
  if (!fs::is_directory(dir)) {
    throw problem_error(dir.string() + ": expected a folder of fixtures, got " +
                        (fs::exists(dir) ? "a file" : "nothing"));
  }
  const temp_folder fresh("flashref-fixtures");
  regenerate(fresh.path());
  std::vector<std::string> out;
  std::vector<std::string> names;
  for (const case_info& c : cases()) {
    names.push_back(c.name + ".h5");
    const fs::path committed = dir / (c.name + ".h5");
    if (!fs::exists(committed)) {
      out.push_back(c.name + ": missing file " + committed.string());
      continue;
    }
    try {
      const h5::file expected = h5::file::open(committed);
      const h5::file actual = h5::file::open(fresh.path() / (c.name + ".h5"));
      for (const std::string& d : h5::diff(expected, actual, {"generator"}))
        out.push_back(c.name + ": " + d);
    } catch (const problem_error& e) {
      out.push_back(c.name + ": " + e.what());
    }
  }
  std::vector<std::string> extra;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string n = entry.path().filename().string();
    if (entry.path().extension() == ".h5" &&
        std::find(names.begin(), names.end(), n) == names.end()) {
      extra.push_back(n + ": not a case of this generator (a stale fixture?)");
    }
  }
  std::sort(extra.begin(), extra.end());
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

}  // namespace flashref::testdata
