#include "flashref/testdata/fixture.hpp"

#include <bit>
#include <cmath>
#include <cstdio>
#include <type_traits>
#include <vector>

#include <xtensor/xadapt.hpp>

#include "flashref/reference/limits.hpp"
#include "flashref/reference/mask.hpp"

namespace flashref::testdata {

namespace {

constexpr const char* kRoot = "/";

std::string opt_string(const h5::file& f, const char* name, const char* fallback) {
  return h5::has_attr(f, kRoot, name) ? h5::read_string_attr(f, kRoot, name) : fallback;
}

std::int64_t opt_int(const h5::file& f, const char* name, std::int64_t fallback) {
  return h5::has_attr(f, kRoot, name) ? h5::read_int_attr(f, kRoot, name) : fallback;
}

// A bfloat16/float16 problem promises inputs exactly representable in that dtype (SPEC §6):
// a backend may convert them without loss.
void check_representable(const h5::file& f, const char* path, const xt::xtensor<float, 4>& x,
                         input_dtype dtype) {
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float v = x.data()[i];
    if (!std::isnan(v) && round_to(dtype, v) != v) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.9g", double(v));
      f.fail(path, std::string("values representable in ") + to_string(dtype) + " (input_dtype)",
             std::string(buf) + " at flat index " + std::to_string(i));
    }
  }
}

// The product of a dataset's dims, or nothing on overflow.
std::optional<std::uint64_t> count_of(const std::vector<std::size_t>& dims) {
  std::optional<std::uint64_t> n = 1;
  for (const std::size_t d : dims)
    n = n ? checked_product({*n, std::uint64_t(d)}) : n;
  return n;
}

std::string dims_str(const std::vector<std::size_t>& dims) {
  std::string s = "[";
  for (std::size_t d = 0; d < dims.size(); ++d)
    s += (d ? ", " : "") + std::to_string(dims[d]);
  return s + "]";
}

// What reading the problem (and, for a fixture, its golden float64 O and LSE) will allocate,
// from the datasets' declared shapes alone, checked against the memory budget before any
// dataset is read: q, k, v as float32, O and LSE as float32 for the result, the block mask
// (and the 64-bit buffer its integers are range-checked through).
void check_problem_memory(const h5::file& f, bool with_golden) {
  // A dataset that is missing or malformed counts as empty here: loading it reports that, in
  // the readers' own order (q before k before v).
  const auto declared = [&](const char* path) {
    try {
      return h5::shape_of(f, path);
    } catch (const problem_error&) {
      return std::vector<std::size_t>{};
    }
  };
  const auto q = declared("/inputs/q"), k = declared("/inputs/k"), v = declared("/inputs/v");
  std::vector<std::optional<std::uint64_t>> parts = {checked_product({count_of(q).value_or(0), 4}),
                                                     checked_product({count_of(k).value_or(0), 4}),
                                                     checked_product({count_of(v).value_or(0), 4})};
  for (const auto* d : {&q, &k, &v})
    if (!count_of(*d)) parts.push_back(std::nullopt);
  if (q.size() == 4 && v.size() == 4) {  // O (B, Hq, Lq, Dv) and LSE (B, Hq, Lq)
    const std::uint64_t per_value = with_golden ? 4 + 8 : 4;
    parts.push_back(checked_product({q[0], q[1], q[2], v[3], per_value}));
    parts.push_back(checked_product({q[0], q[1], q[2], per_value}));
    if (f.has("/inputs/do"))  // the backward's upstream gradient, O's shape in float32
      parts.push_back(checked_product({q[0], q[1], q[2], v[3], 4}));
  }
  if (with_golden && f.has("/golden/dq")) {  // float64 dQ, dK, dV: the shapes of q, k, v
    for (const auto* d : {&q, &k, &v})
      parts.push_back(count_of(*d) ? checked_product({*count_of(*d), 8}) : std::nullopt);
  }
  if (f.has("/inputs/block_mask")) {
    const auto m = count_of(declared("/inputs/block_mask"));
    parts.push_back(m ? checked_product({*m, 1 + 8}) : std::nullopt);
  }
  std::optional<std::uint64_t> total = 0;
  for (const auto& p : parts)
    total = total && p ? checked_sum({*total, *p}) : std::nullopt;
  check_allocation(f.name() + ": the problem's storage", total,
                   "q " + dims_str(q) + ", k " + dims_str(k) + ", v " + dims_str(v) +
                       (with_golden ? ", their outputs and the golden float64 O and LSE"
                                    : " and their outputs"));
}

