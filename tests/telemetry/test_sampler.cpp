#include "pacer/telemetry/sampler.hpp"

#include <gtest/gtest.h>

#include <cmath>

#include <map>
#include <set>

#include "fake_root.hpp"
#include "pacer/telemetry/monitor.hpp"

namespace pacer::telemetry {
namespace {

using pacer::test::contains;
using pacer::test::FakeRoot;

// metric|gpu|device -> value
std::map<std::string, double> by_key(const Sample& s) {
  std::map<std::string, double> m;
  for (const auto& r : s.readings) m[fmt::format("{}|{}", r.metric->name, r.device)] = r.value;
  return m;
}

TEST(Sampler, RatesFromAFakeTree) {
  FakeRoot root;
  Sampler sampler(SamplerOptions{.root = root.path(), .pid = 100, .gpus = false, .per_core = true});
  const Sample first = sampler.sample(1000.0);
  // Counters need two passes; gauges are there at once.
  auto m0 = by_key(first);
  EXPECT_EQ(m0.count("net.rx_bytes|eth0"), 0u);
  EXPECT_DOUBLE_EQ(m0.at("mem.used_bytes|"), 750.0 * 1024);
  EXPECT_DOUBLE_EQ(m0.at("proc.count|"), 2);  // 100 and its child 101, not 102

  root.write(2);  // two steps of counters in two seconds
  const Sample second = sampler.sample(1002.0);
  EXPECT_DOUBLE_EQ(second.interval_s, 2.0);
  auto m = by_key(second);
  EXPECT_DOUBLE_EQ(m.at("cpu.busy|"), 0.625);
  EXPECT_DOUBLE_EQ(m.at("cpu.busy|cpu0"), 0.25);
  EXPECT_DOUBLE_EQ(m.at("cpu.busy|cpu1"), 1.0);
  EXPECT_DOUBLE_EQ(m.at("proc.cpu_seconds|"), 100.0 / static_cast<double>(hw::clock_ticks_per_second()));
  EXPECT_DOUBLE_EQ(m.at("proc.read_bytes|"), 5096);
  EXPECT_DOUBLE_EQ(m.at("proc.write_bytes|"), 8192);
  EXPECT_DOUBLE_EQ(m.at("net.rx_bytes|eth0"), 2000);
  EXPECT_DOUBLE_EQ(m.at("net.tx_bytes|eth0"), 300);
  EXPECT_EQ(m.count("net.rx_bytes|lo"), 0u);
  EXPECT_DOUBLE_EQ(m.at("ib.rx_bytes|mlx5_0:1"), 1000);  // 250 words of 4 bytes per second
  EXPECT_DOUBLE_EQ(m.at("ib.tx_bytes|mlx5_0:1"), 200);
  EXPECT_DOUBLE_EQ(m.at("ib.errors|mlx5_0:1"), 0.5);
  EXPECT_DOUBLE_EQ(m.at("disk.read_bytes|nvme0n1"), 4096);
  EXPECT_DOUBLE_EQ(m.at("disk.write_bytes|nvme0n1"), 8192);
  EXPECT_DOUBLE_EQ(m.at("disk.io_seconds|nvme0n1"), 0.25);
  EXPECT_EQ(m.count("disk.read_bytes|loop0"), 0u);
  // Counters carry their cumulative total for Prometheus.
  for (const auto& r : second.readings)
    if (r.metric->name == "ib.rx_bytes") {
      EXPECT_DOUBLE_EQ(*r.total, (100 + 250 * 2) * 4.0);
    }
}

TEST(Sampler, CounterThatGoesBackwardsIsSkippedNotNegative) {
  FakeRoot root;
  root.write(5);
  Sampler sampler(SamplerOptions{.root = root.path(), .gpus = false, .per_core = false});
  (void)sampler.sample(1.0);
  root.write(1);  // interface re-created, counters reset
  for (const auto& r : sampler.sample(2.0).readings) EXPECT_GE(r.value, 0) << r.metric->name << " " << r.device;
}

TEST(Sampler, ClockThatDoesNotAdvanceGivesNoRateNorNaN) {
  FakeRoot root;
  Sampler sampler(SamplerOptions{.root = root.path(), .pid = 100, .gpus = false, .per_core = true});
  (void)sampler.sample(10.0);
  root.write(2);
  // The final pass can land on the same clock reading as the last one, and a
  // stepped wall clock can go backwards: no rate over zero or negative time.
  for (double t : {10.0, 9.0})
    for (const auto& r : sampler.sample(t).readings) {
      EXPECT_TRUE(std::isfinite(r.value)) << r.metric->name << " " << r.device;
      EXPECT_NE(r.metric->kind, MetricKind::kCounter) << r.metric->name << " " << r.device;
    }
  root.write(5);  // three more steps in the 3 s since the reading at 9.0
  const auto m = by_key(sampler.sample(12.0));
  EXPECT_DOUBLE_EQ(m.at("net.rx_bytes|eth0"), 2000);
}

TEST(Sampler, ChildrenStartedLaterJoinTheTree) {
  FakeRoot root;
  Sampler sampler(SamplerOptions{.root = root.path(), .pid = 100, .gpus = false, .per_core = false});
  EXPECT_DOUBLE_EQ(by_key(sampler.sample(1.0)).at("proc.count|"), 2);
  root.add_process(103, 101, "worker");  // a grandchild
  EXPECT_DOUBLE_EQ(by_key(sampler.sample(2.5)).at("proc.count|"), 3);
  root.remove_process(101);  // the middle one exits: its child is reparented elsewhere and leaves the tree
  root.reparent(103, 1);
  EXPECT_DOUBLE_EQ(by_key(sampler.sample(4.0)).at("proc.count|"), 1);
  EXPECT_TRUE(sampler.process_alive());
  root.remove_process(100);
  (void)sampler.sample(5.5);
  EXPECT_FALSE(sampler.process_alive());
}

TEST(Sampler, ProcessThatIsGoneEndsFollowing) {
  FakeRoot root;
  Sampler sampler(SamplerOptions{.root = root.path(), .pid = 4242, .gpus = false});
  (void)sampler.sample(1.0);
  EXPECT_FALSE(sampler.process_alive());
}

TEST(Sampler, NoGpuIsANoteNotAFailure) {
  // Without a driver (CI) NVML cannot load; with one, this still must not fail.
  FakeRoot root;
  Sampler sampler(SamplerOptions{.root = root.path(), .gpus = true});
  const Sample s = sampler.sample(1.0);
  EXPECT_FALSE(s.readings.empty());
  if (sampler.gpus().empty()) {
    ASSERT_FALSE(sampler.notes().empty());
    EXPECT_TRUE(contains(sampler.notes()[0], "GPU metrics skipped"));
  }
}

TEST(Sampler, MissingSourcesAreNoted) {
  pacer::test::TempDir empty("empty-root-");
  Sampler sampler(SamplerOptions{.root = empty.path(), .gpus = false});
  const Sample s = sampler.sample(1.0);
  EXPECT_TRUE(s.readings.empty());
  ASSERT_FALSE(sampler.notes().empty());
  EXPECT_TRUE(contains(sampler.notes()[0], "/proc/stat"));
}

TEST(Prometheus, FamiliesLabelsAndCounters) {
  FakeRoot root;
  Sampler sampler(SamplerOptions{.root = root.path(), .gpus = false, .per_core = false});
  (void)sampler.sample(1.0);
  root.write(1);
  const std::string text = render_prometheus(sampler.sample(2.0), "node\"7");
  EXPECT_TRUE(contains(text, "# TYPE pacer_network_receive_bytes_total counter\n"));
  EXPECT_TRUE(contains(text, "pacer_network_receive_bytes_total{node=\"node\\\"7\",device=\"eth0\"} 1002000\n"));
  EXPECT_TRUE(contains(text, "# TYPE pacer_cpu_busy_ratio gauge\npacer_cpu_busy_ratio{node=\"node\\\"7\"} 0.625\n"));
  // One HELP per family even with several series.
  EXPECT_EQ(text.find("# HELP pacer_infiniband_receive_bytes_total"), text.rfind("# HELP pacer_infiniband_receive_bytes_total"));
}

TEST(Prometheus, ListenAddress) {
  auto a = parse_listen_address("9400");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 9400);
  a = parse_listen_address("0.0.0.0:9100");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->host, "0.0.0.0");
  a = parse_listen_address("[::1]:9100");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->host, "::1");
  EXPECT_FALSE(parse_listen_address("host:port").has_value());
  EXPECT_FALSE(parse_listen_address("70000").has_value());
  EXPECT_FALSE(parse_listen_address(":9").has_value());
}

TEST(Metrics, NamesAreUniqueAndCountersFollowConventions) {
  std::set<std::string_view> names, prom;
  for (const auto& d : metric_defs()) {
    EXPECT_TRUE(names.insert(d.name).second) << d.name;
    EXPECT_TRUE(prom.insert(d.prometheus).second) << d.prometheus;
    EXPECT_EQ(d.prometheus.rfind("pacer_", 0), 0u) << d.prometheus;
    // The exposition appends _total itself.
    EXPECT_EQ(d.prometheus.find("_total"), std::string_view::npos) << d.prometheus;
    EXPECT_EQ(find_metric(d.name), &d);
  }
  EXPECT_EQ(find_metric("no.such"), nullptr);
}

}  // namespace
}  // namespace pacer::telemetry
