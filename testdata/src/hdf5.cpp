#include "flashref/testdata/hdf5.hpp"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>
#include <type_traits>
#include <utility>

#include <hdf5.h>

#include "flashref/reference/problem.hpp"
#include "flashref/testdata/files.hpp"

namespace flashref::testdata::h5 {

static_assert(std::is_same_v<hid_t, std::int64_t>, "file::id() hands out a hid_t as int64");

namespace {

namespace fs = std::filesystem;

// No dataset we read may claim more elements than this (4 Gi): a corrupt or hostile header
// must not make us allocate before HDF5 has had a chance to fail the read.
constexpr std::uint64_t kMaxElements = std::uint64_t(1) << 32;
// Nor may a fixed-length string attribute claim more bytes than this.
constexpr std::size_t kMaxStringBytes = std::size_t(1) << 20;
// Deflate's level for layout::compressed: the slowest and smallest (fixtures are written once).
constexpr unsigned kDeflateLevel = 9;
// Half the entries of a chunk index node (H5Pset_istore_k): the smallest, for one chunk.
constexpr unsigned kChunkIndexK = 1;

// HDF5 prints its error stack to stderr by default; the CLI prints exactly one line of its own.
void silence_hdf5() {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

// The innermost description on HDF5's error stack, e.g. "truncated file: eof = 1000, ...".
std::string hdf5_reason() {
  std::string out;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* e, void* data) -> herr_t {
        auto* s = static_cast<std::string*>(data);
        if (n == 0 && e->desc != nullptr) *s = e->desc;
        return 0;
      },
      &out);
  H5Eclear2(H5E_DEFAULT);
  return out.empty() ? "no detail from HDF5" : out;
}

// An owned hid_t with its matching close function.
class handle {
 public:
  using closer = herr_t (*)(hid_t);
  handle() = default;
  handle(hid_t id, closer c) : id_(id), close_(c) {}
  handle(handle&& o) noexcept : id_(std::exchange(o.id_, -1)), close_(o.close_) {}
  handle& operator=(handle&& o) noexcept {
    std::swap(id_, o.id_);
    std::swap(close_, o.close_);
    return *this;
  }
  handle(const handle&) = delete;
  handle& operator=(const handle&) = delete;
  ~handle() {
    if (id_ >= 0) close_(id_);
  }
  hid_t get() const { return id_; }
  bool ok() const { return id_ >= 0; }

 private:
  hid_t id_ = -1;
  closer close_ = nullptr;
};

template <class C>
std::string list_str(const C& xs) {
  std::ostringstream os;
  os << '[';
  bool first = true;
  for (auto x : xs) {
    if (!first) os << ", ";
    os << x;
    first = false;
  }
  os << ']';
  return os.str();
}

std::string describe_type(hid_t t) {
  const std::size_t bits = H5Tget_size(t) * 8;
  switch (H5Tget_class(t)) {
    case H5T_FLOAT:
      return "float" + std::to_string(bits);
    case H5T_INTEGER:
      return (H5Tget_sign(t) == H5T_SGN_NONE ? "uint" : "int") + std::to_string(bits);
    case H5T_ENUM: {
      handle super(H5Tget_super(t), H5Tclose);
      return "enum(" + (super.ok() ? describe_type(super.get()) : std::string("?")) + ")";
    }
    case H5T_STRING:
      return H5Tis_variable_str(t) > 0 ? "variable-length string"
                                       : "string of " + std::to_string(bits / 8) + " bytes";
    case H5T_COMPOUND:
      return "compound";
    case H5T_ARRAY:
      return "array";
    case H5T_VLEN:
      return "variable-length sequence";
    case H5T_BITFIELD:
      return "bitfield";
    case H5T_OPAQUE:
      return "opaque";
    case H5T_REFERENCE:
      return "reference";
    default:
      return "unknown type";
  }
}

// Checked product of the dims; fails above kMaxElements.
std::uint64_t element_count(const file& f, const std::string& where,
                            const std::vector<std::size_t>& dims) {
  std::uint64_t n = 1;
  for (std::size_t d : dims) {
    if (d != 0 && n > kMaxElements / d) {
      f.fail(where, "at most " + std::to_string(kMaxElements) + " elements", list_str(dims));
    }
    n *= d;
  }
  if (n > kMaxElements) {
    f.fail(where, "at most " + std::to_string(kMaxElements) + " elements", list_str(dims));
  }
  return n;
}

// Splits "/a/b/c" into its prefixes "/a", "/a/b", "/a/b/c".
std::vector<std::string> prefixes(const std::string& path) {
  std::vector<std::string> out;
  for (std::size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos == path.size() || path[pos] == '/') out.push_back(path.substr(0, pos));
  }
  return out;
}

