#pragma once
// The fixture format of SPEC §6 and the problem and result files of SPEC §7, over the HDF5
// layer. docs/fixtures.md describes the layout for readers in any language.
//
//   problem file   /inputs/q, k, v (+ block_mask, kv_len) and optional root attributes
//   fixture        a problem file with every attribute, /golden/o, /golden/lse, /trace for
//                  the spec cases, and for the backward (SPEC §9) /inputs/do with
//                  /golden/dq, dk, dv
//   result file    /o (B, Hq, Lq, Dv) and /lse (B, Hq, Lq), written by `flashref run` or by
//                  any other kernel; any HDF5 float type; optionally /dq, /dk, /dv;
//                  `flashref run` adds the root attributes backend, case and inputs_digest

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include <xtensor/xtensor.hpp>

#include "flashref/reference/backward.hpp"
#include "flashref/reference/conformance.hpp"
#include "flashref/reference/data.hpp"
#include "flashref/reference/naive.hpp"
#include "flashref/testdata/hdf5.hpp"

namespace flashref::testdata {

// The layout version written into every fixture; readers refuse a newer one.
inline constexpr std::int64_t kFormatVersion = 1;
// The spec function's tile in the /trace of the spec cases.
inline constexpr std::int64_t kSpecTile = 4;

// x rounded to the nearest value of `dtype` (ties to even), returned as float32. float32 is
// the identity. Integer arithmetic only, so the result is the same everywhere.
float round_to(input_dtype dtype, float x);

// Reads a problem file (SPEC §7): /inputs/q, k, v of any float type; /inputs/block_mask
// (uint8, any integer type or h5py's bool) when block_q > 0; /inputs/kv_len (any integer
// type) when present. Every root attribute is optional: scale = 1/sqrt(D), causal = none,
// window_left = window_right = -1, block_q = block_k = 0, input_dtype = float32. Other groups
// (/golden, /trace, ...) are ignored. The tensors are stored [B, H, L, D]; O and LSE are
// allocated. /inputs/do (B, Hq, Lq, Dv), the backward's upstream gradient, is read into d_o
// when present. The problem is validated; a bfloat16/float16 input_dtype
// requires every input value to be representable in it. Throws problem_error naming the file.
problem_data read_problem(const h5::file& f);
problem_data read_problem(const std::filesystem::path& path);

// What the spec function did, tile by tile, on the single row of a spec case.
struct spec_trace {
  std::int64_t tile = kSpecTile;
  xt::xtensor<double, 1> m;        // (tiles) running max after the tile (-inf: nothing visible yet)
  xt::xtensor<double, 1> s;        // (tiles) running sum after the tile
  xt::xtensor<double, 1> exp_old;  // (tiles) exp(m_old - m_new) applied to s and out
};

struct fixture {
  std::string name;         // the case; the file is <name>.h5
  std::string description;  // what it pins, one line
  std::string generator;    // tool and version that wrote it
  std::uint64_t seed = 0;
  std::string twin_of;              // a half-precision twin: the float32 case it rounds; else empty
  problem_data in;                  // inputs and options; its outputs are unused
  tolerance tol;                    // atol (already scaled by max|V|), rtol, atol_lse
  reference::golden golden;         // float64 o (B, Hq, Lq, Dv) and lse (B, Hq, Lq)
  std::optional<spec_trace> trace;  // spec cases only
  // The backward (SPEC §9): float64 dQ, dK, dV of Σ O ∘ dO for in.d_o; absent when the case
  // states why in its description.
  std::optional<reference::golden_gradients> grads;
};

// Reads a fixture: a problem file plus every fixture attribute and /golden (and /trace, and
// /golden/dq, dk, dv with /inputs/do, when present), shapes checked against the inputs.
fixture read_fixture(const std::filesystem::path& path);
fixture read_fixture(const h5::file& f);
// Writes a fixture atomically (temporary file in the same folder, then rename).
void write_fixture(const std::filesystem::path& path, const fixture& fx);

// The spec function's inputs for row (b, h, i) of a problem: the query, the keys and values of
// the key/value head that query head h reads, and the row's visibility as a per-key mask.
struct spec_row {
  xt::xtensor<double, 1> q;               // (D)
  xt::xtensor<double, 2> K;               // (Lk, D)
  xt::xtensor<double, 2> V;               // (Lk, Dv)
  xt::xtensor<std::uint8_t, 1> key_mask;  // (Lk) non-zero = visible
  double scale = 1.0;
};
// Throws problem_error when (b, h, i) is not a row of p.
spec_row spec_row_of(const attention_problem& p, std::int64_t b, std::int64_t h, std::int64_t i);

// A short digest of everything that determines a problem's result: q, k, v as stored
// (float32), the block mask, kv_len, the resolved scale, the masks' options and input_dtype.
// 16 hex digits of FNV-1a (64-bit) over a fixed byte layout (docs/fixtures.md); `flashref run`
// records it in a result so that `flashref check` can refuse a result of other inputs.
std::string inputs_digest(const problem_data& in);

// What a result file says about itself, read before its datasets: where it comes from (root
// attributes, all optional — other tools' files carry none) and how /o and /lse are stored.
struct result_info {
  std::optional<std::string> case_name;      // attribute `case`: the fixture it was computed for
  std::optional<std::string> inputs_digest;  // attribute `inputs_digest`
  std::optional<std::string> backend;        // attribute `backend`
  std::string o_dtype;                       // HDF5 type of /o: "float32", "float16", ...
  std::string lse_dtype;                     // of /lse; empty when the file has none
};
result_info read_result_info(const std::filesystem::path& path);
result_info read_result_info(const h5::file& f);

// A result file: O and LSE of some kernel on a problem.
struct result {
  xt::xtensor<double, 4> o;    // (B, Hq, Lq, Dv)
  xt::xtensor<double, 3> lse;  // (B, Hq, Lq); empty when the file has no /lse
  bool has_lse = true;
  // The backward's gradients, each present or not: (B, Hq, Lq, D), (B, Hk, Lk, D/Dv).
  std::optional<xt::xtensor<double, 4>> dq, dk, dv;
};

// Reads /o and /lse of any HDF5 float type; their shapes must be those of the golden result.
// /lse is optional (not every kernel exposes it): without it only O can be judged. /dq, /dk,
// /dv are read when present, with the shapes of `grads` (a file holding one without the
// fixture having golden gradients is refused).
result read_result(const std::filesystem::path& path, const reference::golden& golden,
                   const reference::golden_gradients* grads = nullptr);
result read_result(const h5::file& f, const reference::golden& golden,
                   const reference::golden_gradients* grads = nullptr);
// Writes /o and /lse as float32 atomically; `backend` is recorded as a root attribute, and so
// are `case_name` and `digest` (inputs_digest) when not empty.
void write_result(const std::filesystem::path& path, const xt::xtensor<float, 4>& o,
                  const xt::xtensor<float, 3>& lse, const std::string& backend,
                  const std::string& case_name = {}, const std::string& digest = {});
// The same with the backward's /dq, /dk, /dv (float32) beside /o and /lse when with_gradients.
void write_result(const std::filesystem::path& path, const attention_outputs& out,
                  const std::string& backend, bool with_gradients,
                  const std::string& case_name = {}, const std::string& digest = {});

}  // namespace flashref::testdata
