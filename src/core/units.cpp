#include "pacer/core/units.hpp"

#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <initializer_list>
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

Expected<std::uint64_t> parse_size_impl(std::string_view text, bool unit_required);

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

Expected<std::uint64_t> parse_size(std::string_view text) { return parse_size_impl(text, false); }
Expected<std::uint64_t> parse_size_with_unit(std::string_view text) { return parse_size_impl(text, true); }

namespace {
// One table-driven parser for the rates: `units` maps each accepted suffix to its scale.
Expected<double> parse_rate(std::string_view text, std::string_view what,
                            std::initializer_list<std::pair<std::string_view, double>> units, std::string_view forms) {
  double n = 0;
  std::string_view suffix;
  if (!split_number(text, n, suffix)) return bad(what, text, fmt::format("expected a number with a unit ({})", forms));
  if (n < 0) return bad(what, text, "must not be negative");
  if (suffix.empty()) return bad(what, text, fmt::format("a unit is needed ({})", forms));
  for (const auto& [name, scale] : units) {
    if (suffix != name) continue;
    if (!std::isfinite(n * scale)) return bad(what, text, "too large");
    return n * scale;
  }
  return bad(what, text, fmt::format("unknown unit (use {})", forms));
}
}  // namespace

Expected<double> parse_bandwidth(std::string_view text) {
  return parse_rate(text, "bandwidth",
                    {{"B/s", 1}, {"KB/s", 1e3}, {"MB/s", 1e6}, {"GB/s", 1e9}, {"TB/s", 1e12}, {"KiB/s", 1024.0},
                     {"MiB/s", 1048576.0}, {"GiB/s", 1073741824.0}, {"TiB/s", 1099511627776.0}, {"Mb/s", 1e6 / 8},
                     {"Gb/s", 1e9 / 8}, {"Tb/s", 1e12 / 8}, {"Mbit/s", 1e6 / 8}, {"Gbit/s", 1e9 / 8}, {"Tbit/s", 1e12 / 8}},
                    "MB/s, GB/s, TB/s, GiB/s, or bits: Gb/s, Gbit/s");
}

Expected<double> parse_flop_rate(std::string_view text) {
  return parse_rate(text, "FLOP rate",
                    {{"GFLOPs", 1e9}, {"GFLOPS", 1e9}, {"GFLOP/s", 1e9}, {"TFLOPs", 1e12}, {"TFLOPS", 1e12},
                     {"TFLOP/s", 1e12}, {"PFLOPs", 1e15}, {"PFLOPS", 1e15}, {"PFLOP/s", 1e15}},
                    "GFLOPs, TFLOPs, PFLOPs; also TFLOPS and TFLOP/s");
}

namespace {
Expected<std::uint64_t> parse_size_impl(std::string_view text, bool unit_required) {
  double n = 0;
  std::string_view suffix;
  if (!split_number(text, n, suffix))
    return bad("size", text, unit_required ? "expected a number with a unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
                                           : "expected a number with an optional unit (KiB, MiB, GiB, KB, MB, GB)");
  if (n < 0) return bad("size", text, "must not be negative");
  if (unit_required && suffix.empty())
    return bad("size", text, "a unit is needed (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB: 141GB or 80GiB)");
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
}  // namespace

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