handle open_object(const file& f, const std::string& path) {
  if (path != "/" && !f.has(path)) f.fail(path, "an object at this path", "nothing");
  handle o(H5Oopen(f.id(), path.c_str(), H5P_DEFAULT), H5Oclose);
  if (!o.ok()) f.fail(path, "an object HDF5 can open", hdf5_reason());
  return o;
}

handle open_dataset(const file& f, const std::string& path) {
  if (!f.has(path)) f.fail(path, "a dataset", "nothing at this path");
  handle o = open_object(f, path);
  if (H5Iget_type(o.get()) != H5I_DATASET) f.fail(path, "a dataset", "a group");
  handle d(H5Dopen2(f.id(), path.c_str(), H5P_DEFAULT), H5Dclose);
  if (!d.ok()) f.fail(path, "a dataset HDF5 can open", hdf5_reason());
  return d;
}

// Dims of a dataspace; a scalar has rank 0, a null dataspace is refused.
std::vector<std::size_t> dims_of(const file& f, const std::string& where, hid_t space) {
  const H5S_class_t cls = H5Sget_simple_extent_type(space);
  if (cls == H5S_SCALAR) return {};
  if (cls != H5S_SIMPLE) f.fail(where, "a simple or scalar dataspace", "a null dataspace");
  const int rank = H5Sget_simple_extent_ndims(space);
  if (rank < 0 || rank > H5S_MAX_RANK) f.fail(where, "a readable dataspace", hdf5_reason());
  std::vector<hsize_t> d(static_cast<std::size_t>(rank));
  H5Sget_simple_extent_dims(space, d.data(), nullptr);
  return {d.begin(), d.end()};
}

// --- element types -----------------------------------------------------------------------

template <class T>
struct element;
template <>
struct element<float> {
  static hid_t mem() { return H5T_NATIVE_FLOAT; }
  static hid_t disk() { return H5T_IEEE_F32LE; }
};
template <>
struct element<double> {
  static hid_t mem() { return H5T_NATIVE_DOUBLE; }
  static hid_t disk() { return H5T_IEEE_F64LE; }
};
template <>
struct element<std::uint8_t> {
  static hid_t mem() { return H5T_NATIVE_UINT8; }
  static hid_t disk() { return H5T_STD_U8LE; }
};
template <>
struct element<std::int32_t> {
  static hid_t mem() { return H5T_NATIVE_INT32; }
  static hid_t disk() { return H5T_STD_I32LE; }
};
template <>
struct element<std::int64_t> {
  static hid_t mem() { return H5T_NATIVE_INT64; }
  static hid_t disk() { return H5T_STD_I64LE; }
};

template <class T>
const char* int_name() {
  if constexpr (std::is_same_v<T, std::uint8_t>) return "uint8";
  if constexpr (std::is_same_v<T, std::int32_t>) return "int32";
  if constexpr (std::is_same_v<T, std::uint64_t>) return "uint64";
  return "int64";
}

// Reads n integers of the (integer or enum) type `ftype` into T, range-checked. Reading goes
// through 64 bits of the dataset's signedness so that HDF5 never clips a value silently.
template <class T, class Read>
void read_integers(const file& f, const std::string& where, hid_t ftype, std::uint64_t n, T* out,
                   Read&& read) {
  auto convert = [&](auto wide, hid_t mem) {
    std::vector<decltype(wide)> buf(static_cast<std::size_t>(n));
    if (read(mem, buf.data()) < 0) f.fail(where, "readable data", hdf5_reason());
    for (std::size_t i = 0; i < buf.size(); ++i) {
      const auto x = buf[i];
      if (!std::in_range<T>(x)) {
        f.fail(where, std::string("values that fit ") + int_name<T>(),
               std::to_string(x) + " at flat index " + std::to_string(i));
      }
      out[i] = static_cast<T>(x);
    }
  };
  handle base(H5Tget_class(ftype) == H5T_ENUM ? H5Tget_super(ftype) : H5Tcopy(ftype), H5Tclose);
  if (H5Tget_sign(base.get()) == H5T_SGN_NONE) {
    convert(std::uint64_t{}, H5T_NATIVE_UINT64);
  } else {
    convert(std::int64_t{}, H5T_NATIVE_INT64);
  }
}

