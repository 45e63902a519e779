#pragma once
// Files written whole or not at all, and private temporary folders: the two pieces of file
// plumbing every writer of flashref (fixtures, results, reports, plots) and its tests share.

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace flashref::testdata {

// Writes `path` atomically: `fill` writes a temporary file (the path it is given) in the same
// folder; the file reaches the disk, then is renamed over `path`. On any exception the
// temporary file is removed and `path` is untouched. Throws problem_error naming `path` when
// its folder does not exist or is not writable.
void write_file_atomically(const std::filesystem::path& path,
                           const std::function<void(const std::filesystem::path& tmp)>& fill);

// write_file_atomically for text.
void write_text_atomically(const std::filesystem::path& path, const std::string& content);

// A fresh private folder under the system's temporary folder, removed with its contents.
class temp_folder {
 public:
  explicit temp_folder(const std::string& prefix = "flashref");
  temp_folder(const temp_folder&) = delete;
  temp_folder& operator=(const temp_folder&) = delete;
  ~temp_folder();
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }
  // The names of every entry of the folder (to see that nothing was left behind).
  std::vector<std::string> entries() const;

 private:
  std::filesystem::path path_;
};

}  // namespace flashref::testdata
