// The fabric checks against a fake /sys tree (a port down, a flapping port, a
// wrong rate, Slingshot restarts), perftest's report parsers on the formats
// its versions print, the software-drift inputs and the RDMA judgement.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "pacer/core/process.hpp"
#include "pacer/hw/system.hpp"
#include "pacer/vet/cluster.hpp"
#include "pacer/vet/vet.hpp"
#include "test_util.hpp"
#include "vet/perftest.hpp"
#include "vet/probes.hpp"

namespace pacer::vet {
namespace {

using pacer::test::TempDir;

// A node with two RDMA ports: mlx5_0/1 (InfiniBand) and mlx5_1/1 (RoCE).
class FakeFabric {
 public:
  FakeFabric() : dir_("fake-fabric-") {
    port("mlx5_0", "4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)", "InfiniBand");
    port("mlx5_1", "4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)", "Ethernet");
  }
  const std::string& root() const { return dir_.path(); }
  void port(const std::string& dev, const std::string& state, const std::string& phys, const std::string& rate,
            const std::string& layer) {
    const std::string p = fmt::format("sys/class/infiniband/{}/ports/1/", dev);
    dir_.file(p + "state", state + "\n");
    dir_.file(p + "phys_state", phys + "\n");
    dir_.file(p + "rate", rate + "\n");
    dir_.file(p + "link_layer", layer + "\n");
    counter(dev, "symbol_error", 0);
    counter(dev, "link_downed", 3);
    counter(dev, "port_rcv_errors", 0);
  }
  void counter(const std::string& dev, const std::string& name, int v) {
    dir_.file(fmt::format("sys/class/infiniband/{}/ports/1/counters/{}", dev, name), std::to_string(v) + "\n");
  }
  void cxi_restart(int slot, const std::string& when) {
    for (int i = 0; i < 10; ++i)
      if (i == slot || !std::filesystem::exists(fmt::format("{}/sys/class/cxi/cxi0/device/link_restarts/time_{}", root(), i)))
        dir_.file(fmt::format("sys/class/cxi/cxi0/device/link_restarts/time_{}", i), i == slot ? when : "0");
  }