// Checks that the type class of `ftype` can be loaded as T.
template <class T>
void check_class(const file& f, const std::string& where, hid_t ftype) {
  const H5T_class_t cls = H5Tget_class(ftype);
  if constexpr (std::is_floating_point_v<T>) {
    if (cls != H5T_FLOAT) f.fail(where, "a float type", describe_type(ftype));
  } else {
    bool ok = cls == H5T_INTEGER;
    if (std::is_same_v<T, std::uint8_t> && cls == H5T_ENUM) {  // h5py's bool is enum(int8)
      handle super(H5Tget_super(ftype), H5Tclose);
      ok = super.ok() && H5Tget_class(super.get()) == H5T_INTEGER;
    }
    if (!ok) {
      f.fail(where,
             std::is_same_v<T, std::uint8_t> ? "an integer or boolean type" : "an integer type",
             describe_type(ftype));
    }
  }
}

template <class T, std::size_t R>
xt::xtensor<T, R> load_impl(const file& f, const std::string& path,
                            const std::array<std::size_t, R>* expected) {
  handle d = open_dataset(f, path);
  handle ftype(H5Dget_type(d.get()), H5Tclose);
  check_class<T>(f, path, ftype.get());
  handle space(H5Dget_space(d.get()), H5Sclose);
  const std::vector<std::size_t> dims = dims_of(f, path, space.get());
  if (dims.size() != R) {
    f.fail(path, "rank " + std::to_string(R),
           "rank " + std::to_string(dims.size()) + " (" + list_str(dims) + ")");
  }
  if (expected != nullptr && !std::equal(dims.begin(), dims.end(), expected->begin())) {
    f.fail(path, "shape " + list_str(*expected), list_str(dims));
  }
  const std::uint64_t n = element_count(f, path, dims);
  std::array<std::size_t, R> shape{};
  std::copy(dims.begin(), dims.end(), shape.begin());
  xt::xtensor<T, R> out = xt::xtensor<T, R>::from_shape(shape);
  if (n == 0) return out;
  auto read = [&](hid_t mem, void* buf) {
    return H5Dread(d.get(), mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf);
  };
  if constexpr (std::is_floating_point_v<T>) {
    if (read(element<T>::mem(), out.data()) < 0) f.fail(path, "readable data", hdf5_reason());
  } else {
    read_integers(f, path, ftype.get(), n, out.data(), read);
  }
  return out;
}

// --- attributes --------------------------------------------------------------------------

std::string attr_where(const std::string& obj, const std::string& name) {
  return obj + " attribute '" + name + "'";
}

// Opens an attribute holding exactly one value.
handle open_attr(const file& f, const std::string& obj, const std::string& name) {
  handle o = open_object(f, obj);
  const std::string where = attr_where(obj, name);
  if (H5Aexists(o.get(), name.c_str()) <= 0) f.fail(where, "an attribute", "none");
  handle a(H5Aopen(o.get(), name.c_str(), H5P_DEFAULT), H5Aclose);
  if (!a.ok()) f.fail(where, "an attribute HDF5 can open", hdf5_reason());
  handle space(H5Aget_space(a.get()), H5Sclose);
  const std::vector<std::size_t> dims = dims_of(f, where, space.get());
  if (element_count(f, where, dims) != 1) f.fail(where, "a single value", list_str(dims));
  return a;
}

template <class Wide>
Wide read_wide_int(const file& f, const std::string& obj, const std::string& name) {
  const std::string where = attr_where(obj, name);
  handle a = open_attr(f, obj, name);
  handle t(H5Aget_type(a.get()), H5Tclose);
  if (H5Tget_class(t.get()) != H5T_INTEGER) f.fail(where, "an integer", describe_type(t.get()));
  Wide out = 0;
  read_integers(f, where, t.get(), 1, &out,
                [&](hid_t mem, void* buf) { return H5Aread(a.get(), mem, buf); });
  return out;
}

handle object_for_write(file& f, const std::string& obj, const std::string& name) {
  handle o = open_object(f, obj);
  if (H5Aexists(o.get(), name.c_str()) > 0) H5Adelete(o.get(), name.c_str());
  return o;
}

