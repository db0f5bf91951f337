#include "pacer/core/units.hpp"

#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <utility>

namespace pacer {
namespace {

// Splits "1.5GiB" into 1.5 and "GiB"; whitespace between is allowed.
bool split_number(std::string_view text, double& number, std::string_view& suffix) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  if (text.empty()) return false;
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(begin, end, number);
  if (ec != std::errc() || ptr == begin) return false;
  suffix = std::string_view(ptr, static_cast<std::size_t>(end - ptr));
  while (!suffix.empty() && suffix.front() == ' ') suffix.remove_prefix(1);
  return std::isfinite(number);
}

Error bad(std::string_view what, std::string_view text, std::string_view hint) {
  return Error{ErrorKind::kConfig, fmt::format("invalid {} '{}': {}", what, text, hint)};
}

}  // namespace

Expected<double> parse_duration(std::string_view text) {
  double n = 0;
  std::string_view suffix;
  if (!split_number(text, n, suffix)) return bad("duration", text, "expected a number with an optional unit (ms, s, m, h, d)");
  if (n < 0) return bad("duration", text, "must not be negative");
  static const std::pair<std::string_view, double> kUnits[] = {
      {"", 1}, {"us", 1e-6}, {"ms", 1e-3}, {"s", 1}, {"sec", 1}, {"m", 60}, {"min", 60}, {"h", 3600}, {"d", 86400}};
  for (const auto& [name, scale] : kUnits) {
    if (suffix != name) continue;
    if (!std::isfinite(n * scale)) return bad("duration", text, "too large");  // 1e308d
    return n * scale;
  }
  return bad("duration", text, "unknown unit (use us, ms, s, m, h or d)");
}

Expected<std::uint64_t> parse_size(std::string_view text) {
  double n = 0;
  std::string_view suffix;
  if (!split_number(text, n, suffix)) return bad("size", text, "expected a number with an optional unit (KiB, MiB, GiB, KB, MB, GB)");
  if (n < 0) return bad("size", text, "must not be negative");
  static const std::pair<std::string_view, double> kUnits[] = {
      {"", 1},          {"B", 1},          {"K", 1024.0},          {"KiB", 1024.0},
      {"M", 1048576.0}, {"MiB", 1048576.0}, {"G", 1073741824.0},  {"GiB", 1073741824.0},
      {"T", 1099511627776.0}, {"TiB", 1099511627776.0}, {"KB", 1e3}, {"kB", 1e3},
      {"MB", 1e6},      {"GB", 1e9},       {"TB", 1e12}};
  for (const auto& [name, scale] : kUnits) {
    if (suffix == name) {
      const double bytes = n * scale;
      if (bytes > 1.8e19) return bad("size", text, "too large");
      // Round in double: llround returns a signed type and would wrap above 2^63.
      return static_cast<std::uint64_t>(std::round(bytes));
    }
  }
  return bad("size", text, "unknown unit (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)");
}

std::string format_bytes(double bytes) {
  static const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int i = 0;
  while (std::fabs(bytes) >= 1024.0 && i < 5) {
    bytes /= 1024.0;
    ++i;
  }
  return i == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{} {}", format_number(bytes), kNames[i]);
}

std::string format_duration(double seconds) {
  // Checkpoint intervals, MTBFs and campaigns run to hours and days; seconds stay below an hour.
  if (seconds >= 2 * 86400.0) return fmt::format("{} d", format_number(seconds / 86400));
  if (seconds >= 3600.0) return fmt::format("{} h", format_number(seconds / 3600));
  if (seconds >= 1.0) return fmt::format("{} s", format_number(seconds));
  if (seconds >= 1e-3) return fmt::format("{} ms", format_number(seconds * 1e3));
  return fmt::format("{} us", format_number(seconds * 1e6));
}

std::string format_number(double v) {
  const double a = std::fabs(v);
  if (v == std::floor(v) && a < 1e15) return fmt::format("{:.0f}", v);
  if (a >= 100) return fmt::format("{:.0f}", v);
  if (a >= 10) return fmt::format("{:.1f}", v);
  if (a >= 0.01) return fmt::format("{:.2f}", v);
  return fmt::format("{:.3g}", v);
}

}  // namespace pacer