 private:
  TempDir dir_;
};

const Measurement* find(const std::vector<Measurement>& ms, const std::string& check, const std::string& target) {
  for (const auto& m : ms)
    if (m.check == check && m.target == target) return &m;
  return nullptr;
}

const CheckResult* find(const VetReport& r, const std::string& check, const std::string& target) {
  for (const auto& c : r.checks)
    if (c.name == check && c.target == target) return &c;
  return nullptr;
}

VetReport vet_fabric(const FakeFabric& f, const std::string& profile) {
  VetOptions o;
  o.quick = true;
  o.only = {"fabric"};
  o.profile = profile;
  ::setenv("PACER_VET_ROOT", f.root().c_str(), 1);  // the probe's child inherits it
  auto r = run_vet(o);
  ::unsetenv("PACER_VET_ROOT");
  EXPECT_TRUE(r) << r.error().message;
  return r ? *r : VetReport{};
}

TEST(HwIbPorts, ReadsStateRateAndCountersAndKeepsMissingCountersApart) {
  FakeFabric f;
  std::filesystem::remove(f.root() + "/sys/class/infiniband/mlx5_1/ports/1/counters/symbol_error");
  const auto ports = hw::read_ib_ports(f.root());
  ASSERT_EQ(ports.size(), 2u);
  EXPECT_EQ(ports[0].device, "mlx5_0");
  EXPECT_EQ(ports[0].port, 1);
  EXPECT_EQ(ports[0].state, "ACTIVE");
  EXPECT_EQ(ports[0].phys_state, "LinkUp");
  EXPECT_EQ(ports[0].rate_gbits, 400.0);
  EXPECT_EQ(ports[0].link_layer, "InfiniBand");
  EXPECT_EQ(ports[0].link_downed, 3u);
  EXPECT_EQ(ports[1].link_layer, "Ethernet");
  EXPECT_FALSE(ports[1].symbol_errors.has_value());
  EXPECT_EQ(hw::strip_sysfs_code("1: DOWN"), "DOWN");
  EXPECT_EQ(hw::strip_sysfs_code("LinkUp"), "LinkUp");
  EXPECT_EQ(hw::parse_ib_rate("100 Gb/sec (4X EDR)"), 100.0);
  EXPECT_FALSE(hw::parse_ib_rate("unknown").has_value());
}

TEST(Fabric, NoRdmaHardwareSkipsWithTheReason) {
  TempDir empty("no-fabric-");
  const auto ms = measure_fabric(empty.path(), "", 0, [] { ADD_FAILURE() << "waited without a port to watch"; });
  for (const char* c : {"fabric.ib_state", "fabric.ib_rate", "fabric.ib_link_flaps", "fabric.cxi_link_flaps"}) {
    const Measurement* m = find(ms, c, "");
    ASSERT_NE(m, nullptr) << c;
    EXPECT_EQ(m->status, CheckStatus::kSkip) << c;
    EXPECT_FALSE(m->reason.empty());
  }
  EXPECT_NE(find(ms, "fabric.ib_state", "")->reason.find("/sys/class/infiniband"), std::string::npos);
}

TEST(Fabric, HealthyPortsPassBothProfiles) {
  FakeFabric f;
  for (const char* profile : {"default", "h200"}) {
    const VetReport r = vet_fabric(f, profile);
    EXPECT_EQ(r.verdict(), "pass") << profile;
    const CheckResult* rate = find(r, "fabric.ib_rate", "mlx5_1/1");
    ASSERT_NE(rate, nullptr);
    EXPECT_EQ(rate->value, 400.0);
    EXPECT_EQ(rate->status, CheckStatus::kPass);
    EXPECT_EQ(find(r, "fabric.ib_link_flaps", "mlx5_0/1")->value, 0.0);
  }
}

TEST(Fabric, PortDownWarnsInDefaultAndFailsInH200) {
  FakeFabric f;
  f.port("mlx5_1", "1: DOWN", "3: Disabled", "10 Gb/sec (4X SDR)", "InfiniBand");
  const VetReport d = vet_fabric(f, "default");
  EXPECT_EQ(find(d, "fabric.ib_state", "mlx5_1/1")->status, CheckStatus::kWarn);
  EXPECT_EQ(find(d, "fabric.ib_phys_state", "mlx5_1/1")->status, CheckStatus::kWarn);
  EXPECT_EQ(find(d, "fabric.ib_state", "mlx5_0/1")->status, CheckStatus::kPass);
  // A down port's nominal rate says nothing: skipped, with the state as the reason.
  const CheckResult* rate = find(d, "fabric.ib_rate", "mlx5_1/1");
  EXPECT_EQ(rate->status, CheckStatus::kSkip);
  EXPECT_NE(rate->reason.find("DOWN"), std::string::npos);
  const VetReport h = vet_fabric(f, "h200");
  EXPECT_EQ(find(h, "fabric.ib_state", "mlx5_1/1")->status, CheckStatus::kFail);
  EXPECT_EQ(h.verdict(), "fail");
}

TEST(Fabric, DevicesParameterLeavesOtherPortsOut) {
  FakeFabric f;
  f.port("mlx5_1", "1: DOWN", "3: Disabled", "10 Gb/sec (4X SDR)", "Ethernet");
  const auto ms = measure_fabric(f.root(), "mlx5_0", 0, [] {});
  EXPECT_NE(find(ms, "fabric.ib_state", "mlx5_0/1"), nullptr);
  EXPECT_EQ(find(ms, "fabric.ib_state", "mlx5_1/1"), nullptr);
  const auto none = measure_fabric(f.root(), "mlx5_9", 0, [] {});
  ASSERT_NE(find(none, "fabric.ib_state", ""), nullptr);
  EXPECT_EQ(find(none, "fabric.ib_state", "")->status, CheckStatus::kSkip);
}

TEST(Fabric, WrongRateWarnsInH200AndFailsBelowAProfilesFloor) {
  FakeFabric f;
  f.port("mlx5_0", "4: ACTIVE", "5: LinkUp", "200 Gb/sec (4X HDR)", "InfiniBand");
  const VetReport h = vet_fabric(f, "h200");
  const CheckResult* rate = find(h, "fabric.ib_rate", "mlx5_0/1");
  ASSERT_NE(rate, nullptr);
  EXPECT_EQ(rate->value, 200.0);
  EXPECT_EQ(rate->status, CheckStatus::kWarn);
  EXPECT_EQ(find(h, "fabric.ib_rate", "mlx5_1/1")->status, CheckStatus::kPass);

  TempDir dir("fabric-profile-");
  const std::string site = dir.file("site.toml", "name = \"site\"\ninherits = \"h200\"\n[checks.\"fabric.ib_rate\"]\nfail_below = 400\n");
  const VetReport s = vet_fabric(f, site);
  EXPECT_EQ(find(s, "fabric.ib_rate", "mlx5_0/1")->status, CheckStatus::kFail);
}

TEST(Fabric, LinkDownedRisingDuringTheWindowIsAFlap) {
  FakeFabric f;
  // The hook runs between the probe's two reads, as a flapping link would
  // bump the counter while vet watches.
  const auto ms = measure_fabric(f.root(), "", 0, [&] { f.counter("mlx5_1", "link_downed", 5); });
  const Measurement* flaps = find(ms, "fabric.ib_link_flaps", "mlx5_1/1");
  ASSERT_NE(flaps, nullptr);
  EXPECT_EQ(flaps->value, 2.0);
  EXPECT_EQ(find(ms, "fabric.ib_link_flaps", "mlx5_0/1")->value, 0.0);
  EXPECT_EQ(find(ms, "fabric.ib_link_downed", "mlx5_1/1")->value, 3.0);  // the first read

  Profile p = load_profile("default").value();
  EXPECT_EQ(judge(*flaps, p, std::nullopt).status, CheckStatus::kFail);
  EXPECT_EQ(judge(*find(ms, "fabric.ib_link_flaps", "mlx5_0/1"), p, std::nullopt).status, CheckStatus::kPass);
  // A counter reset between the reads is not a flap.
  const auto reset = measure_fabric(f.root(), "", 0, [&] { f.counter("mlx5_1", "link_downed", 0); });
  EXPECT_EQ(find(reset, "fabric.ib_link_flaps", "mlx5_1/1")->value, 0.0);
}

TEST(Fabric, SlingshotRestartsAreCountedAndARestartDuringTheWindowIsAFlap) {
  FakeFabric f;
  f.cxi_restart(0, "1764620000");
  const auto ms = measure_fabric(f.root(), "", 0, [&] { f.cxi_restart(1, "1764620100"); });
  const Measurement* restarts = find(ms, "fabric.cxi_link_restarts", "cxi0");
  ASSERT_NE(restarts, nullptr);
  EXPECT_EQ(restarts->value, 1.0);
  EXPECT_EQ(find(ms, "fabric.cxi_link_flaps", "cxi0")->value, 1.0);
  Profile p = load_profile("default").value();
  EXPECT_EQ(judge(*find(ms, "fabric.cxi_link_flaps", "cxi0"), p, std::nullopt).status, CheckStatus::kFail);
}

// Captured report layouts: perftest 4.5 with --report_gbits and -D (peak
// reads 0.00 in duration mode), a CPU-frequency warning between header and
// row, and the older three-column latency table.
constexpr const char* kBwReport =
    "---------------------------------------------------------------------------------------\n"
    "                    RDMA_Write BW Test\n"
    " Dual-port       : OFF          Device         : mlx5_0\n"
    " Number of qps   : 4            Transport type : IB\n"
    "---------------------------------------------------------------------------------------\n"
    " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"
    "Conflicting CPU frequency values detected: 1500.000000 != 3300.016000. CPU Frequency is not max.\n"
    " 65536      1512034          0.00               391.87               0.747433\n"
    "---------------------------------------------------------------------------------------\n";

constexpr const char* kBwSweep =
    " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"
    " 2          5000             0.14               0.12                 7.5\n"
    " 8388608    5000             197.10             196.92               0.002934\n";

constexpr const char* kLatReport =
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]\n"
    " 2       1000          1.76           6.12         1.79                1.80             0.06            1.88                    6.12\n";

constexpr const char* kLatOld =
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]\n"
    " 2        1000          1.85           28.40          2.05\n";