void write_scalar_attr(file& f, const std::string& obj, const std::string& name, hid_t disk,
                       hid_t mem, const void* value) {
  handle o = object_for_write(f, obj, name);
  handle space(H5Screate(H5S_SCALAR), H5Sclose);
  handle a(H5Acreate2(o.get(), name.c_str(), disk, space.get(), H5P_DEFAULT, H5P_DEFAULT),
           H5Aclose);
  if (!a.ok() || H5Awrite(a.get(), mem, value) < 0) {
    f.fail(attr_where(obj, name), "a writable attribute", hdf5_reason());
  }
}

// --- comparison --------------------------------------------------------------------------

struct object_list {
  std::map<std::string, bool> is_dataset;  // absolute path -> dataset (true) or group
};

object_list list_objects(const file& f) {
  object_list out;
  out.is_dataset["/"] = false;
  struct ctx {
    hid_t root;
    object_list* out;
  } c{f.id(), &out};
  H5Lvisit(
      f.id(), H5_INDEX_NAME, H5_ITER_INC,
      [](hid_t, const char* name, const H5L_info_t*, void* data) -> herr_t {
        auto* cx = static_cast<ctx*>(data);
        handle o(H5Oopen(cx->root, name, H5P_DEFAULT), H5Oclose);
        if (o.ok()) {
          std::string path = "/";  // appended, not "/" + name: GCC 12 misreports -Wrestrict
          path += name;
          cx->out->is_dataset[path] = H5Iget_type(o.get()) == H5I_DATASET;
        }
        return 0;
      },
      &c);
  return out;
}

std::vector<std::string> attr_names(const file& f, const std::string& obj) {
  handle o = open_object(f, obj);
  std::vector<std::string> names;
  hsize_t idx = 0;
  H5Aiterate2(
      o.get(), H5_INDEX_NAME, H5_ITER_INC, &idx,
      [](hid_t, const char* name, const H5A_info_t*, void* data) -> herr_t {
        static_cast<std::vector<std::string>*>(data)->push_back(name);
        return 0;
      },
      &names);
  return names;
}

