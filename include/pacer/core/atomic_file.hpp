// Crash-safe file replacement: a reader sees the old file or the new one, never a part.
#pragma once

#include <string>
#include <string_view>

#include "pacer/core/error.hpp"

namespace pacer {

// Writes `contents` to a temporary file beside `path`, fsyncs it, renames it
// over `path` and fsyncs the directory. On any failure the old file is left
// untouched and the temporary file removed. Not safe against two writers of
// the same path at once (the last rename wins).
Status write_file_atomic(const std::string& path, std::string_view contents);

// Reads a whole file; the error names the path.
Expected<std::string> read_file(const std::string& path);

}  // namespace pacer
