#pragma once
// Test helpers: a private temporary folder, and HDF5 files written through the C API with the
// types other tools produce (h5py's bool enum, float16, fixed-length strings, odd integers).

#include <hdf5.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "flashref/testdata/files.hpp"
#include "flashref/testdata/fixture.hpp"

namespace flashref::test {

namespace fs = std::filesystem;

using temp_dir = testdata::temp_folder;  // a private temporary folder

inline fs::path testdata_dir() {
  return FLASHREF_TESTDATA_DIR;
}

inline std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_text(const fs::path& p, const std::string& s) {
  std::ofstream(p, std::ios::binary) << s;
}

// A raw HDF5 handle for building files by hand in the tests.
struct raw_file {
  hid_t id;
  explicit raw_file(const fs::path& p)
      : id(H5Fcreate(p.string().c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT)) {
    if (id < 0) throw std::runtime_error("H5Fcreate failed");
  }
  raw_file(const raw_file&) = delete;
  raw_file& operator=(const raw_file&) = delete;
  ~raw_file() { H5Fclose(id); }

  // A dataset of file type `disk` holding `data` given in memory type `mem`.
  void dataset(const std::string& path, hid_t disk, hid_t mem, const std::vector<hsize_t>& dims,
               const void* data) {
    const hid_t space = H5Screate_simple(int(dims.size()), dims.data(), nullptr);
    const hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
    H5Pset_create_intermediate_group(lcpl, 1);
    const hid_t d = H5Dcreate2(id, path.c_str(), disk, space, lcpl, H5P_DEFAULT, H5P_DEFAULT);
    if (d < 0 || H5Dwrite(d, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
      throw std::runtime_error("dataset " + path);
    H5Dclose(d);
    H5Pclose(lcpl);
    H5Sclose(space);
  }
  void attr(const char* name, hid_t disk, hid_t mem, const void* value) {
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t a = H5Acreate2(id, name, disk, space, H5P_DEFAULT, H5P_DEFAULT);
    if (a < 0 || H5Awrite(a, mem, value) < 0) throw std::runtime_error(std::string("attr ") + name);
    H5Aclose(a);
    H5Sclose(space);
  }
  // A fixed-length string attribute with the given padding (what numpy's bytes_ gives).
  void fixed_string_attr(const char* name, const std::string& value, std::size_t size,
                         H5T_str_t pad) {
    const hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, size);
    H5Tset_strpad(t, pad);
    std::string buf = value;
    buf.resize(size, pad == H5T_STR_SPACEPAD ? ' ' : '\0');
    attr(name, t, t, buf.data());
    H5Tclose(t);
  }
};

// IEEE half precision as h5py writes numpy.float16 (HDF5 1.10 has no predefined one).
struct float16_type {
  hid_t id;
  float16_type() : id(H5Tcopy(H5T_IEEE_F32LE)) {
    H5Tset_fields(id, 15, 10, 5, 0, 10);
    H5Tset_size(id, 2);
    H5Tset_ebias(id, 15);
  }
  float16_type(const float16_type&) = delete;
  float16_type& operator=(const float16_type&) = delete;
  ~float16_type() { H5Tclose(id); }
};

// A result file with /o and /lse stored in the given HDF5 file types.
inline void write_result_as(const fs::path& p, const testdata::result& r, hid_t o_type,
                            hid_t lse_type) {
  raw_file f(p);
  const std::vector<hsize_t> os(r.o.shape().begin(), r.o.shape().end()),
      ls(r.lse.shape().begin(), r.lse.shape().end());
  f.dataset("/o", o_type, H5T_NATIVE_DOUBLE, os, r.o.data());
  f.dataset("/lse", lse_type, H5T_NATIVE_DOUBLE, ls, r.lse.data());
}

// Random-ish float32 values (exact in float16 and bfloat16) for hand-made files.
inline std::vector<float> ramp(std::size_t n) {
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i)
    x[i] = float(int(i % 7) - 3) * 0.25f;
  return x;
}

}  // namespace flashref::test