std::string format_double(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

// An attribute as "type value" text that is equal for two attributes iff they are equal bit
// for bit (floats are printed exactly, in hexadecimal).
std::string attr_repr(const file& f, const std::string& obj, const std::string& name) {
  const std::string where = attr_where(obj, name);
  handle o = open_object(f, obj);
  handle a(H5Aopen(o.get(), name.c_str(), H5P_DEFAULT), H5Aclose);
  if (!a.ok()) f.fail(where, "an attribute HDF5 can open", hdf5_reason());
  handle t(H5Aget_type(a.get()), H5Tclose);
  handle space(H5Aget_space(a.get()), H5Sclose);
  const std::vector<std::size_t> dims = dims_of(f, where, space.get());
  const std::uint64_t n = element_count(f, where, dims);
  std::string repr = describe_type(t.get());
  if (!dims.empty()) {  // appended, not " " + list: GCC 12 misreports -Wrestrict at -O3
    repr += ' ';
    repr += list_str(dims);
  }
  const H5T_class_t cls = H5Tget_class(t.get());
  if (cls == H5T_STRING && n == 1) return repr + " '" + read_string_attr(f, obj, name) + "'";
  std::vector<std::string> values;
  if (cls == H5T_FLOAT) {
    std::vector<double> v(static_cast<std::size_t>(n));
    if (H5Aread(a.get(), H5T_NATIVE_DOUBLE, v.data()) < 0) f.fail(where, "readable", hdf5_reason());
    char buf[64];
    for (double x : v) {
      std::snprintf(buf, sizeof buf, "%a", x);
      values.push_back(buf);
    }
  } else if (cls == H5T_INTEGER) {
    const bool u = H5Tget_sign(t.get()) == H5T_SGN_NONE;
    std::vector<std::uint64_t> v(static_cast<std::size_t>(n));
    if (H5Aread(a.get(), u ? H5T_NATIVE_UINT64 : H5T_NATIVE_INT64, v.data()) < 0)
      f.fail(where, "readable", hdf5_reason());
    for (std::uint64_t x : v)
      values.push_back(u ? std::to_string(x) : std::to_string(static_cast<std::int64_t>(x)));
  } else {
    return repr + " (not comparable)";
  }
  std::string joined;
  for (const std::string& x : values)
    joined += (joined.empty() ? "" : ", ") + x;
  return repr + " " + joined;
}

// Flat index -> "[i, j, k]".
std::string index_str(std::uint64_t flat, const std::vector<std::size_t>& dims) {
  std::vector<std::uint64_t> idx(dims.size());
  for (std::size_t d = dims.size(); d-- > 0;) {
    idx[d] = dims[d] ? flat % dims[d] : 0;
    flat = dims[d] ? flat / dims[d] : 0;
  }
  return list_str(idx);
}

// Compares two datasets; appends a line per difference.
void diff_dataset(const file& fe, const file& fa, const std::string& path,
                  std::vector<std::string>& out) {
  handle de = open_dataset(fe, path), da = open_dataset(fa, path);
  handle te(H5Dget_type(de.get()), H5Tclose), ta(H5Dget_type(da.get()), H5Tclose);
  const std::string type_e = describe_type(te.get()), type_a = describe_type(ta.get());
  if (type_e != type_a || H5Tequal(te.get(), ta.get()) <= 0) {
    out.push_back(path + ": type differs: expected " + type_e + ", got " + type_a);
    return;
  }
  handle se(H5Dget_space(de.get()), H5Sclose), sa(H5Dget_space(da.get()), H5Sclose);
  const auto dims_e = dims_of(fe, path, se.get()), dims_a = dims_of(fa, path, sa.get());
  if (dims_e != dims_a) {
    out.push_back(path + ": shape differs: expected " + list_str(dims_e) + ", got " +
                  list_str(dims_a));
    return;
  }
  const H5T_class_t cls = H5Tget_class(te.get());
  if (cls != H5T_FLOAT && cls != H5T_INTEGER && cls != H5T_ENUM) {
    out.push_back(path + ": cannot compare datasets of type " + type_e);
    return;
  }
  const std::uint64_t n = element_count(fe, path, dims_e);
  handle mem(H5Tget_native_type(te.get(), H5T_DIR_ASCEND), H5Tclose);
  const std::size_t size = H5Tget_size(mem.get());
  std::vector<unsigned char> be(static_cast<std::size_t>(n) * size), ba(be.size());
  if (n > 0 && (H5Dread(de.get(), mem.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, be.data()) < 0 ||
                H5Dread(da.get(), mem.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, ba.data()) < 0)) {
    out.push_back(path + ": unreadable: " + hdf5_reason());
    return;
  }
  if (be == ba) return;
  std::uint64_t first = 0, count = 0;
  for (std::uint64_t i = n; i-- > 0;) {
    if (std::memcmp(&be[i * size], &ba[i * size], size) != 0) {
      first = i;
      ++count;
    }
  }
  std::string values;
  if (cls == H5T_FLOAT && (size == 4 || size == 8)) {
    auto as_double = [&](const unsigned char* p) {
      if (size == 4) {
        float x;
        std::memcpy(&x, p, 4);
        return double(x);
      }
      double x;
      std::memcpy(&x, p, 8);
      return x;
    };
    values = ": expected " + format_double(as_double(&be[first * size])) + ", got " +
             format_double(as_double(&ba[first * size]));
  }
  out.push_back(path + ": " + std::to_string(count) + " of " + std::to_string(n) +
                " elements differ, first at " + index_str(first, dims_e) + values);
}

}  // namespace

// --- file --------------------------------------------------------------------------------

file file::open(const fs::path& path) {
  silence_hdf5();
  const std::string name = path.string();
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) throw problem_error(name + ": expected an existing file, got no such file");
  if (fs::is_directory(st)) throw problem_error(name + ": expected a file, got a folder");
  const htri_t is_h5 = H5Fis_hdf5(name.c_str());
  if (is_h5 < 0) throw problem_error(name + ": expected a readable file, got " + hdf5_reason());
  if (is_h5 == 0) {
    throw problem_error(name + ": expected an HDF5 file, got a file without the HDF5 signature (" +
                        std::to_string(fs::file_size(path, ec)) + " bytes)");
  }
  const hid_t id = H5Fopen(name.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (id < 0) {
    throw problem_error(name + ": expected an intact HDF5 file, got one HDF5 cannot open (" +
                        hdf5_reason() + ")");
  }
  return file(id, name);
}