TEST(Perftest, BandwidthIsTheAverageOfTheLastRow) {
  auto bw = parse_perftest_bw(kBwReport);
  ASSERT_TRUE(bw) << bw.error().message;
  EXPECT_DOUBLE_EQ(*bw, 391.87);
  auto sweep = parse_perftest_bw(kBwSweep);
  ASSERT_TRUE(sweep) << sweep.error().message;
  EXPECT_DOUBLE_EQ(*sweep, 196.92);
}

TEST(Perftest, LatencyIsTheTypicalColumn) {
  auto lat = parse_perftest_lat(kLatReport);
  ASSERT_TRUE(lat) << lat.error().message;
  EXPECT_DOUBLE_EQ(*lat, 1.79);
  auto old = parse_perftest_lat(kLatOld);
  ASSERT_TRUE(old) << old.error().message;
  EXPECT_DOUBLE_EQ(*old, 2.05);
}

TEST(Perftest, ErrorsAndOtherUnitsAreRefusedWithWhatPerftestSaid) {
  auto refused = parse_perftest_bw(" Couldn't connect to node2:18515\nUnable to open file descriptor for socket connection\n");
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("Unable to open file descriptor"), std::string::npos);
  auto mb = parse_perftest_bw(" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n 65536 5000 11000.1 10990.5 0.17\n");
  ASSERT_FALSE(mb);
  EXPECT_NE(mb.error().message.find("Gb/sec"), std::string::npos);
  // A header and no row (the client died mid-test), a truncated row, garbage.
  EXPECT_FALSE(parse_perftest_bw(" #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]\n"));
  EXPECT_FALSE(parse_perftest_bw(" #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]\n 65536 5000 1.0\n"));
  EXPECT_FALSE(parse_perftest_lat(std::string(1000, '#')));
  EXPECT_FALSE(parse_perftest_lat(""));
  EXPECT_FALSE(parse_perftest_bw(" #bytes #iterations BW peak[Gb/sec] BW average[Gb/sec]\n 65536 5000 1.0 nan\n"));
}

