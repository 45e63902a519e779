#pragma once
// File helpers for the CLI: text files are written atomically (temporary file in the same
// folder, then rename), so that a failed or interrupted command never leaves half a file.

#include "flashref/testdata/files.hpp"

namespace flashref::cli {

using testdata::write_text_atomically;

}  // namespace flashref::cli
