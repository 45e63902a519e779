// The HDF5 layer and the problem/fixture/result readers: round trips, files as other tools
// write them, and every error path on deliberately broken files made here.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "flashref/testdata/cases.hpp"
#include "flashref/testdata/hdf5.hpp"
#include "helpers.hpp"

namespace h5 = flashref::testdata::h5;
namespace td = flashref::testdata;
using Catch::Matchers::Contains;
using flashref::problem_error;
using flashref::test::ramp;
using flashref::test::raw_file;
using flashref::test::temp_dir;

namespace {

// A minimal valid problem: q (1, 2, 4, 8), k and v (1, 2, 6, 8).
void write_minimal_problem(h5::file& f) {
  h5::dump(f, "/inputs/q", xt::xtensor<float, 4>(xt::ones<float>({1, 2, 4, 8})));
  h5::dump(f, "/inputs/k", xt::xtensor<float, 4>(xt::ones<float>({1, 2, 6, 8})));
  h5::dump(f, "/inputs/v", xt::xtensor<float, 4>(xt::ones<float>({1, 2, 6, 8})));
}

// Writes the spec_random fixture into dir and returns its path.
std::filesystem::path write_spec_random(const temp_dir& dir) {
  const auto p = dir / "spec_random.h5";
  td::write_fixture(p, td::generate("spec_random"));
  return p;
}

}  // namespace

TEST_CASE("load and dump round-trip every element type, zero-sized dims included", "[hdf5]") {
  temp_dir dir;
  xt::xtensor<float, 4> f4 = xt::xtensor<float, 4>::from_shape({2, 1, 3, 2});
  for (std::size_t i = 0; i < f4.size(); ++i)
    f4.data()[i] = float(i) * 0.5f - 1.0f;
  xt::xtensor<double, 3> d3 = xt::xtensor<double, 3>::from_shape({1, 2, 2});
  d3 = {{{-INFINITY, 1e300}, {0.1, -0.0}}};
  const xt::xtensor<std::uint8_t, 4> u4 = {{{{0, 1, 255}}}};
  const xt::xtensor<std::int32_t, 1> i1 = {17, 0, -5};
  const xt::xtensor<std::int64_t, 2> i2 = {{-(std::int64_t(1) << 40), 3}};
  const xt::xtensor<float, 2> empty = xt::xtensor<float, 2>::from_shape({0, 4});
  {
    h5::file f = h5::file::create(dir / "a.h5");
    h5::dump(f, "/x/f4", f4);
    h5::dump(f, "/x/d3", d3);
    h5::dump(f, "/u4", u4);
    h5::dump(f, "/i1", i1);
    h5::dump(f, "/i2", i2);
    h5::dump(f, "/empty", empty);
    f.close();
  }
  const h5::file f = h5::file::open(dir / "a.h5");
  CHECK((h5::load<float, 4>(f, "/x/f4") == f4));
  const auto d = h5::load<double, 3>(f, "/x/d3");
  CHECK(d(0, 0, 0) == -INFINITY);
  CHECK(std::signbit(d(0, 1, 1)));
  CHECK(d == d3);
  CHECK((h5::load<std::uint8_t, 4>(f, "/u4") == u4));
  CHECK((h5::load<std::int32_t, 1>(f, "/i1") == i1));
  CHECK((h5::load<std::int64_t, 2>(f, "/i2") == i2));
  CHECK((h5::load<float, 2>(f, "/empty").shape(0) == 0));
  CHECK(h5::shape_of(f, "/x/f4") == std::vector<std::size_t>{2, 1, 3, 2});
  CHECK(h5::type_of(f, "/x/f4") == "float32");
  CHECK(h5::type_of(f, "/x/d3") == "float64");
  CHECK(h5::type_of(f, "/i1") == "int32");
  CHECK(f.has("/x"));
  CHECK_FALSE(f.has("/x/nope"));
  CHECK_FALSE(f.has("/nope/deeper"));
}

