#include "flashref/testdata/files.hpp"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "flashref/reference/problem.hpp"

namespace flashref::testdata {

namespace fs = std::filesystem;

void write_file_atomically(const fs::path& path, const std::function<void(const fs::path&)>& fill) {
  const std::string name = path.string();
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw problem_error(name + ": expected a path in an existing folder, got folder '" +
                        dir.string() + "' which does not exist");
  }
  if (fs::is_directory(path, ec)) throw problem_error(name + ": expected a file, got a folder");
  // A unique name in the destination folder (rename is atomic only within one file system).
  std::string name_tmp = ".";  // appended, not "." + name: GCC 12 misreports -Wrestrict
  name_tmp += path.filename().string();
  name_tmp += ".XXXXXX.tmp";
  std::string tmpl = (dir / name_tmp).string();
  const int fd = mkstemps(tmpl.data(), 4);
  if (fd < 0) {
    throw problem_error(name + ": expected a writable folder, got " + std::strerror(errno));
  }
  const mode_t umask_now = ::umask(0);  // mkstemps makes 0600; give the usual 0666 & ~umask
  ::umask(umask_now);
  ::fchmod(fd, 0666 & ~umask_now);
  ::close(fd);
  const fs::path tmp = tmpl;
  try {
    fill(tmp);
    const int sync_fd = ::open(tmpl.c_str(), O_RDONLY);  // the data reaches the disk first
    if (sync_fd >= 0) {
      ::fsync(sync_fd);
      ::close(sync_fd);
    }
    fs::rename(tmp, path, ec);
    if (ec) throw problem_error(name + ": expected a successful rename, got " + ec.message());
  } catch (...) {
    fs::remove(tmp, ec);
    throw;
  }
}

void write_text_atomically(const fs::path& path, const std::string& content) {
  write_file_atomically(path, [&](const fs::path& tmp) {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << content;
    out.flush();
    if (!out)
      throw problem_error(path.string() + ": expected to write " + std::to_string(content.size()) +
                          " bytes, got a write error");
  });
}

temp_folder::temp_folder(const std::string& prefix) {
  std::string tmpl = (fs::temp_directory_path() / (prefix + "-XXXXXX")).string();
  if (mkdtemp(tmpl.data()) == nullptr) {
    throw problem_error("temporary folder: expected one to be created, got " +
                        std::string(std::strerror(errno)));
  }
  path_ = tmpl;
}

temp_folder::~temp_folder() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

std::vector<std::string> temp_folder::entries() const {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(path_))
    out.push_back(e.path().filename().string());
  return out;
}

}  // namespace flashref::testdata