TEST(Perftest, TheRealToolWithoutHardwareGivesAnErrorNamingTheDevice) {
  if (!perftest_missing().empty()) GTEST_SKIP() << perftest_missing();
  if (!hw::read_ib_ports("").empty()) GTEST_SKIP() << "this machine has RDMA ports";
  EXPECT_FALSE(gpudirect_available("/"));  // Debian's perftest has no --use_cuda, whatever the modules
  PerftestArgs a{{"mlx5_0", 1}, 18515, std::nullopt, 1};
  auto out = capture_output(perftest_bw_argv(a, ""), 20);
  ASSERT_TRUE(out) << out.error().message;
  auto bw = parse_perftest_bw(out->output);
  ASSERT_FALSE(bw);
  EXPECT_NE(bw.error().message.find("device"), std::string::npos) << bw.error().message;
}

TEST(Perftest, CommandLines) {
  PerftestArgs a{{"mlx5_2", 1}, 18519, 2, 2};
  const auto server = perftest_bw_argv(a, "");
  const auto client = perftest_bw_argv(a, "node1");
  EXPECT_EQ(server.front(), "ib_write_bw");
  EXPECT_EQ(client.back(), "node1");
  EXPECT_EQ(client.size(), server.size() + 1);
  const std::string joined = fmt::format("{}", fmt::join(client, " "));
  for (const char* want : {"-d mlx5_2", "-i 1", "-p 18519", "--report_gbits", "--use_cuda=2", "-D 2"})
    EXPECT_NE(joined.find(want), std::string::npos) << want << " in " << joined;
  EXPECT_EQ(perftest_lat_argv(a, "node1").front(), "ib_write_lat");
}