file file::open_image(const void* data, std::size_t size, const std::string& name) {
  silence_hdf5();
  if (size == 0) throw problem_error(name + ": expected an HDF5 file, got 0 bytes");
  // The core driver keeps the file in memory and writes nothing back (no backing store);
  // H5Pset_file_image hands it a copy of the bytes.
  handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  if (!fapl.ok() || H5Pset_fapl_core(fapl.get(), 64 * 1024, /*backing_store=*/0) < 0 ||
      H5Pset_file_image(fapl.get(), const_cast<void*>(data), size) < 0) {
    throw problem_error(name + ": expected an in-memory file image, got " + hdf5_reason());
  }
  const hid_t id = H5Fopen(name.c_str(), H5F_ACC_RDONLY, fapl.get());
  if (id < 0) {
    throw problem_error(name + ": expected an intact HDF5 file, got one HDF5 cannot open (" +
                        hdf5_reason() + ")");
  }
  return file(id, name);
}

file file::create(const fs::path& path) {
  silence_hdf5();
  const std::string name = path.string();
  // The index of a chunked dataset (layout::compressed) is a B-tree whose nodes HDF5 sizes for
  // 2 x 32 chunks by default, about 2 KiB each on disk; ours have one chunk. The smallest
  // nodes keep the file format that every HDF5 version reads.
  handle fcpl(H5Pcreate(H5P_FILE_CREATE), H5Pclose);
  if (!fcpl.ok() || H5Pset_istore_k(fcpl.get(), kChunkIndexK) < 0)
    throw problem_error(name + ": expected file creation properties, got " + hdf5_reason());
  const hid_t id = H5Fcreate(name.c_str(), H5F_ACC_TRUNC, fcpl.get(), H5P_DEFAULT);
  if (id < 0) {
    throw problem_error(name + ": expected a file HDF5 can create, got an error (" + hdf5_reason() +
                        ")");
  }
  return file(id, name);
}

file::file(file&& other) noexcept
    : id_(std::exchange(other.id_, -1)), name_(std::move(other.name_)) {}

file& file::operator=(file&& other) noexcept {
  std::swap(id_, other.id_);
  std::swap(name_, other.name_);
  return *this;
}

file::~file() {
  if (id_ >= 0) H5Fclose(id_);
}

void file::close() {
  if (id_ < 0) return;
  const hid_t id = std::exchange(id_, -1);
  const herr_t flushed = H5Fflush(id, H5F_SCOPE_LOCAL);
  const herr_t closed = H5Fclose(id);
  if (flushed < 0 || closed < 0) {
    throw problem_error(name_ + ": expected a clean close, got an error (" + hdf5_reason() + ")");
  }
}

bool file::has(const std::string& path) const {
  if (path.empty() || path[0] != '/') return false;
  if (path == "/") return true;
  for (const std::string& p : prefixes(path)) {
    if (H5Lexists(id_, p.c_str(), H5P_DEFAULT) <= 0) {
      H5Eclear2(H5E_DEFAULT);
      return false;
    }
  }
  return true;
}

void file::fail(const std::string& path, const std::string& expected,
                const std::string& got) const {
  throw problem_error(name_ + ":" + path + ": expected " + expected + ", got " + got);
}

// --- datasets ----------------------------------------------------------------------------

std::vector<std::size_t> shape_of(const file& f, const std::string& path) {
  handle d = open_dataset(f, path);
  handle space(H5Dget_space(d.get()), H5Sclose);
  return dims_of(f, path, space.get());
}

std::string type_of(const file& f, const std::string& path) {
  handle d = open_dataset(f, path);
  handle t(H5Dget_type(d.get()), H5Tclose);
  return describe_type(t.get());
}

template <class T, std::size_t R>
xt::xtensor<T, R> load(const file& f, const std::string& path) {
  return load_impl<T, R>(f, path, nullptr);
}

template <class T, std::size_t R>
xt::xtensor<T, R> load(const file& f, const std::string& path,
                       const std::array<std::size_t, R>& expected) {
  return load_impl<T, R>(f, path, &expected);
}