problem_data read_problem_impl(const h5::file& f, bool with_golden) {
  check_problem_memory(f, with_golden);
  problem_data in;
  in.q = h5::load<float, 4>(f, "/inputs/q");
  in.k = h5::load<float, 4>(f, "/inputs/k");
  in.v = h5::load<float, 4>(f, "/inputs/v");
  attention_options& opt = in.opt;
  if (h5::has_attr(f, kRoot, "scale")) opt.scale = h5::read_float_attr(f, kRoot, "scale");
  opt.causal = parse_causal(opt_string(f, "causal", "none"));
  opt.window_left = opt_int(f, "window_left", -1);
  opt.window_right = opt_int(f, "window_right", -1);
  opt.dtype = parse_input_dtype(opt_string(f, "input_dtype", "float32"));
  const std::int64_t block_q = opt_int(f, "block_q", 0), block_k = opt_int(f, "block_k", 0);
  const bool has_mask = f.has("/inputs/block_mask");
  if (block_q != 0 || block_k != 0 || has_mask) {
    const std::string blocks =
        "block_q = " + std::to_string(block_q) + ", block_k = " + std::to_string(block_k);
    if (!has_mask) f.fail("/inputs/block_mask", "a dataset (" + blocks + ")", "nothing");
    if (block_q <= 0 || block_k <= 0) {  // a mask needs its block sizes
      f.fail("/ attributes block_q, block_k", "positive block sizes for /inputs/block_mask",
             blocks);
    }
    opt.block_mask = h5::load<std::uint8_t, 4>(f, "/inputs/block_mask");
    opt.block_q = block_q;
    opt.block_k = block_k;
  }
  if (f.has("/inputs/kv_len")) {
    const auto kv = h5::load<std::int32_t, 1>(f, "/inputs/kv_len");
    opt.kv_len.assign(kv.begin(), kv.end());
  }
  validate(in.problem());     // shapes, masks and kv_len
  if (f.has("/inputs/do")) {  // the backward's upstream gradient: O's shape
    in.d_o = h5::load<float, 4>(f, "/inputs/do",
                                {in.q.shape(0), in.q.shape(1), in.q.shape(2), in.v.shape(3)});
  }
  if (opt.dtype != input_dtype::float32) {
    check_representable(f, "/inputs/q", in.q, opt.dtype);
    check_representable(f, "/inputs/k", in.k, opt.dtype);
    check_representable(f, "/inputs/v", in.v, opt.dtype);
    if (in.d_o.size() > 0) check_representable(f, "/inputs/do", in.d_o, opt.dtype);
  }
  return in;
}

std::array<std::size_t, 4> o_shape(const problem_data& in) {
  return {in.q.shape(0), in.q.shape(1), in.q.shape(2), in.v.shape(3)};
}

std::array<std::size_t, 3> lse_shape(const problem_data& in) {
  return {in.q.shape(0), in.q.shape(1), in.q.shape(2)};
}

std::array<std::size_t, 4> shape_of(const std::array<std::int64_t, 4>& s) {
  return {std::size_t(s[0]), std::size_t(s[1]), std::size_t(s[2]), std::size_t(s[3])};
}

std::array<std::int64_t, 4> dims_of(const xt::xtensor<float, 4>& x) {
  return {std::int64_t(x.shape(0)), std::int64_t(x.shape(1)), std::int64_t(x.shape(2)),
          std::int64_t(x.shape(3))};
}

std::vector<double> load_flat(const h5::file& f, const char* path,
                              const std::array<std::int64_t, 4>& shape) {
  const auto x = h5::load<double, 4>(f, path, shape_of(shape));
  return {x.begin(), x.end()};
}

}  // namespace