TEST_CASE("the compressed layout reads back the same values and takes less room", "[hdf5]") {
  temp_dir dir;
  // Values of one magnitude with zero low mantissa bits, as the fixtures' half-precision inputs.
  xt::xtensor<float, 4> x = xt::xtensor<float, 4>::from_shape({2, 2, 64, 16});
  for (std::size_t i = 0; i < x.size(); ++i)
    x.data()[i] = float(int(i * 2654435761u % 512) - 256) / 64.0f;
  xt::xtensor<double, 3> y = xt::xtensor<double, 3>::from_shape({1, 2, 700});
  for (std::size_t i = 0; i < y.size(); ++i)
    y.data()[i] = i % 7 == 0 ? -INFINITY : std::sin(double(i));
  const xt::xtensor<float, 1> small = {1.0f, -0.0f, NAN};  // below kCompressFrom: contiguous
  const xt::xtensor<float, 2> empty = xt::xtensor<float, 2>::from_shape({0, 4});
  for (h5::layout how : {h5::layout::contiguous, h5::layout::compressed}) {
    h5::file f = h5::file::create(dir / (how == h5::layout::compressed ? "c.h5" : "u.h5"));
    h5::dump(f, "/x", x, how);
    h5::dump(f, "/y", y, how);
    h5::dump(f, "/small", small, how);
    h5::dump(f, "/empty", empty, how);
    f.close();
  }
  const h5::file u = h5::file::open(dir / "u.h5"), c = h5::file::open(dir / "c.h5");
  CHECK(h5::diff(u, c, {}).empty());  // every value, bit for bit
  const auto cx = h5::load<float, 4>(c, "/x");
  CHECK(std::memcmp(cx.data(), x.data(), x.size() * sizeof(float)) == 0);
  const auto cs = h5::load<float, 1>(c, "/small");
  CHECK(std::memcmp(cs.data(), small.data(), small.size() * sizeof(float)) == 0);
  CHECK(h5::shape_of(c, "/empty") == std::vector<std::size_t>{0, 4});
  const auto bytes = [](const std::filesystem::path& p) { return std::filesystem::file_size(p); };
  CHECK(bytes(dir / "c.h5") < bytes(dir / "u.h5") / 2);
}

