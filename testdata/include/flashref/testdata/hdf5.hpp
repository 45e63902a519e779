#pragma once
// A thin HDF5 layer over xtensor: load<T, R>(file, path) / dump(file, path, x), attributes, an
// atomic writer and a bit-exact file comparison. The dataset's dims are the xtensor's shape.
//
// Reading trusts nothing it has not checked: the object exists and is a dataset, its type
// class fits T, its rank is R, its shape is the expected one (when given) and its size is
// bounded, all before a byte is allocated. Every failure throws flashref::problem_error with
// one line naming the file, the object path, the expected and the actual value:
//   "p.h5:/inputs/q: expected rank 4, got rank 3 ([2, 8, 16])"
// HDF5's own error-stack printing is switched off; the message is ours.

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <xtensor/xtensor.hpp>

namespace flashref::testdata::h5 {

// An open HDF5 file. Move-only; closes on destruction (errors on that path are ignored —
// call close() to see them).
class file {
 public:
  // Read-only. A missing, unreadable, non-HDF5 or truncated file throws problem_error.
  static file open(const std::filesystem::path& path);
  // Read-only, from the bytes of an HDF5 file in memory (HDF5's core driver over a file
  // image; nothing touches the disk). `name` stands for the file in messages. Bytes that are
  // not an intact HDF5 file throw problem_error, as open() does.
  static file open_image(const void* data, std::size_t size, const std::string& name);
  // Creates (truncates) a file for writing.
  static file create(const std::filesystem::path& path);

  file(file&& other) noexcept;
  file& operator=(file&& other) noexcept;
  file(const file&) = delete;
  file& operator=(const file&) = delete;
  ~file();

  void close();                                      // flush and close; throws on failure
  const std::string& name() const { return name_; }  // the path as given, for messages
  std::int64_t id() const { return id_; }            // the hid_t

  // Does a dataset or group exist at this absolute path ("/inputs/q")?
  bool has(const std::string& path) const;

  // Throws problem_error "<file>:<path>: expected <expected>, got <got>".
  [[noreturn]] void fail(const std::string& path, const std::string& expected,
                         const std::string& got) const;

 private:
  file(std::int64_t id, std::string name) : id_(id), name_(std::move(name)) {}
  std::int64_t id_ = -1;
  std::string name_;
};

// The shape of the dataset at path (throws when it is missing or not a dataset).
std::vector<std::size_t> shape_of(const file& f, const std::string& path);

// A short name of the dataset's type: "float32", "float16", "int64", "enum(int8)", "string"...
std::string type_of(const file& f, const std::string& path);

// Loads a dataset of rank R as T. Floating T (float, double) accepts any HDF5 float type and
// converts. Integral T (uint8, int32, int64) accepts any HDF5 integer type — and, for uint8,
// an enum over integers such as h5py's bool — and throws when a value does not fit T.
template <class T, std::size_t R>
xt::xtensor<T, R> load(const file& f, const std::string& path);

// As above, and the shape must equal `expected` (checked before reading).
template <class T, std::size_t R>
xt::xtensor<T, R> load(const file& f, const std::string& path,
                       const std::array<std::size_t, R>& expected);

// How dump stores a dataset's elements: contiguous, or as one chunk through HDF5's shuffle and
// deflate filters (built into every HDF5 library and h5py; readers see the same values).
// Compression applies from kCompressFrom bytes on: below, a chunk's index costs more than the
// filters save.
enum class layout { contiguous, compressed };
constexpr std::size_t kCompressFrom = 1024;

// Writes x as a new dataset (float32, float64, uint8, int32 or int64, little-endian),
// creating the groups on the way.
template <class T, std::size_t R>
void dump(file& f, const std::string& path, const xt::xtensor<T, R>& x,
          layout how = layout::contiguous);

// --- attributes of the object at obj ("/" for the root) ----------------------------------

bool has_attr(const file& f, const std::string& obj, const std::string& name);
// Fixed- or variable-length strings.
std::string read_string_attr(const file& f, const std::string& obj, const std::string& name);
// Any HDF5 integer type; the value must fit the result.
std::int64_t read_int_attr(const file& f, const std::string& obj, const std::string& name);
std::uint64_t read_uint_attr(const file& f, const std::string& obj, const std::string& name);
// Any HDF5 float or integer type.
double read_float_attr(const file& f, const std::string& obj, const std::string& name);

void write_attr(file& f, const std::string& obj, const std::string& name,
                const std::string& value);  // variable-length UTF-8
void write_attr(file& f, const std::string& obj, const std::string& name, const char* value);
void write_attr(file& f, const std::string& obj, const std::string& name, std::int64_t value);
void write_attr(file& f, const std::string& obj, const std::string& name, std::uint64_t value);
void write_attr(file& f, const std::string& obj, const std::string& name, double value);

// --- whole files ------------------------------------------------------------------------

// Writes the file at `path` atomically: `fill` writes into a fresh file created in the same
// folder under a temporary name, which is renamed onto `path` only after fill returned and
// the file was closed and synced. On any failure the temporary file is removed and `path` is
// left as it was (absent, or the previous version).
void write_atomically(const std::filesystem::path& path, const std::function<void(file&)>& fill);

// Every difference between two files, one line each, empty when they are identical: the same
// datasets (type, shape and values bit for bit, whatever their storage layout) and the same
// attributes (type and value) on every object.
// Attribute names in `ignore_attrs` are not compared.
std::vector<std::string> diff(const file& expected, const file& actual,
                              const std::vector<std::string>& ignore_attrs = {});

}  // namespace flashref::testdata::h5