float round_to(input_dtype dtype, float x) {
  if (dtype == input_dtype::float32 || !std::isfinite(x)) return x;
  std::uint32_t b = std::bit_cast<std::uint32_t>(x);
  if (dtype == input_dtype::bfloat16) {  // keep the top 16 bits, round to nearest even
    b += 0x7fffu + ((b >> 16) & 1u);
    return std::bit_cast<float>(b & 0xffff0000u);
  }
  // float16: 10 fraction bits down to 2^-14, then a fixed quantum of 2^-24 (subnormals).
  if (std::fabs(x) < 0x1p-14f) return std::nearbyint(x * 0x1p24f) * 0x1p-24f;
  b += 0xfffu + ((b >> 13) & 1u);
  const float r = std::bit_cast<float>(b & ~0x1fffu);
  return std::fabs(r) > 65504.0f ? std::copysign(INFINITY, x) : r;
}

// read_problem, with the golden result's storage in the memory check when with_golden.
static problem_data read_problem_for(const h5::file& f, bool with_golden) {
  try {
    return read_problem_impl(f, with_golden);
  } catch (const problem_error& e) {
    const std::string msg = e.what();
    if (msg.rfind(f.name() + ":", 0) == 0) throw;
    throw problem_error(f.name() + ": " + msg);  // a validation message: name the file too
  }
}

problem_data read_problem(const h5::file& f) {
  return read_problem_for(f, /*with_golden=*/false);
}

problem_data read_problem(const std::filesystem::path& path) {
  return read_problem(h5::file::open(path));
}

fixture read_fixture(const std::filesystem::path& path) {
  return read_fixture(h5::file::open(path));
}

fixture read_fixture(const h5::file& f) {
  fixture fx;
  fx.in = read_problem_for(f, /*with_golden=*/true);
  const std::int64_t version = h5::read_int_attr(f, kRoot, "format_version");
  if (version < 1 || version > kFormatVersion) {
    f.fail("/ attribute 'format_version'", "1.." + std::to_string(kFormatVersion),
           std::to_string(version));
  }
  fx.name = h5::read_string_attr(f, kRoot, "case");
  fx.description = h5::read_string_attr(f, kRoot, "description");
  fx.generator = h5::read_string_attr(f, kRoot, "generator");
  fx.seed = h5::read_uint_attr(f, kRoot, "seed");
  fx.twin_of = opt_string(f, "twin_of", "");
  fx.tol.atol = h5::read_float_attr(f, kRoot, "atol");
  fx.tol.rtol = h5::read_float_attr(f, kRoot, "rtol");
  fx.tol.atol_lse = h5::read_float_attr(f, kRoot, "atol_lse");
  const auto os = o_shape(fx.in);
  const auto o = h5::load<double, 4>(f, "/golden/o", os);
  const auto lse = h5::load<double, 3>(f, "/golden/lse", lse_shape(fx.in));
  for (std::size_t d = 0; d < 4; ++d)
    fx.golden.o_shape[d] = std::int64_t(os[d]);
  fx.golden.o.assign(o.begin(), o.end());
  fx.golden.lse.assign(lse.begin(), lse.end());
  if (f.has("/golden/dq") || f.has("/golden/dk") || f.has("/golden/dv")) {
    if (fx.in.d_o.size() == 0 && o_shape(fx.in)[3] * o_shape(fx.in)[2] > 0)
      f.fail("/inputs/do", "the upstream gradient of /golden/dq, dk, dv", "nothing");
    reference::golden_gradients g;
    g.q_shape = dims_of(fx.in.q);
    g.k_shape = dims_of(fx.in.k);
    g.v_shape = dims_of(fx.in.v);
    g.dq = load_flat(f, "/golden/dq", g.q_shape);
    g.dk = load_flat(f, "/golden/dk", g.k_shape);
    g.dv = load_flat(f, "/golden/dv", g.v_shape);
    // Empty rows and unseen keys are not stored: the golden forward and the mask give them.
    const reference::golden_gradients flags =
        reference::naive_attention_backward(fx.in.inputs(), fx.in.gradients().d_o);
    g.row_empty = flags.row_empty;
    g.key_unseen = flags.key_unseen;
    fx.grads = std::move(g);
  }
  if (f.has("/trace")) {
    // The trace's length is its own (one entry per tile): bounded before it is read.
    const std::vector<std::size_t> tiles = h5::shape_of(f, "/trace/m");
    const std::optional<std::uint64_t> n = count_of(tiles);
    check_allocation(f.name() + ":/trace", n ? checked_product({*n, 3 * 8}) : std::nullopt,
                     "/trace/m, s and exp_old of " + dims_str(tiles) + " float64 values");
    spec_trace t;
    t.tile = h5::read_int_attr(f, "/trace", "tile");
    t.m = h5::load<double, 1>(f, "/trace/m");
    t.s = h5::load<double, 1>(f, "/trace/s", {t.m.size()});
    t.exp_old = h5::load<double, 1>(f, "/trace/exp_old", {t.m.size()});
    fx.trace = std::move(t);
  }
  return fx;
}

