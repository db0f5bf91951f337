#include "pacer/hw/system.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

#include "test_util.hpp"

namespace pacer::hw {
namespace {

using pacer::test::contains;

// Trimmed from a real 5.15 kernel; the keys we want are not the first lines,
// and similar-looking keys (MemFree, SwapCached) must not be confused with them.
constexpr const char* kMeminfo =
    "MemTotal:       263842948 kB\n"
    "MemFree:         1204456 kB\n"
    "MemAvailable:   201234560 kB\n"
    "Buffers:          123456 kB\n"
    "Cached:         180000000 kB\n"
    "SwapCached:         1024 kB\n"
    "Active:         50000000 kB\n"
    "SwapTotal:       8388604 kB\n"
    "SwapFree:        8000000 kB\n"
    "HugePages_Total:       0\n"
    "Hugepagesize:       2048 kB\n";

TEST(ParseMeminfo, RealLookingText) {
  auto m = parse_meminfo(kMeminfo);
  ASSERT_TRUE(m.has_value()) << m.error().message;
  EXPECT_EQ(m->total, 263842948ull * 1024);
  EXPECT_EQ(m->available, 201234560ull * 1024);
  EXPECT_EQ(m->swap_total, 8388604ull * 1024);
  EXPECT_EQ(m->swap_free, 8000000ull * 1024);
}

TEST(ParseMeminfo, NoTrailingNewlineAndNoSwap) {
  auto m = parse_meminfo("MemTotal: 1000 kB\nMemAvailable: 400 kB");
  ASSERT_TRUE(m.has_value()) << m.error().message;
  EXPECT_EQ(m->total, 1024000u);
  EXPECT_EQ(m->available, 409600u);
  EXPECT_EQ(m->swap_total, 0u);
  EXPECT_EQ(m->swap_free, 0u);
}

TEST(ParseMeminfo, MissingMemAvailableIsAnError) {
  auto m = parse_meminfo("MemTotal:       1000 kB\nMemFree:         500 kB\n");
  ASSERT_FALSE(m.has_value());
  EXPECT_TRUE(contains(m.error().message, "MemAvailable"));
}

TEST(ParseMeminfo, MissingMemTotalIsAnError) {
  auto m = parse_meminfo("MemFree:         500 kB\nMemAvailable:    400 kB\n");
  ASSERT_FALSE(m.has_value());
  EXPECT_TRUE(contains(m.error().message, "MemTotal"));
}

TEST(ParseMeminfo, EmptyOrGarbageIsAnError) {
  EXPECT_FALSE(parse_meminfo("").has_value());
  EXPECT_FALSE(parse_meminfo("not meminfo at all\n").has_value());
  // A key present without a number does not count as present.
  EXPECT_FALSE(parse_meminfo("MemTotal: lots\nMemAvailable: 10 kB\n").has_value());
}

TEST(ReadMeminfo, WorksOnThisMachine) {
  auto m = read_meminfo();
  ASSERT_TRUE(m.has_value()) << m.error().message;
  EXPECT_GT(m->total, 0u);
  EXPECT_GT(m->available, 0u);
  EXPECT_LE(m->available, m->total);
  EXPECT_LE(m->swap_free, m->swap_total);
}

TEST(ParseBracketedChoice, PicksSelectedWord) {
  auto c = parse_bracketed_choice("always [madvise] never");
  ASSERT_TRUE(c.has_value()) << c.error().message;
  EXPECT_EQ(*c, "madvise");
}

TEST(ParseBracketedChoice, FirstAndLastPositionsAndPunctuation) {
  EXPECT_EQ(parse_bracketed_choice("[always] madvise never").value(), "always");
  EXPECT_EQ(parse_bracketed_choice("always madvise [never]").value(), "never");
  EXPECT_EQ(parse_bracketed_choice("always defer [defer+madvise] madvise never").value(), "defer+madvise");
}

TEST(ParseBracketedChoice, NoBracketsIsAnErrorQuotingTheText) {
  auto c = parse_bracketed_choice("always madvise never");
  ASSERT_FALSE(c.has_value());
  EXPECT_TRUE(contains(c.error().message, "always madvise never"));
}

TEST(ParseBracketedChoice, UnbalancedBracketsAreErrors) {
  EXPECT_FALSE(parse_bracketed_choice("always [madvise never").has_value());
  EXPECT_FALSE(parse_bracketed_choice("always madvise] never").has_value());
  EXPECT_FALSE(parse_bracketed_choice("").has_value());
}

TEST(ParseProcStat, BusyAndTotalCountIowaitAsIdleAndSkipGuest) {
  // user nice system idle iowait irq softirq steal guest guest_nice
  const char* text =
      "cpu  100 20 30 400 50 5 6 7 8 9\n"
      "cpu0 50 10 15 200 25 2 3 3 4 4\n"
      "intr 12345\n";
  auto t = parse_proc_stat(text);
  ASSERT_TRUE(t.has_value()) << t.error().message;
  // guest and guest_nice are already inside user and nice.
  EXPECT_EQ(t->total, 100u + 20 + 30 + 400 + 50 + 5 + 6 + 7);
  // idle and iowait are the only idle time.
  EXPECT_EQ(t->busy, 100u + 20 + 30 + 5 + 6 + 7);
}

TEST(ParseProcStat, OldKernelWithFourFields) {
  auto t = parse_proc_stat("cpu  10 2 3 85\n");
  ASSERT_TRUE(t.has_value()) << t.error().message;
  EXPECT_EQ(t->total, 100u);
  EXPECT_EQ(t->busy, 15u);
}

TEST(ParseProcStat, IowaitOnlyIsNotBusy) {
  auto t = parse_proc_stat("cpu  0 0 0 100 900 0 0 0 0 0\n");
  ASSERT_TRUE(t.has_value()) << t.error().message;
  EXPECT_EQ(t->total, 1000u);
  EXPECT_EQ(t->busy, 0u);
}

TEST(ParseProcStat, MalformedInputIsAnError) {
  EXPECT_FALSE(parse_proc_stat("").has_value());
  EXPECT_FALSE(parse_proc_stat("intr 1 2 3\n").has_value());
  EXPECT_FALSE(parse_proc_stat("cpu0 1 2 3 4 5\n").has_value());  // no aggregate line
  EXPECT_FALSE(parse_proc_stat("cpu  1 2 3\n").has_value());      // too short
  EXPECT_FALSE(parse_proc_stat("cpu  a b c d e\n").has_value());
  // The short aggregate line must not borrow numbers from the next line.
  EXPECT_FALSE(parse_proc_stat("cpu  1 2\ncpu0 1 2 3 4\n").has_value());
}

TEST(ReadCpuTimes, WorksOnThisMachine) {
  auto t = read_cpu_times();
  ASSERT_TRUE(t.has_value()) << t.error().message;
  EXPECT_GT(t->total, 0u);
  EXPECT_LE(t->busy, t->total);
}

TEST(AllowedCpus, NonEmptyAscendingUnique) {
  const auto cpus = allowed_cpus();
  ASSERT_FALSE(cpus.empty());
  EXPECT_TRUE(std::is_sorted(cpus.begin(), cpus.end()));
  EXPECT_EQ(std::set<int>(cpus.begin(), cpus.end()).size(), cpus.size());
  EXPECT_GE(cpus.front(), 0);
}

TEST(ReadText, StripsTrailingWhitespaceAndNamesMissingPath) {
  auto r = read_text("/proc/sys/kernel/ostype");
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(*r, "Linux");
  auto missing = read_text("/nonexistent/pacer/file");
  ASSERT_FALSE(missing.has_value());
  EXPECT_TRUE(contains(missing.error().message, "/nonexistent/pacer/file"));
}

}  // namespace
}  // namespace pacer::hw

