// Wall-clock time as the library writes it: UTC, ISO 8601.
#pragma once

#include <string>

namespace pacer {

// Seconds since the epoch, from CLOCK_REALTIME.
double wall_now();

// "2026-12-01T10:24:27Z" for `t` seconds since the epoch; with millis,
// "2026-12-01T10:24:27.123Z".
std::string utc_iso(double t, bool millis = false);
// The same for now.
std::string utc_iso_now(bool millis = false);
// "20261201T102427Z": for file names (no ':', which some filesystems refuse).
std::string utc_compact(double t);

}  // namespace pacer