TEST_CASE("bad files fail with the file, the path, the expected and the actual value", "[hdf5]") {
  temp_dir dir;

  SECTION("missing file") {
    CHECK_THROWS_WITH(h5::file::open(dir / "nope.h5"),
                      Contains("nope.h5: expected an existing file, got no such file"));
    CHECK_THROWS_AS(td::read_problem(dir / "nope.h5"), problem_error);
  }
  SECTION("a folder") {
    CHECK_THROWS_WITH(h5::file::open(dir.path()), Contains("expected a file, got a folder"));
  }
  SECTION("not an HDF5 file") {
    flashref::test::write_text(dir / "text.h5", "q,k,v\n1,2,3\n");
    CHECK_THROWS_WITH(
        td::read_problem(dir / "text.h5"),
        Contains("text.h5: expected an HDF5 file, got a file without the HDF5 signature"));
  }
  SECTION("truncated file") {
    const auto p = write_spec_random(dir);
    const auto full = std::filesystem::file_size(p);
    std::filesystem::resize_file(p, full / 2);
    CHECK_THROWS_WITH(
        td::read_fixture(p),
        Contains("spec_random.h5: expected an intact HDF5 file") && Contains("truncated"));
  }
  SECTION("wrong dtype") {
    raw_file r(dir / "p.h5");
    const std::vector<std::int32_t> q(64, 1);
    r.dataset("/inputs/q", H5T_STD_I32LE, H5T_NATIVE_INT32, {1, 2, 4, 8}, q.data());
    CHECK_THROWS_WITH((h5::load<float, 4>(h5::file::open(dir / "p.h5"), "/inputs/q")),
                      Contains("p.h5:/inputs/q: expected a float type, got int32"));
  }
  SECTION("wrong rank") {
    {
      raw_file r(dir / "p.h5");
      const std::vector<float> q = ramp(64);
      r.dataset("/inputs/q", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {2, 4, 8}, q.data());
    }
    CHECK_THROWS_WITH(td::read_problem(dir / "p.h5"),
                      Contains("p.h5:/inputs/q: expected rank 4, got rank 3 ([2, 4, 8])"));
  }
  SECTION("wrong shape") {
    {
      h5::file f = h5::file::create(dir / "p.h5");
      h5::dump(f, "/inputs/q", xt::xtensor<float, 4>(xt::ones<float>({1, 2, 4, 8})));
      h5::dump(f, "/inputs/k", xt::xtensor<float, 4>(xt::ones<float>({1, 2, 6, 7})));
      h5::dump(f, "/inputs/v", xt::xtensor<float, 4>(xt::ones<float>({1, 2, 6, 8})));
      f.close();
    }
    CHECK_THROWS_WITH(td::read_problem(dir / "p.h5"),
                      Contains("p.h5: k: expected shape [1, *, *, 8], got [1, 2, 6, 7]"));
    const std::array<std::size_t, 4> transposed{1, 2, 8, 4};
    CHECK_THROWS_WITH((h5::load<float, 4>(h5::file::open(dir / "p.h5"), "/inputs/q", transposed)),
                      Contains("/inputs/q: expected shape [1, 2, 8, 4], got [1, 2, 4, 8]"));
  }
  SECTION("block mask of the wrong shape") {
    {
      h5::file f = h5::file::create(dir / "p.h5");
      write_minimal_problem(f);
      h5::dump(f, "/inputs/block_mask",
               xt::xtensor<std::uint8_t, 4>(xt::ones<std::uint8_t>({1, 2, 2, 2})));
      h5::write_attr(f, "/", "block_q", std::int64_t(2));
      h5::write_attr(f, "/", "block_k", std::int64_t(2));
      f.close();
    }
    CHECK_THROWS_WITH(td::read_problem(dir / "p.h5"),
                      Contains("p.h5: block_mask: expected shape [1, 2, 2, 3], got [1, 2, 2, 2]"));
  }
  SECTION("missing dataset") {
    {
      h5::file f = h5::file::create(dir / "p.h5");
      h5::dump(f, "/inputs/q", xt::xtensor<float, 4>(xt::ones<float>({1, 1, 1, 1})));
      h5::dump(f, "/inputs/k", xt::xtensor<float, 4>(xt::ones<float>({1, 1, 1, 1})));
      f.close();
    }
    CHECK_THROWS_WITH(td::read_problem(dir / "p.h5"),
                      Contains("p.h5:/inputs/v: expected a dataset, got nothing at this path"));
  }
  SECTION("a group where a dataset belongs") {
    {
      h5::file f = h5::file::create(dir / "p.h5");
      h5::dump(f, "/inputs/q/inner", xt::xtensor<float, 1>(xt::ones<float>({1})));
      f.close();
    }
    CHECK_THROWS_WITH(td::read_problem(dir / "p.h5"),
                      Contains("p.h5:/inputs/q: expected a dataset, got a group"));
  }
  SECTION("missing attribute") {
    const auto p = write_spec_random(dir);
    const hid_t f = H5Fopen(p.string().c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    REQUIRE(f >= 0);
    REQUIRE(H5Adelete(f, "atol") >= 0);
    H5Fclose(f);
    CHECK_THROWS_WITH(
        td::read_fixture(p),
        Contains("spec_random.h5:/ attribute 'atol': expected an attribute, got none"));
  }
  SECTION("missing golden") {
    {
      h5::file f = h5::file::create(dir / "p.h5");
      write_minimal_problem(f);
      f.close();
    }
    CHECK_NOTHROW(td::read_problem(dir / "p.h5"));     // a problem file needs no attributes ...
    CHECK_THROWS_WITH(td::read_fixture(dir / "p.h5"),  // ... a fixture does
                      Contains("attribute 'format_version': expected an attribute, got none"));
  }
  SECTION("attributes of the wrong type or size") {
    raw_file r(dir / "p.h5");
    const std::int64_t one = 1;
    const double half = 2.5;
    r.attr("causal", H5T_STD_I64LE, H5T_NATIVE_INT64, &one);
    r.attr("block_q", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &half);
    const hsize_t two = 2;
    const std::int64_t pair[2] = {1, 2};
    const hid_t space = H5Screate_simple(1, &two, nullptr);
    const hid_t a = H5Acreate2(r.id, "window_left", H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT64, pair);
    H5Aclose(a);
    H5Sclose(space);
    const std::int64_t big = 300;
    r.attr("big", H5T_STD_I64LE, H5T_NATIVE_INT64, &big);
    const std::int64_t neg = -1;
    r.attr("neg", H5T_STD_I64LE, H5T_NATIVE_INT64, &neg);
    H5Fflush(r.id, H5F_SCOPE_GLOBAL);
    const h5::file f = h5::file::open(dir / "p.h5");
    CHECK_THROWS_WITH(h5::read_string_attr(f, "/", "causal"),
                      Contains("p.h5:/ attribute 'causal': expected a string, got int64"));
    CHECK_THROWS_WITH(h5::read_int_attr(f, "/", "block_q"),
                      Contains("attribute 'block_q': expected an integer, got float64"));
    CHECK_THROWS_WITH(h5::read_int_attr(f, "/", "window_left"),
                      Contains("attribute 'window_left': expected a single value, got [2]"));
    CHECK_THROWS_WITH(h5::read_uint_attr(f, "/", "neg"),
                      Contains("attribute 'neg': expected values that fit uint64, got -1"));
    CHECK(h5::read_float_attr(f, "/", "big") == 300.0);  // an integer is a number too
  }
  SECTION("integer values that do not fit") {
    {
      raw_file r(dir / "p.h5");
      const std::vector<std::int32_t> m = {0, 1, 300, 1};
      r.dataset("/m", H5T_STD_I32LE, H5T_NATIVE_INT32, {4}, m.data());
      const std::vector<std::int64_t> kv = {std::int64_t(1) << 40};
      r.dataset("/kv", H5T_STD_I64LE, H5T_NATIVE_INT64, {1}, kv.data());
    }
    const h5::file f = h5::file::open(dir / "p.h5");
    CHECK_THROWS_WITH((h5::load<std::uint8_t, 1>(f, "/m")),
                      Contains("p.h5:/m: expected values that fit uint8, got 300 at flat index 2"));
    CHECK_THROWS_WITH((h5::load<std::int32_t, 1>(f, "/kv")),
                      Contains("expected values that fit int32, got 1099511627776"));
  }
  SECTION("a block mask without block sizes, kv_len out of range, unrepresentable half inputs") {
    {
      h5::file f = h5::file::create(dir / "mask.h5");
      write_minimal_problem(f);
      h5::dump(f, "/inputs/block_mask",
               xt::xtensor<std::uint8_t, 4>(xt::ones<std::uint8_t>({1, 1, 1, 1})));
      f.close();
      h5::file g = h5::file::create(dir / "kv.h5");
      write_minimal_problem(g);
      h5::dump(g, "/inputs/kv_len", xt::xtensor<std::int32_t, 1>({9}));
      g.close();
      h5::file b = h5::file::create(dir / "bf16.h5");
      h5::dump(b, "/inputs/q", xt::xtensor<float, 4>(xt::ones<float>({1, 2, 4, 8}) * 0.1f));
      h5::dump(b, "/inputs/k", xt::xtensor<float, 4>(xt::ones<float>({1, 2, 6, 8})));
      h5::dump(b, "/inputs/v", xt::xtensor<float, 4>(xt::ones<float>({1, 2, 6, 8})));
      h5::write_attr(b, "/", "input_dtype", "bfloat16");
      b.close();
    }
    CHECK_THROWS_WITH(
        td::read_problem(dir / "mask.h5"),
        Contains("positive block sizes for /inputs/block_mask, got block_q = 0, block_k = 0"));
    CHECK_THROWS_WITH(td::read_problem(dir / "kv.h5"),
                      Contains("kv.h5: kv_len[0]: expected a value in [0, 6], got 9"));
    CHECK_THROWS_WITH(td::read_problem(dir / "bf16.h5"),
                      Contains("bf16.h5:/inputs/q: expected values representable in bfloat16 "
                               "(input_dtype), got 0.100000001 at flat index 0"));
  }
  SECTION("a result of the wrong shape") {
    const auto fx = td::generate("gqa");
    {
      h5::file f = h5::file::create(dir / "r.h5");
      h5::dump(f, "/o", xt::xtensor<float, 4>(xt::zeros<float>({1, 2, 16, 16})));
      h5::dump(f, "/lse", xt::xtensor<float, 3>(xt::zeros<float>({1, 8, 16})));
      f.close();
    }
    CHECK_THROWS_WITH(td::read_result(dir / "r.h5", fx.golden),
                      Contains("r.h5:/o: expected shape [1, 8, 16, 16], got [1, 2, 16, 16]"));
  }
}

TEST_CASE("problem files as h5py and other tools write them", "[hdf5]") {
  temp_dir dir;
  const auto path = dir / "p.h5";
  const std::vector<float> q = ramp(1 * 2 * 4 * 8), kv = ramp(1 * 1 * 6 * 8);
  {
    raw_file r(path);
    // q as float16 (h5py's numpy.float16), k as float64, v as float32.
    const flashref::test::float16_type f16;
    r.dataset("/inputs/q", f16.id, H5T_NATIVE_FLOAT, {1, 2, 4, 8}, q.data());
    r.dataset("/inputs/k", H5T_IEEE_F64LE, H5T_NATIVE_FLOAT, {1, 1, 6, 8}, kv.data());
    r.dataset("/inputs/v", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {1, 1, 6, 8}, kv.data());
    // The block mask as h5py writes numpy bool: an enum over int8 with FALSE = 0, TRUE = 1.
    const hid_t b = H5Tenum_create(H5T_NATIVE_INT8);
    std::int8_t v0 = 0, v1 = 1;
    H5Tenum_insert(b, "FALSE", &v0);
    H5Tenum_insert(b, "TRUE", &v1);
    const std::vector<std::int8_t> mask = {1, 0, 0, 1, 1, 1, 0, 0};  // (1, 2, 2, 2)
    r.dataset("/inputs/block_mask", b, b, {1, 2, 2, 2}, mask.data());
    H5Tclose(b);
    const std::vector<std::int64_t> kv_len = {5};
    r.dataset("/inputs/kv_len", H5T_STD_I64BE, H5T_NATIVE_INT64, {1}, kv_len.data());
    r.dataset("/golden/ignored", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {2}, q.data());
    const std::uint16_t block_q = 2, block_k = 3;
    r.attr("block_q", H5T_STD_U16LE, H5T_NATIVE_UINT16, &block_q);
    r.attr("block_k", H5T_STD_U16LE, H5T_NATIVE_UINT16, &block_k);
    const std::int8_t left = 2;
    r.attr("window_left", H5T_STD_I8LE, H5T_NATIVE_INT8, &left);
    const std::int32_t scale = 2;  // an integer scale is a number too
    r.attr("scale", H5T_STD_I32LE, H5T_NATIVE_INT32, &scale);
    r.fixed_string_attr("causal", "top_left", 16, H5T_STR_NULLPAD);
    r.fixed_string_attr("input_dtype", "float16", 12, H5T_STR_SPACEPAD);
  }
  const flashref::problem_data in = td::read_problem(path);
  CHECK(in.q.shape(1) == 2);
  CHECK(in.k.shape(1) == 1);  // MQA
  CHECK(in.q(0, 1, 3, 7) == q.back());
  CHECK(in.k(0, 0, 5, 7) == kv.back());
  CHECK((in.opt.block_mask == xt::xtensor<std::uint8_t, 4>{{{{1, 0}, {0, 1}}, {{1, 1}, {0, 0}}}}));
  CHECK(in.opt.block_q == 2);
  CHECK(in.opt.block_k == 3);
  CHECK(in.opt.kv_len == std::vector<std::int32_t>{5});
  CHECK(in.opt.window_left == 2);
  CHECK(in.opt.window_right == -1);
  CHECK(in.opt.scale.value() == 2.0);
  CHECK(in.opt.causal == flashref::causal_mode::top_left);
  CHECK(in.opt.dtype == flashref::input_dtype::float16);

  SECTION("a problem file with nothing but q, k, v takes every default") {
    {
      h5::file f = h5::file::create(dir / "bare.h5");
      write_minimal_problem(f);
      f.close();
    }
    const flashref::problem_data bare = td::read_problem(dir / "bare.h5");
    CHECK_FALSE(bare.opt.scale.has_value());
    CHECK(bare.opt.causal == flashref::causal_mode::none);
    CHECK(bare.opt.window_left == -1);
    CHECK(bare.opt.window_right == -1);
    CHECK(bare.opt.block_q == 0);
    CHECK(bare.opt.block_mask.size() == 0);
    CHECK(bare.opt.kv_len.empty());
    CHECK(bare.opt.dtype == flashref::input_dtype::float32);
  }
}

TEST_CASE("string attributes: variable-length UTF-8, fixed-length null- and space-padded",
          "[hdf5]") {
  temp_dir dir;
  {
    h5::file f = h5::file::create(dir / "s.h5");
    h5::write_attr(f, "/", "v", std::string("sliding window \xe2\x80\x94 left"));
    h5::write_attr(f, "/", "v", std::string("replaced"));  // rewriting replaces
    f.close();
  }
  {
    const hid_t id = H5Fopen((dir / "s.h5").string().c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    const hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, 8);
    H5Tset_strpad(t, H5T_STR_NULLTERM);
    const hid_t s = H5Screate(H5S_SCALAR);
    const hid_t a = H5Acreate2(id, "nullterm", t, s, H5P_DEFAULT, H5P_DEFAULT);
    const char text[8] = {'a', 'b', 'c', '\0', 'x', 'x', 'x', '\0'};
    H5Awrite(a, t, text);
    H5Aclose(a);
    H5Sclose(s);
    H5Tclose(t);
    H5Fclose(id);
  }
  const h5::file f = h5::file::open(dir / "s.h5");
  CHECK(h5::read_string_attr(f, "/", "v") == "replaced");
  CHECK(h5::read_string_attr(f, "/", "nullterm") == "abc");
  CHECK_FALSE(h5::has_attr(f, "/", "absent"));
  CHECK_FALSE(h5::has_attr(f, "/no/such/group", "v"));
}

TEST_CASE("write_atomically leaves the old file or nothing, never a partial file", "[hdf5]") {
  temp_dir dir;
  const auto path = dir / "out.h5";
  SECTION("a failing writer leaves no file and no temporary") {
    CHECK_THROWS_WITH(h5::write_atomically(path,
                                           [](h5::file& f) {
                                             write_minimal_problem(f);
                                             f.fail("/inputs", "the writer to finish", "a failure");
                                           }),
                      Contains("the writer to finish"));
    CHECK(dir.entries().empty());
  }
  SECTION("a failing writer leaves the previous version untouched") {
    h5::write_atomically(path, [](h5::file& f) { write_minimal_problem(f); });
    const std::string before = flashref::test::read_text(path);
    CHECK_THROWS(h5::write_atomically(path, [](h5::file& f) {
      h5::dump(f, "/x", xt::xtensor<double, 1>({1.0}));
      throw std::runtime_error("interrupted");
    }));
    CHECK(flashref::test::read_text(path) == before);
    CHECK(dir.entries() == std::vector<std::string>{"out.h5"});
    CHECK_NOTHROW(td::read_problem(path));
  }
  SECTION("a missing folder is refused before anything is written") {
    CHECK_THROWS_WITH(h5::write_atomically(dir / "no" / "out.h5", [](h5::file&) {}),
                      Contains("expected a path in an existing folder"));
  }
  SECTION("success: the file is in place with the usual permissions") {
    h5::write_atomically(path, [](h5::file& f) { write_minimal_problem(f); });
    CHECK(dir.entries() == std::vector<std::string>{"out.h5"});
    const auto perms = std::filesystem::status(path).permissions();
    CHECK((perms & std::filesystem::perms::owner_read) != std::filesystem::perms::none);
    CHECK((perms & std::filesystem::perms::others_read) != std::filesystem::perms::none);
  }
}

TEST_CASE("diff finds one changed bit and names the dataset, the element and the values",
          "[hdf5]") {
  temp_dir dir;
  const td::fixture fx = td::generate("kv_len_zero");
  td::write_fixture(dir / "a.h5", fx);
  td::fixture changed = fx;
  changed.golden.o[37] = std::nextafter(changed.golden.o[37], 2.0);
  changed.seed = fx.seed + 1;
  changed.generator = "something else";
  td::write_fixture(dir / "b.h5", changed);
  const h5::file a = h5::file::open(dir / "a.h5"), b = h5::file::open(dir / "b.h5");
  CHECK(h5::diff(a, a).empty());
  const std::vector<std::string> d = h5::diff(a, b, {"generator"});
  REQUIRE(d.size() == 2);
  CHECK_THAT(d[0], Contains("/ attribute 'seed': expected uint64 501, got uint64 502"));
  CHECK_THAT(d[1], Contains("/golden/o: 1 of 768 elements differ, first at [0, 0, 2, 5]"));
  CHECK(h5::diff(a, b).size() == 3);  // generator compared unless ignored

  td::fixture fewer = fx;
  fewer.in.opt.kv_len.clear();
  td::write_fixture(dir / "c.h5", fewer);
  const std::vector<std::string> e = h5::diff(a, h5::file::open(dir / "c.h5"), {"generator"});
  CHECK(std::find(e.begin(), e.end(), "/inputs/kv_len: missing") != e.end());
}
