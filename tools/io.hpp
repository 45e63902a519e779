#pragma once
// Small file helpers for the CLI: text files written atomically (temporary file in the same
// folder, then rename), so that a failed or interrupted command never leaves half a file.

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "flashref/reference/problem.hpp"

namespace flashref::cli {

inline void write_text_atomically(const std::filesystem::path& path, const std::string& content) {
  std::filesystem::path tmp = path;
  tmp += ".tmp-" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out)
      throw problem_error(path.string() + ": expected a writable file, got an error opening it");
    out << content;
    out.flush();
    if (!out) {
      out.close();
      std::filesystem::remove(tmp);
      throw problem_error(path.string() + ": expected to write " + std::to_string(content.size()) +
                          " bytes, got a write error");
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp);
    throw problem_error(path.string() + ": expected to rename the finished file into place, got " +
                        ec.message());
  }
}

}  // namespace flashref::cli