template <class T, std::size_t R>
void dump(file& f, const std::string& path, const xt::xtensor<T, R>& x, layout how) {
  if (f.has(path)) f.fail(path, "no object (a new dataset)", "an existing object");
  std::array<hsize_t, R> dims{};
  for (std::size_t d = 0; d < R; ++d)
    dims[d] = x.shape(d);
  handle space(H5Screate_simple(int(R), dims.data(), nullptr), H5Sclose);
  handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  if (how == layout::compressed && x.size() * sizeof(T) >= kCompressFrom) {
    // One chunk, the whole dataset: the byte planes of the elements side by side (shuffle),
    // then deflate. The sign and exponent bytes of floats of one magnitude repeat, and so do
    // the zero low bytes of float32 values that are exact bfloat16 or float16.
    if (H5Zfilter_avail(H5Z_FILTER_DEFLATE) <= 0 || H5Zfilter_avail(H5Z_FILTER_SHUFFLE) <= 0)
      f.fail(path, "an HDF5 library with the deflate and shuffle filters", "one without");
    if (H5Pset_chunk(dcpl.get(), int(R), dims.data()) < 0 || H5Pset_shuffle(dcpl.get()) < 0 ||
        H5Pset_deflate(dcpl.get(), kDeflateLevel) < 0) {
      f.fail(path, "a chunked, compressed dataset layout", hdf5_reason());
    }
  }
  handle d(H5Dcreate2(f.id(), path.c_str(), element<T>::disk(), space.get(), lcpl.get(), dcpl.get(),
                      H5P_DEFAULT),
           H5Dclose);
  if (!d.ok()) f.fail(path, "a dataset HDF5 can create", hdf5_reason());
  if (x.size() > 0 &&
      H5Dwrite(d.get(), element<T>::mem(), H5S_ALL, H5S_ALL, H5P_DEFAULT, x.data()) < 0) {
    f.fail(path, "a successful write", hdf5_reason());
  }
}

#define FLASHREF_H5_INSTANTIATE(T, R)                                       \
  template xt::xtensor<T, R> load<T, R>(const file&, const std::string&);   \
  template xt::xtensor<T, R> load<T, R>(const file&, const std::string&,    \
                                        const std::array<std::size_t, R>&); \
  template void dump<T, R>(file&, const std::string&, const xt::xtensor<T, R>&, layout);
#define FLASHREF_H5_INSTANTIATE_RANKS(T) \
  FLASHREF_H5_INSTANTIATE(T, 1)          \
  FLASHREF_H5_INSTANTIATE(T, 2)          \
  FLASHREF_H5_INSTANTIATE(T, 3)          \
  FLASHREF_H5_INSTANTIATE(T, 4)
FLASHREF_H5_INSTANTIATE_RANKS(float)
FLASHREF_H5_INSTANTIATE_RANKS(double)
FLASHREF_H5_INSTANTIATE_RANKS(std::uint8_t)
FLASHREF_H5_INSTANTIATE_RANKS(std::int32_t)
FLASHREF_H5_INSTANTIATE_RANKS(std::int64_t)
#undef FLASHREF_H5_INSTANTIATE_RANKS
#undef FLASHREF_H5_INSTANTIATE

// --- attributes --------------------------------------------------------------------------

bool has_attr(const file& f, const std::string& obj, const std::string& name) {
  if (!f.has(obj)) return false;
  handle o = open_object(f, obj);
  return H5Aexists(o.get(), name.c_str()) > 0;
}

std::string read_string_attr(const file& f, const std::string& obj, const std::string& name) {
  const std::string where = attr_where(obj, name);
  handle a = open_attr(f, obj, name);
  handle t(H5Aget_type(a.get()), H5Tclose);
  if (H5Tget_class(t.get()) != H5T_STRING) f.fail(where, "a string", describe_type(t.get()));
  if (H5Tis_variable_str(t.get()) > 0) {
    handle mem(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mem.get(), H5T_VARIABLE);
    H5Tset_cset(mem.get(), H5Tget_cset(t.get()));
    char* buf = nullptr;
    if (H5Aread(a.get(), mem.get(), &buf) < 0) f.fail(where, "a readable string", hdf5_reason());
    std::string s = buf != nullptr ? buf : "";
    H5free_memory(buf);
    return s;
  }
  const std::size_t n = H5Tget_size(t.get());
  if (n == 0 || n > kMaxStringBytes) {
    f.fail(where, "a string of at most " + std::to_string(kMaxStringBytes) + " bytes",
           std::to_string(n) + " bytes");
  }
  std::string s(n, '\0');
  if (H5Aread(a.get(), t.get(), s.data()) < 0) f.fail(where, "a readable string", hdf5_reason());
  if (H5Tget_strpad(t.get()) == H5T_STR_SPACEPAD) {
    s.erase(s.find_last_not_of(' ') + 1);
  } else {
    s.erase(std::min(s.find('\0'), s.size()));
  }
  return s;
}

