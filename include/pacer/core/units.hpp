// Parsing and printing of durations and sizes ("1.5s", "256MiB").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "pacer/core/error.hpp"

namespace pacer {

// Parses "250ms", "2s", "1.5m", "1h" (a bare number is seconds). Negative
// values are rejected.
Expected<double> parse_duration(std::string_view text);

// Parses "4096", "64KiB", "1.5GiB", "100MB" (SI: 1000, IEC: 1024; "K"/"M"/"G"
// alone are IEC, as in dd and fio). Returns bytes.
Expected<std::uint64_t> parse_size(std::string_view text);
// The same, but a bare number is an error that lists the accepted units: for options where "141" could be
// bytes or gigabytes and a guess would be wrong by a factor of 1e9.
Expected<std::uint64_t> parse_size_with_unit(std::string_view text);

// Bytes per second from "900GB/s", "4.8TB/s", "1.5GiB/s", "200Gb/s" or "200Gbit/s" (bits: / 8). A unit is
// required.
Expected<double> parse_bandwidth(std::string_view text);

// FLOP per second from "700TFLOPs", "700TFLOP/s", "2.25PFLOPS", "989 TFLOPS", "50GFLOP/s". A unit is required.
Expected<double> parse_flop_rate(std::string_view text);

// "1.5 GiB"-style text for a byte count.
std::string format_bytes(double bytes);
// "1.25 s", "340 ms", "12 us".
std::string format_duration(double seconds);
// A number with a sensible number of significant digits for a table.
std::string format_number(double value);

}  // namespace pacer
