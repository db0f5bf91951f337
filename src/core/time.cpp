#include "pacer/core/time.hpp"

#include <fmt/chrono.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>

namespace pacer {
namespace {

std::tm utc_tm(double t) {
  const auto secs = static_cast<std::time_t>(std::floor(t));
  std::tm tm{};
  ::gmtime_r(&secs, &tm);
  return tm;
}

}  // namespace

double wall_now() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

std::string utc_iso(double t, bool millis) {
  const std::tm tm = utc_tm(t);
  if (!millis) return fmt::format("{:%Y-%m-%dT%H:%M:%S}Z", tm);
  // Truncated, not rounded: a rounded .9995 would print the next second's
  // digits beside this second's.
  const int ms = std::min(999, static_cast<int>((t - std::floor(t)) * 1000));
  return fmt::format("{:%Y-%m-%dT%H:%M:%S}.{:03d}Z", tm, ms);
}

std::string utc_iso_now(bool millis) { return utc_iso(wall_now(), millis); }

std::string utc_compact(double t) { return fmt::format("{:%Y%m%dT%H%M%S}Z", utc_tm(t)); }

}  // namespace pacer
