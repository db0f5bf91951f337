#include "pacer/core/units.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "test_util.hpp"

namespace pacer {
namespace {

using test::contains;

// Durations come back in seconds; compare with a tolerance because "1.5m"
// and "250ms" go through floating-point scaling.
void expect_duration(const char* text, double seconds) {
  auto d = parse_duration(text);
  ASSERT_TRUE(d.has_value()) << text << ": " << d.error().message;
  EXPECT_NEAR(*d, seconds, 1e-12 * (seconds > 1 ? seconds : 1)) << text;
}

void expect_size(const char* text, std::uint64_t bytes) {
  auto s = parse_size(text);
  ASSERT_TRUE(s.has_value()) << text << ": " << s.error().message;
  EXPECT_EQ(*s, bytes) << text;
}

TEST(ParseDuration, Units) {
  expect_duration("250ms", 0.25);
  expect_duration("2s", 2);
  expect_duration("1.5m", 90);
  expect_duration("1h", 3600);
  expect_duration("30d", 30 * 86400);
  expect_duration("12us", 12e-6);
  expect_duration("3sec", 3);
  expect_duration("2min", 120);
}

TEST(ParseDuration, BareNumberIsSeconds) {
  expect_duration("10", 10);
  expect_duration("0.5", 0.5);
  expect_duration("0", 0);
}

TEST(ParseDuration, WhitespaceAroundAndBeforeUnit) {
  expect_duration("  2s  ", 2);
  expect_duration("500 ms", 0.5);
}

TEST(ParseDuration, NegativeRejected) {
  auto d = parse_duration("-1s");
  ASSERT_FALSE(d.has_value());
  EXPECT_EQ(d.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(d.error().message, "'-1s'"));
  EXPECT_TRUE(contains(d.error().message, "negative"));
}

TEST(ParseDuration, UnknownUnitNamesTextAndUnits) {
  auto d = parse_duration("5 parsecs");
  ASSERT_FALSE(d.has_value());
  EXPECT_EQ(d.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(d.error().message, "invalid duration '5 parsecs'"));
  EXPECT_TRUE(contains(d.error().message, "unknown unit"));
}

TEST(ParseDuration, GarbageRejected) {
  for (const char* text : {"", "   ", "abc", "s", "ms5", "inf", "nan", "1.5.5s"}) {
    auto d = parse_duration(text);
    EXPECT_FALSE(d.has_value()) << "'" << text << "' parsed as " << (d ? *d : 0);
    if (!d) {
      EXPECT_TRUE(contains(d.error().message, "invalid duration")) << text;
    }
  }
}

TEST(ParseSize, BareNumberIsBytes) {
  expect_size("4096", 4096);
  expect_size("0", 0);
  expect_size("17B", 17);
}

TEST(ParseSize, IecUnitsArePowersOf1024) {
  expect_size("64KiB", 64ull << 10);
  expect_size("256MiB", 256ull << 20);
  expect_size("1.5GiB", 3ull << 29);
  expect_size("2TiB", 2ull << 40);
}

TEST(ParseSize, SiUnitsArePowersOf1000) {
  expect_size("100MB", 100'000'000);
  expect_size("1KB", 1000);
  expect_size("1kB", 1000);
  expect_size("3GB", 3'000'000'000ull);
  expect_size("2TB", 2'000'000'000'000ull);
}

TEST(ParseSize, SingleLetterUnitsAreIecLikeDdAndFio) {
  expect_size("4K", 4096);
  expect_size("1M", 1ull << 20);
  expect_size("2G", 2ull << 30);
  expect_size("1T", 1ull << 40);
}

TEST(ParseSize, WhitespaceAroundAndBeforeUnit) {
  expect_size(" 1 MiB ", 1ull << 20);
  expect_size("64 KiB", 64ull << 10);
}

TEST(ParseSize, NegativeRejected) {
  auto s = parse_size("-1MiB");
  ASSERT_FALSE(s.has_value());
  EXPECT_EQ(s.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(s.error().message, "'-1MiB'"));
  EXPECT_TRUE(contains(s.error().message, "negative"));
}

TEST(ParseSize, UnknownUnitNamesTextAndUnits) {
  auto s = parse_size("12 parsecs");
  ASSERT_FALSE(s.has_value());
  EXPECT_EQ(s.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(s.error().message, "invalid size '12 parsecs'"));
  EXPECT_TRUE(contains(s.error().message, "MiB"));
}

TEST(ParseSize, GarbageRejected) {
  for (const char* text : {"", "abc", "MiB", "inf", "nan", "1,5GiB"}) {
    auto s = parse_size(text);
    EXPECT_FALSE(s.has_value()) << "'" << text << "' parsed as " << (s ? *s : 0);
    if (!s) {
      EXPECT_TRUE(contains(s.error().message, "invalid size")) << text;
    }
  }
}

TEST(ParseSize, TooLargeRejected) {
  auto s = parse_size("1e30");
  ASSERT_FALSE(s.has_value());
  EXPECT_TRUE(contains(s.error().message, "too large"));
}

TEST(ParseSize, LargeValuesThatFitInUint64AreExact) {
  // Above INT64_MAX but below UINT64_MAX: must not go through a signed type.
  auto s = parse_size("9500000000000000000");
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(*s, 9'500'000'000'000'000'000ull);
  auto t = parse_size("10000000TB");
  ASSERT_TRUE(t.has_value()) << t.error().message;
  EXPECT_EQ(*t, 10'000'000'000'000'000'000ull);
}

TEST(FormatBytes, PicksBinaryUnit) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1 KiB");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(1 << 20), "1 MiB");
  EXPECT_EQ(format_bytes(1.5 * (1 << 30)), "1.50 GiB");
  EXPECT_EQ(format_bytes(256.0 * (1ull << 40)), "256 TiB");
}

TEST(FormatBytes, LargestUnitIsPiB) {
  const double pib = 1024.0 * 1024 * 1024 * 1024 * 1024;
  EXPECT_EQ(format_bytes(pib), "1 PiB");
  EXPECT_EQ(format_bytes(2048 * pib), "2048 PiB");
}

TEST(FormatBytes, RoundTripsThroughParseSize) {
  for (std::uint64_t bytes : {1ull << 10, 3ull << 20, 5ull << 30, 7ull << 40}) {
    std::string text = format_bytes(static_cast<double>(bytes));
    auto parsed = parse_size(text);
    ASSERT_TRUE(parsed.has_value()) << text;
    EXPECT_EQ(*parsed, bytes) << text;
  }
}

TEST(FormatDuration, PicksUnit) {
  EXPECT_EQ(format_duration(1.25), "1.25 s");
  EXPECT_EQ(format_duration(1), "1 s");
  EXPECT_EQ(format_duration(90), "90 s");
  EXPECT_EQ(format_duration(5400), "1.50 h");
  EXPECT_EQ(format_duration(3 * 86400), "3 d");
  EXPECT_EQ(format_duration(0.34), "340 ms");
  EXPECT_EQ(format_duration(0.001), "1 ms");
  EXPECT_EQ(format_duration(0.0125), "12.5 ms");
  EXPECT_EQ(format_duration(0.000012), "12 us");
  EXPECT_EQ(format_duration(0.0000005), "0.50 us");
}

TEST(FormatNumber, SignificantDigitsByMagnitude) {
  EXPECT_EQ(format_number(0), "0");
  EXPECT_EQ(format_number(3), "3");
  EXPECT_EQ(format_number(-5), "-5");
  EXPECT_EQ(format_number(1234567), "1234567");
  EXPECT_EQ(format_number(123.456), "123");
  EXPECT_EQ(format_number(12.345), "12.3");
  EXPECT_EQ(format_number(1.234), "1.23");
  EXPECT_EQ(format_number(0.05), "0.05");
  EXPECT_EQ(format_number(0.001234), "0.00123");
  EXPECT_EQ(format_number(-12.345), "-12.3");
}

TEST(ParseSizeWithUnit, BareNumberIsAnErrorThatListsTheUnits) {
  EXPECT_EQ(*parse_size_with_unit("141GB"), 141000000000ull);
  EXPECT_EQ(*parse_size_with_unit("80GiB"), 80ull << 30);
  auto bare = parse_size_with_unit("141");
  ASSERT_FALSE(bare);
  EXPECT_NE(bare.error().message.find("a unit is needed"), std::string::npos);
  EXPECT_NE(bare.error().message.find("GiB"), std::string::npos);
  EXPECT_EQ(*parse_size("141"), 141u);  // the plain parser keeps its bytes default
}

TEST(ParseRates, BandwidthAndFlopRatesNeedAUnit) {
  EXPECT_DOUBLE_EQ(*parse_bandwidth("900GB/s"), 900e9);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("4.8TB/s"), 4.8e12);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("200Gb/s"), 25e9);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("200 Gbit/s"), 25e9);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("1GiB/s"), 1073741824.0);
  EXPECT_DOUBLE_EQ(*parse_flop_rate("700TFLOPs"), 700e12);
  EXPECT_DOUBLE_EQ(*parse_flop_rate("2.25PFLOPS"), 2.25e15);
  EXPECT_DOUBLE_EQ(*parse_flop_rate("989 TFLOP/s"), 989e12);
  for (const char* bad : {"900", "", "fast", "-1GB/s", "9GB", "1e309GB/s"}) EXPECT_FALSE(parse_bandwidth(bad)) << bad;
  for (const char* bad : {"700", "700TB/s", "-5TFLOPs", "x"}) EXPECT_FALSE(parse_flop_rate(bad)) << bad;
  EXPECT_NE(parse_flop_rate("700").error().message.find("TFLOPs"), std::string::npos);
}

}  // namespace
}  // namespace pacer