namespace pacer::hw {
namespace {

TEST(ParsePidStat, CommWithSpacesAndParentheses) {
  // The command name ends at the last ')', whatever it contains.
  auto s = parse_pid_stat("4242 (python3 (rank 0)) R 4200 4242 4200 0 -1 4194304 10 0 0 0 "
                          "1234 567 0 0 20 0 8 0 99999 123456789 4321 18446744073709551615 1 1 0 0 0");
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ(s->pid, 4242);
  EXPECT_EQ(s->comm, "python3 (rank 0)");
  EXPECT_EQ(s->state, 'R');
  EXPECT_EQ(s->ppid, 4200);
  EXPECT_EQ(s->utime, 1234u);
  EXPECT_EQ(s->stime, 567u);
  EXPECT_EQ(s->rss_pages, 4321u);
  EXPECT_FALSE(parse_pid_stat("4242 (x) R 1 2").has_value());
  EXPECT_FALSE(parse_pid_stat("garbage").has_value());
}

TEST(ParsePidIo, FieldsAndNothingUseful) {
  auto io = parse_pid_io("rchar: 10\nwchar: 20\nsyscr: 1\nsyscw: 2\nread_bytes: 4096\nwrite_bytes: 8192\ncancelled_write_bytes: 0\n");
  ASSERT_TRUE(io.has_value());
  EXPECT_EQ(io->rchar, 10u);
  EXPECT_EQ(io->wchar, 20u);
  EXPECT_EQ(io->read_bytes, 4096u);
  EXPECT_EQ(io->write_bytes, 8192u);
  EXPECT_FALSE(parse_pid_io("").has_value());
}

TEST(ParseProcStatCores, SkipsTheAggregateAndOtherLines) {
  auto cores = parse_proc_stat_cores("cpu  4 0 4 8 0 0 0 0 0 0\ncpu0 1 0 1 2 0\ncpu12 3 0 3 6 2 0 0 0\nintr 5 6\nctxt 7\n");
  ASSERT_EQ(cores.size(), 2u);
  EXPECT_EQ(cores[0].cpu, 0);
  EXPECT_EQ(cores[0].times.total, 4u);
  EXPECT_EQ(cores[0].times.busy, 2u);
  EXPECT_EQ(cores[1].cpu, 12);
  EXPECT_EQ(cores[1].times.busy, 6u);  // iowait counts as idle
}

TEST(ParseNetDev, HeaderLinesAreSkipped) {
  auto devs = parse_net_dev(
      "Inter-|   Receive                            |  Transmit\n"
      " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n"
      "ib0: 100 2 0 0 0 0 0 0 300 4 0 0 0 0 0 0\n");
  ASSERT_EQ(devs.size(), 1u);
  EXPECT_EQ(devs[0].name, "ib0");
  EXPECT_EQ(devs[0].rx_bytes, 100u);
  EXPECT_EQ(devs[0].tx_bytes, 300u);
  EXPECT_EQ(devs[0].tx_packets, 4u);
}

TEST(ParseDiskstats, SectorsAreHalfKilobytes) {
  // Old kernels have 14 fields, new ones 20; both parse.
  auto d = parse_diskstats("   8       0 sda 100 0 2048 5 50 0 4096 7 0 900 12\n"
                           " 259       1 nvme0n1p1 1 0 8 0 1 0 8 0 0 3 0 0 0 0 0 0 0\n"
                           "bad line\n");
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0].name, "sda");
  EXPECT_EQ(d[0].reads, 100u);
  EXPECT_EQ(d[0].read_bytes, 2048u * 512);
  EXPECT_EQ(d[0].write_bytes, 4096u * 512);
  EXPECT_EQ(d[0].io_ms, 900u);
  EXPECT_EQ(d[1].name, "nvme0n1p1");
}

TEST(ReadIbCounters, NoInfinibandIsEmpty) {
  pacer::test::TempDir dir("no-ib-");
  EXPECT_TRUE(read_ib_counters(dir.path()).empty());
}

}  // namespace
}  // namespace pacer::hw