TEST(Perftest, ActivePortsOnly) {
  FakeFabric f;
  f.port("mlx5_1", "1: DOWN", "2: Polling", "10 Gb/sec (4X SDR)", "InfiniBand");
  const auto ports = active_rdma_ports(f.root());
  ASSERT_EQ(ports.size(), 1u);
  EXPECT_EQ(ports[0].device, "mlx5_0");
  TempDir empty("no-peermem-");
  EXPECT_FALSE(gpudirect_available(empty.path()));
}

TEST(RdmaJudgement, SlowPairIsJudgedAgainstTheMedianAndItsCommonPortFailsTheNode) {
  Profile p = load_profile("default").value();
  std::vector<RdmaResult> rs;
  auto add = [&](const std::string& a, const std::string& b, double bw, const std::string& dev_a = "mlx5_0/1",
                 const std::string& dev_b = "mlx5_0/1") {
    RdmaResult r;
    r.a = a;
    r.b = b;
    r.device = dev_a;
    r.peer_device = dev_b;
    r.bandwidth_gbits = bw;
    r.latency_us = 2;
    r.status = CheckStatus::kPass;
    rs.push_back(r);
  };
  // A four-node ring; n3's port is at a quarter of the others'.
  add("n0", "n1", 390);
  add("n1", "n2", 388);
  add("n2", "n3", 95);
  add("n3", "n0", 96);
  judge_rdma(rs, p);
  EXPECT_EQ(rs[0].status, CheckStatus::kPass);
  EXPECT_EQ(rs[2].status, CheckStatus::kFail);
  EXPECT_NE(rs[2].reason.find("median"), std::string::npos);

  ClusterReport r;
  for (const char* n : {"n0", "n1", "n2", "n3"}) {
    NodeResult nr;
    nr.name = n;
    nr.report = VetReport{};
    r.nodes.push_back(nr);
  }
  r.rdma = rs;
  judge_nodes(r);
  EXPECT_EQ(r.nodes[3].status, CheckStatus::kFail);  // bad with both of its peers
  EXPECT_EQ(r.nodes[2].status, CheckStatus::kWarn);  // one bad pair: which end is unknown
  EXPECT_EQ(r.nodes[0].status, CheckStatus::kWarn);
  EXPECT_EQ(r.nodes[1].status, CheckStatus::kPass);
  // Skipped pairs (no RDMA hardware) judge nobody.
  ClusterReport s = r;
  for (auto& x : s.rdma) {
    x = RdmaResult{x.a, x.b};
    x.reason = "no active InfiniBand or RoCE port";
  }
  judge_nodes(s);
  for (const auto& n : s.nodes) EXPECT_EQ(n.status, CheckStatus::kPass) << n.name;
}

TEST(SoftwareDrift, EnvironmentTextIsSortedFilteredAndIgnoresNamedVariables) {
  const std::vector<std::string> env = {"NCCL_SOCKET_IFNAME=ib0", "PATH=/bin", "NCCL_IB_HCA=mlx5_0,mlx5_1", "FI_PROVIDER=cxi",
                                        "NCCL_DEBUG=INFO", "NCCL_NOEQUALS"};
  EXPECT_EQ(environment_text(env, "NCCL_", {}), "NCCL_DEBUG=INFO NCCL_IB_HCA=mlx5_0,mlx5_1 NCCL_SOCKET_IFNAME=ib0");
  EXPECT_EQ(environment_text(env, "NCCL_", {"NCCL_DEBUG"}), "NCCL_IB_HCA=mlx5_0,mlx5_1 NCCL_SOCKET_IFNAME=ib0");
  EXPECT_EQ(environment_text(env, "FI_", {}), "FI_PROVIDER=cxi");
  EXPECT_EQ(environment_text({"PATH=/bin"}, "FI_", {}), "");
}