void write_fixture(const std::filesystem::path& path, const fixture& fx) {
  // Every dataset of 1 KiB or more compressed: the committed folder stays under its size
  // budget (tests/testdata/test_fixtures.cpp), and any HDF5 reader gets the same values.
  constexpr h5::layout kLayout = h5::layout::compressed;
  const attention_problem p = fx.in.inputs();
  const attention_options& opt = fx.in.opt;
  h5::write_atomically(path, [&](h5::file& f) {
    h5::write_attr(f, kRoot, "format_version", kFormatVersion);
    h5::write_attr(f, kRoot, "case", fx.name);
    h5::write_attr(f, kRoot, "description", fx.description);
    h5::write_attr(f, kRoot, "seed", fx.seed);
    h5::write_attr(f, kRoot, "generator", fx.generator);
    if (!fx.twin_of.empty()) h5::write_attr(f, kRoot, "twin_of", fx.twin_of);
    h5::write_attr(f, kRoot, "scale", p.softmax_scale());
    h5::write_attr(f, kRoot, "causal", to_string(opt.causal));
    h5::write_attr(f, kRoot, "window_left", opt.window_left);
    h5::write_attr(f, kRoot, "window_right", opt.window_right);
    h5::write_attr(f, kRoot, "block_q", opt.block_q);
    h5::write_attr(f, kRoot, "block_k", opt.block_k);
    h5::write_attr(f, kRoot, "input_dtype", to_string(opt.dtype));
    h5::write_attr(f, kRoot, "atol", fx.tol.atol);
    h5::write_attr(f, kRoot, "rtol", fx.tol.rtol);
    h5::write_attr(f, kRoot, "atol_lse", fx.tol.atol_lse);
    h5::dump(f, "/inputs/q", fx.in.q, kLayout);
    h5::dump(f, "/inputs/k", fx.in.k, kLayout);
    h5::dump(f, "/inputs/v", fx.in.v, kLayout);
    if (p.has_block_mask()) h5::dump(f, "/inputs/block_mask", opt.block_mask, kLayout);
    if (!opt.kv_len.empty()) {
      h5::dump(f, "/inputs/kv_len",
               xt::xtensor<std::int32_t, 1>(xt::adapt(opt.kv_len, {opt.kv_len.size()})), kLayout);
    }
    const auto os = o_shape(fx.in);
    h5::dump(f, "/golden/o", xt::xtensor<double, 4>(xt::adapt(fx.golden.o, os)), kLayout);
    h5::dump(f, "/golden/lse", xt::xtensor<double, 3>(xt::adapt(fx.golden.lse, lse_shape(fx.in))),
             kLayout);
    if (fx.grads) {
      h5::dump(f, "/inputs/do", fx.in.d_o, kLayout);
      h5::dump(f, "/golden/dq",
               xt::xtensor<double, 4>(xt::adapt(fx.grads->dq, shape_of(fx.grads->q_shape))),
               kLayout);
      h5::dump(f, "/golden/dk",
               xt::xtensor<double, 4>(xt::adapt(fx.grads->dk, shape_of(fx.grads->k_shape))),
               kLayout);
      h5::dump(f, "/golden/dv",
               xt::xtensor<double, 4>(xt::adapt(fx.grads->dv, shape_of(fx.grads->v_shape))),
               kLayout);
    }
    if (fx.trace) {
      h5::dump(f, "/trace/m", fx.trace->m, kLayout);
      h5::dump(f, "/trace/s", fx.trace->s, kLayout);
      h5::dump(f, "/trace/exp_old", fx.trace->exp_old, kLayout);
      h5::write_attr(f, "/trace", "tile", fx.trace->tile);
    }
  });
}

