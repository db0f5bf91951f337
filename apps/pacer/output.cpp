#include "output.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>

#include "pacer/core/error.hpp"

namespace pacer::cli {

void print(const nlohmann::json& j, bool as_json, const std::string& text) {
  if (as_json) std::puts(j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  else std::fputs(text.c_str(), stdout);
}

void usage_error(const std::string& message) { throw Exception(Error{ErrorKind::kUsage, message}); }

void require_dir(const std::string& dir) {
  if (!std::filesystem::is_directory(dir)) usage_error(fmt::format("{}: not a directory", dir));
}

}  // namespace pacer::cli