std::int64_t read_int_attr(const file& f, const std::string& obj, const std::string& name) {
  return read_wide_int<std::int64_t>(f, obj, name);
}

std::uint64_t read_uint_attr(const file& f, const std::string& obj, const std::string& name) {
  return read_wide_int<std::uint64_t>(f, obj, name);
}

double read_float_attr(const file& f, const std::string& obj, const std::string& name) {
  const std::string where = attr_where(obj, name);
  handle a = open_attr(f, obj, name);
  handle t(H5Aget_type(a.get()), H5Tclose);
  const H5T_class_t cls = H5Tget_class(t.get());
  if (cls != H5T_FLOAT && cls != H5T_INTEGER) f.fail(where, "a number", describe_type(t.get()));
  double x = 0;
  if (H5Aread(a.get(), H5T_NATIVE_DOUBLE, &x) < 0)
    f.fail(where, "a readable number", hdf5_reason());
  return x;
}

void write_attr(file& f, const std::string& obj, const std::string& name,
                const std::string& value) {
  handle t(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(t.get(), H5T_VARIABLE);
  H5Tset_cset(t.get(), H5T_CSET_UTF8);
  const char* p = value.c_str();
  write_scalar_attr(f, obj, name, t.get(), t.get(), &p);
}

void write_attr(file& f, const std::string& obj, const std::string& name, const char* value) {
  write_attr(f, obj, name, std::string(value));
}

void write_attr(file& f, const std::string& obj, const std::string& name, std::int64_t value) {
  write_scalar_attr(f, obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &value);
}

void write_attr(file& f, const std::string& obj, const std::string& name, std::uint64_t value) {
  write_scalar_attr(f, obj, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, &value);
}

void write_attr(file& f, const std::string& obj, const std::string& name, double value) {
  write_scalar_attr(f, obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &value);
}

// --- whole files -------------------------------------------------------------------------

void write_atomically(const fs::path& path, const std::function<void(file&)>& fill) {
  write_file_atomically(path, [&](const fs::path& tmp) {
    file f = file::create(tmp);
    fill(f);
    f.close();
  });
}

std::vector<std::string> diff(const file& expected, const file& actual,
                              const std::vector<std::string>& ignore_attrs) {
  std::vector<std::string> out;
  const object_list oe = list_objects(expected), oa = list_objects(actual);
  auto ignored = [&](const std::string& n) {
    return std::find(ignore_attrs.begin(), ignore_attrs.end(), n) != ignore_attrs.end();
  };
  for (const auto& [path, is_ds] : oe.is_dataset) {
    const auto it = oa.is_dataset.find(path);
    if (it == oa.is_dataset.end()) {
      out.push_back(path + ": missing");
      continue;
    }
    if (it->second != is_ds) {
      out.push_back(path + ": expected a " + (is_ds ? "dataset" : "group") + ", got a " +
                    (is_ds ? "group" : "dataset"));
      continue;
    }
    if (is_ds) diff_dataset(expected, actual, path, out);
    std::vector<std::string> ae = attr_names(expected, path), aa = attr_names(actual, path);
    for (const std::string& n : ae) {
      if (ignored(n)) continue;
      if (std::find(aa.begin(), aa.end(), n) == aa.end()) {
        out.push_back(attr_where(path, n) + ": missing");
        continue;
      }
      const std::string re = attr_repr(expected, path, n), ra = attr_repr(actual, path, n);
      if (re != ra) out.push_back(attr_where(path, n) + ": expected " + re + ", got " + ra);
    }
    for (const std::string& n : aa) {
      if (!ignored(n) && std::find(ae.begin(), ae.end(), n) == ae.end())
        out.push_back(attr_where(path, n) + ": unexpected");
    }
  }
  for (const auto& [path, is_ds] : oa.is_dataset) {
    if (!oe.is_dataset.count(path)) out.push_back(path + ": unexpected");
  }
  return out;
}

}  // namespace flashref::testdata::h5