TEST(SoftwareDrift, ContainerIdentityFromEachRuntime) {
  TempDir root("container-root-");
  EXPECT_EQ(container_identity({"PATH=/bin"}, root.path()).text, "");
  EXPECT_NE(container_identity({"PATH=/bin"}, root.path()).source, "");
  const auto pyxis = container_identity({"PYXIS_CONTAINER_IMAGE=nvcr.io#nvidia/pytorch:25.01-py3", "NVIDIA_BUILD_ID=134"}, root.path());
  EXPECT_EQ(pyxis.text, "PYXIS_CONTAINER_IMAGE=nvcr.io#nvidia/pytorch:25.01-py3 NVIDIA_BUILD_ID=134");
  EXPECT_NE(pyxis.source.find("Pyxis"), std::string::npos);
  EXPECT_NE(pyxis.source.find("NGC"), std::string::npos);
  EXPECT_EQ(container_identity({"UENV_MOUNT_LIST=/s/prgenv.squashfs:/user-environment", "UENV_VIEW=default"}, root.path()).text,
            "UENV_MOUNT_LIST=/s/prgenv.squashfs:/user-environment UENV_VIEW=default");
  root.file("run/.containerenv", "engine=\"podman-4.3.1\"\nname=\"train\"\nimage=\"docker.io/library/debian:12\"\nimageid=\"abc123\"\n");
  const auto podman = container_identity({"container=podman"}, root.path());
  EXPECT_EQ(podman.text, "container=podman containerenv.image=docker.io/library/debian:12 containerenv.imageid=abc123");
}

TEST(SoftwareDrift, ANodeStartedFromAnotherImageIsDrift) {
  std::vector<NodeResult> nodes;
  for (const char* image : {"pytorch:25.01", "pytorch:25.01", "pytorch:24.12"}) {
    NodeResult n;
    n.name = fmt::format("n{}", nodes.size());
    n.report = VetReport{};
    CheckResult c;
    c.name = "software.container";
    c.category = "software";
    c.text = std::string("PYXIS_CONTAINER_IMAGE=") + image;
    n.report->checks.push_back(c);
    nodes.push_back(n);
  }
  const auto drift = find_drift(nodes);
  ASSERT_EQ(drift.size(), 1u);
  EXPECT_EQ(drift[0].key, "software.container");
  EXPECT_EQ(drift[0].reference, "PYXIS_CONTAINER_IMAGE=pytorch:25.01");
  ClusterReport r;
  r.nodes = nodes;
  r.drift = drift;
  judge_nodes(r);
  EXPECT_EQ(r.nodes[2].status, CheckStatus::kFail);
  EXPECT_EQ(r.nodes[0].status, CheckStatus::kPass);
}

TEST(SoftwareDrift, ProbeRecordsTheEnvironmentOfTheNode) {
  ::setenv("NCCL_PACER_TEST_VARIABLE", "42", 1);
  VetOptions o;
  o.quick = true;
  o.only = {"software.nccl_env", "software.container", "software.libfabric"};
  auto r = run_vet(o);
  ::unsetenv("NCCL_PACER_TEST_VARIABLE");
  ASSERT_TRUE(r) << r.error().message;
  const CheckResult* env = find(*r, "software.nccl_env", "");
  ASSERT_NE(env, nullptr);
  EXPECT_NE(env->text.find("NCCL_PACER_TEST_VARIABLE=42"), std::string::npos) << env->text;
  EXPECT_NE(find(*r, "software.container", ""), nullptr);
  EXPECT_EQ(r->versions.count("nccl_env"), 1u);
}

}  // namespace
}  // namespace pacer::vet