spec_row spec_row_of(const attention_problem& p, std::int64_t b, std::int64_t h, std::int64_t i) {
  // The row must exist: its index reads Q directly.
  if (b < 0 || b >= p.batch() || h < 0 || h >= p.heads_q() || i < 0 || i >= p.len_q()) {
    throw problem_error("row: expected (b, h, i) below (" + std::to_string(p.batch()) + ", " +
                        std::to_string(p.heads_q()) + ", " + std::to_string(p.len_q()) +
                        "), got (" + std::to_string(b) + ", " + std::to_string(h) + ", " +
                        std::to_string(i) + ")");
  }
  const mask_spec mask = make_mask_spec(p);
  const std::int64_t hk = h / p.group_size();
  const std::size_t Lk = std::size_t(p.len_k()), D = std::size_t(p.head_dim()),
                    Dv = std::size_t(p.head_dim_v());
  spec_row r;
  r.q = xt::xtensor<double, 1>::from_shape({D});
  r.K = xt::xtensor<double, 2>::from_shape({Lk, D});
  r.V = xt::xtensor<double, 2>::from_shape({Lk, Dv});
  r.key_mask = xt::xtensor<std::uint8_t, 1>::from_shape({Lk});
  for (std::size_t d = 0; d < D; ++d)
    r.q(d) = p.q(b, h, i, d);
  for (std::size_t j = 0; j < Lk; ++j) {
    for (std::size_t d = 0; d < D; ++d)
      r.K(j, d) = p.k(b, hk, j, d);
    for (std::size_t d = 0; d < Dv; ++d)
      r.V(j, d) = p.v(b, hk, j, d);
    r.key_mask(j) = mask.visible(b, h, i, std::int64_t(j));
  }
  r.scale = p.softmax_scale();
  return r;
}

namespace {

// FNV-1a, 64-bit (Fowler, Noll, Vo): simple, byte-order free, and enough to tell fixtures apart.
class fnv1a {
 public:
  void bytes(const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i)
      h_ = (h_ ^ b[i]) * 0x100000001b3ULL;
  }
  // Integers and floats as 8 little-endian bytes, so that the layout is the same everywhere.
  void u64(std::uint64_t x) {
    for (int i = 0; i < 8; ++i) {
      const unsigned char c = static_cast<unsigned char>(x >> (8 * i));
      bytes(&c, 1);
    }
  }
  void i64(std::int64_t x) { u64(static_cast<std::uint64_t>(x)); }
  void f64(double x) { u64(std::bit_cast<std::uint64_t>(x)); }
  void text(const std::string& s) {
    u64(s.size());
    bytes(s.data(), s.size());
  }
  template <class T, std::size_t R>
  void tensor(const xt::xtensor<T, R>& x) {
    u64(R);
    for (std::size_t d : x.shape())
      u64(d);
    for (const T v : x) {
      if constexpr (std::is_same_v<T, float>) {
        const std::uint32_t b = std::bit_cast<std::uint32_t>(v);
        for (int i = 0; i < 4; ++i) {
          const unsigned char c = static_cast<unsigned char>(b >> (8 * i));
          bytes(&c, 1);
        }
      } else {
        const unsigned char c = v != 0;  // a mask: visible or not
        bytes(&c, 1);
      }
    }
  }
  std::string hex() const {
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h_));
    return buf;
  }

 private:
  std::uint64_t h_ = 0xcbf29ce484222325ULL;
};

std::optional<std::string> attr_if_present(const h5::file& f, const char* name) {
  if (!h5::has_attr(f, kRoot, name)) return std::nullopt;
  return h5::read_string_attr(f, kRoot, name);
}

}  // namespace

