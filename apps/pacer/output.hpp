// What every subcommand does at its edge: print a report and turn a bad argument into a usage error.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace pacer::cli {

// Writes `j` (indented, with --json) or `text` (the human table, as is) to
// stdout. Strings in reports come from file and directory names, so invalid
// UTF-8 is replaced rather than failing a command that did its work.
void print(const nlohmann::json& j, bool as_json, const std::string& text);

// Throws pacer::Exception with ErrorKind::kUsage (exit code 2).
[[noreturn]] void usage_error(const std::string& message);

// A usage error "DIR: not a directory" unless `dir` is one.
void require_dir(const std::string& dir);

}  // namespace pacer::cli
