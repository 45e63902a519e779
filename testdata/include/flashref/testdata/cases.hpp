#pragma once
// The golden cases of SPEC §6. Each case is a deterministic function of its seed: inputs come
// from counter_rng (random.hpp) and exact arithmetic, the golden values from the naive float64
// reference, the tolerances from default_tolerance(), and — for the spec_* cases — the /trace
// from the spec function with tile kSpecTile. docs/fixtures.md lists what each case pins.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "flashref/testdata/fixture.hpp"

namespace flashref::testdata {

struct case_info {
  std::string name;         // file name without .h5
  std::string description;  // what it pins, one line
  std::uint64_t seed;
};

// Every case, in a fixed order.
const std::vector<case_info>& cases();

// Builds the fixture of a case (throws problem_error for an unknown name). Each case checks
// the property it exists for (e.g. exp_old == 1 on later tiles) and throws std::logic_error
// when its construction does not deliver it.
fixture generate(const std::string& name);

// Writes every case into dir as <case>.h5, each atomically; `progress` is called after each.
using progress_fn = std::function<void(std::size_t index, std::size_t count, const fixture& fx,
                                       const std::filesystem::path& file, double seconds)>;
void regenerate(const std::filesystem::path& dir, const progress_fn& progress = {});

// Regenerates every case into a temporary folder and compares it bit for bit with dir:
// datasets (inputs, golden, trace) and attributes, except `generator`. One line per
// difference, "<case>: <dataset>: ..."; *.h5 files in dir that are no case are reported too.
std::vector<std::string> verify(const std::filesystem::path& dir);

}  // namespace flashref::testdata