std::string inputs_digest(const problem_data& in) {
  const attention_problem p = in.inputs();
  const attention_options& opt = in.opt;
  fnv1a h;
  h.tensor(in.q);
  h.tensor(in.k);
  h.tensor(in.v);
  h.f64(p.softmax_scale());
  h.text(to_string(opt.causal));
  h.i64(opt.window_left);
  h.i64(opt.window_right);
  h.i64(p.has_block_mask() ? opt.block_q : 0);
  h.i64(p.has_block_mask() ? opt.block_k : 0);
  if (p.has_block_mask()) h.tensor(opt.block_mask);
  h.u64(opt.kv_len.size());
  for (const std::int64_t n : opt.kv_len)
    h.i64(n);
  h.text(to_string(opt.dtype));
  return h.hex();
}

result_info read_result_info(const std::filesystem::path& path) {
  return read_result_info(h5::file::open(path));
}

result_info read_result_info(const h5::file& f) {
  result_info info;
  info.case_name = attr_if_present(f, "case");
  info.inputs_digest = attr_if_present(f, "inputs_digest");
  info.backend = attr_if_present(f, "backend");
  info.o_dtype = h5::type_of(f, "/o");
  if (f.has("/lse")) info.lse_dtype = h5::type_of(f, "/lse");
  return info;
}

result read_result(const std::filesystem::path& path, const reference::golden& golden,
                   const reference::golden_gradients* grads) {
  return read_result(h5::file::open(path), golden, grads);
}

result read_result(const h5::file& f, const reference::golden& golden,
                   const reference::golden_gradients* grads) {
  const auto& s = golden.o_shape;
  result r;
  r.o = h5::load<double, 4>(
      f, "/o", {std::size_t(s[0]), std::size_t(s[1]), std::size_t(s[2]), std::size_t(s[3])});
  r.has_lse = f.has("/lse");
  if (r.has_lse)
    r.lse =
        h5::load<double, 3>(f, "/lse", {std::size_t(s[0]), std::size_t(s[1]), std::size_t(s[2])});
  auto gradient = [&](const char* name, const std::array<std::int64_t, 4>* shape,
                      std::optional<xt::xtensor<double, 4>>& into) {
    if (!f.has(name)) return;
    if (shape == nullptr)
      f.fail(name, "no gradient (the fixture has no /golden" + std::string(name) + ")", "one");
    into = h5::load<double, 4>(f, name, shape_of(*shape));
  };
  gradient("/dq", grads ? &grads->q_shape : nullptr, r.dq);
  gradient("/dk", grads ? &grads->k_shape : nullptr, r.dk);
  gradient("/dv", grads ? &grads->v_shape : nullptr, r.dv);
  return r;
}

void write_result(const std::filesystem::path& path, const xt::xtensor<float, 4>& o,
                  const xt::xtensor<float, 3>& lse, const std::string& backend,
                  const std::string& case_name, const std::string& digest) {
  h5::write_atomically(path, [&](h5::file& f) {
    h5::dump(f, "/o", o);
    h5::dump(f, "/lse", lse);
    h5::write_attr(f, kRoot, "backend", backend);
    if (!case_name.empty()) h5::write_attr(f, kRoot, "case", case_name);
    if (!digest.empty()) h5::write_attr(f, kRoot, "inputs_digest", digest);
  });
}

void write_result(const std::filesystem::path& path, const attention_outputs& out,
                  const std::string& backend, bool with_gradients, const std::string& case_name,
                  const std::string& digest) {
  h5::write_atomically(path, [&](h5::file& f) {
    h5::dump(f, "/o", out.o);
    h5::dump(f, "/lse", out.lse);
    if (with_gradients) {
      h5::dump(f, "/dq", out.dq);
      h5::dump(f, "/dk", out.dk);
      h5::dump(f, "/dv", out.dv);
    }
    h5::write_attr(f, kRoot, "backend", backend);
    if (!case_name.empty()) h5::write_attr(f, kRoot, "case", case_name);
    if (!digest.empty()) h5::write_attr(f, kRoot, "inputs_digest", digest);
  });
}

}  // namespace flashref::testdata
