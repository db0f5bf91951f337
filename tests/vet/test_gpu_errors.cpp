// vet's GPU error, topology and Grace checks against tests/telemetry/fake_nvml.cpp
// and a fake /dev, /sys tree ($PACER_VET_ROOT): a link down, NVLink errors
// rising, Xid 79 (as an NVML event and in the kernel log), retired pages, NUMA
// affinity and HMM, each with its documented status.
#include <gtest/gtest.h>

#include <ctime>
#include <map>
#include <string>
#include <vector>

#include "pacer/vet/vet.hpp"
#include "test_util.hpp"

namespace pacer::vet {
namespace {

// Sets variables for one test; the probes' child processes inherit them.
class Env {
 public:
  ~Env() {
    for (const auto& n : names_) ::unsetenv(n.c_str());
  }
  Env& set(const std::string& name, const std::string& value) {
    ::setenv(name.c_str(), value.c_str(), 1);
    names_.push_back(name);
    return *this;
  }

 private:
  std::vector<std::string> names_;
};

// A node whose kernel log is readable and empty, with both GPUs' PCI devices
// on NUMA nodes 0 and 1 and one RDMA NIC on node 0.
struct FakeTree {
  test::TempDir dir{"vet-gpu-errors-"};
  Env env;
  FakeTree() {
    dir.file("dev/kmsg", "6,1,1000,-;Linux version 6.1.0\n");
    dir.file("sys/bus/pci/devices/0000:3b:00.0/numa_node", "0\n");
    dir.file("sys/bus/pci/devices/0000:86:00.0/numa_node", "1\n");
    dir.file("sys/class/infiniband/mlx5_0/device/numa_node", "0\n");
    env.set("PACER_VET_ROOT", dir.path());
  }
};

double monotonic_now() {
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) / 1e9;
}

// Results keyed by "check|target".
std::map<std::string, CheckResult> vet(const std::string& profile, std::vector<std::string> only) {
  VetOptions o;
  o.quick = true;
  o.profile = profile;
  o.only = std::move(only);
  auto r = run_vet(o);
  EXPECT_TRUE(r) << (r ? "" : r.error().message);
  std::map<std::string, CheckResult> out;
  if (r)
    for (const auto& c : r->checks) out[c.name + "|" + c.target] = c;
  return out;
}

const std::vector<std::string> kErrors = {"gpu.xid", "gpu.xid_new", "gpu.retired_pages", "gpu.nvlink_down", "gpu.nvlink_active",
                                          "gpu.nvlink_crc", "gpu.nvlink_replay", "gpu.nvlink_recovery", "gpu.nvlink_rise"};

TEST(VetGpuErrors, HealthyNodePasses) {
  FakeTree t;
  t.env.set("PACER_FAKE_NVML_GPUS", "2");
  auto r = vet("h200", kErrors);
  for (const char* gpu : {"gpu0", "gpu1"}) {
    for (const char* c : {"gpu.xid", "gpu.xid_new", "gpu.nvlink_down", "gpu.nvlink_active", "gpu.nvlink_crc", "gpu.nvlink_rise"}) {
      const auto& res = r[std::string(c) + "|" + gpu];
      EXPECT_EQ(res.status, CheckStatus::kPass) << c << " " << gpu << ": " << res.reason;
    }
    // An H200 remaps rows instead of retiring pages.
    EXPECT_EQ(r[std::string("gpu.retired_pages|") + gpu].status, CheckStatus::kSkip);
  }
  EXPECT_EQ(r["gpu.nvlink_active|gpu0"].value, 18);
}

TEST(VetGpuErrors, LinkDownFailsOnNvlinkMachines) {
  FakeTree t;
  t.env.set("PACER_FAKE_NVML_LINK_DOWN", "3");
  auto r = vet("h200", {"gpu.nvlink_down", "gpu.nvlink_active"});
  EXPECT_EQ(r["gpu.nvlink_down|gpu0"].status, CheckStatus::kFail);
  EXPECT_EQ(r["gpu.nvlink_down|gpu0"].value, 1);
  EXPECT_NE(r["gpu.nvlink_down|gpu0"].reason.find("link 3"), std::string::npos) << r["gpu.nvlink_down|gpu0"].reason;
  EXPECT_EQ(r["gpu.nvlink_active|gpu0"].status, CheckStatus::kFail);
  EXPECT_EQ(r["gpu.nvlink_down|gpu1"].status, CheckStatus::kPass);
  // The portable profile only warns: PCIe boards report unbridged links down.
  r = vet("default", {"gpu.nvlink_down"});
  EXPECT_EQ(r["gpu.nvlink_down|gpu0"].status, CheckStatus::kWarn);
}

TEST(VetGpuErrors, RisingNvlinkErrorsFail) {
  FakeTree t;
  t.env.set("PACER_FAKE_NVML_NVLINK_RISE", "5");
  auto r = vet("default", {"gpu.nvlink_rise", "gpu.nvlink_replay"});
  EXPECT_EQ(r["gpu.nvlink_rise|gpu0"].status, CheckStatus::kFail) << r["gpu.nvlink_rise|gpu0"].reason;
  EXPECT_EQ(r["gpu.nvlink_rise|gpu0"].value, 5);
  EXPECT_EQ(r["gpu.nvlink_rise|gpu1"].status, CheckStatus::kPass);
  EXPECT_EQ(r["gpu.nvlink_replay|gpu0"].value, 10);  // the second of two readings
  EXPECT_EQ(vet("h200", {"gpu.nvlink_replay"})["gpu.nvlink_replay|gpu0"].status, CheckStatus::kWarn);
}

TEST(VetGpuErrors, CrcErrorsWarnAgainstTheProfileLimit) {
  FakeTree t;
  t.env.set("PACER_FAKE_NVML_NVLINK_CRC", "7");
  auto r = vet("h200", {"gpu.nvlink_crc", "gpu.nvlink_rise"});
  EXPECT_EQ(r["gpu.nvlink_crc|gpu0"].status, CheckStatus::kWarn);
  EXPECT_EQ(r["gpu.nvlink_crc|gpu0"].value, 7);
  EXPECT_NE(r["gpu.nvlink_crc|gpu0"].reason.find("most on link 1 (7)"), std::string::npos) << r["gpu.nvlink_crc|gpu0"].reason;
  EXPECT_EQ(r["gpu.nvlink_rise|gpu0"].status, CheckStatus::kPass);  // high but steady
}

TEST(VetGpuErrors, XidEventDuringVetFails) {
  FakeTree t;
  t.env.set("PACER_FAKE_NVML_XID", "79");
  auto r = vet("default", {"gpu.xid_new", "gpu.xid"});
  EXPECT_EQ(r["gpu.xid_new|gpu0"].status, CheckStatus::kFail);
  EXPECT_EQ(r["gpu.xid_new|gpu0"].value, 1);
  EXPECT_NE(r["gpu.xid_new|gpu0"].reason.find("79"), std::string::npos) << r["gpu.xid_new|gpu0"].reason;
  EXPECT_EQ(r["gpu.xid_new|gpu1"].status, CheckStatus::kPass);
  EXPECT_EQ(r["gpu.xid|gpu0"].status, CheckStatus::kPass);  // the kernel log of the fake has none
}

TEST(VetGpuErrors, KernelLogXids) {
  FakeTree t;
  // Long before this vet: a critical Xid 79 on gpu0, an application's Xid 13
  // on gpu1, and a 79 of a GPU NVML no longer lists. During it: an Xid 31 on gpu1.
  const std::string during = std::to_string(static_cast<long long>((monotonic_now() + 5) * 1e6));
  t.dir.file("dev/kmsg",
             "6,1,1000,-;Linux version 6.1.0\n"
             "4,2,2000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
             "4,3,2500000,-;NVRM: Xid (PCI:0000:86:00): 13, pid=4242, name=python, Graphics Exception\n"
             "4,4,2600000,-;NVRM: Xid (PCI:0000:c1:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
             "4,5," + during + ",-;NVRM: Xid (PCI:0000:86:00): 31, pid=4242, name=python, Ch 00000010, MMU Fault\n"
             "4,6,2700000,-;NVRM: Xid (PCI:zz:86:00): 79, garbage\n");
  auto r = vet("default", {"gpu.xid", "gpu.xid_new"});
  EXPECT_EQ(r["gpu.xid|gpu0"].status, CheckStatus::kFail);
  EXPECT_NE(r["gpu.xid|gpu0"].reason.find("Xid 79"), std::string::npos) << r["gpu.xid|gpu0"].reason;
  EXPECT_EQ(r["gpu.xid_new|gpu0"].status, CheckStatus::kPass);
  EXPECT_EQ(r["gpu.xid|gpu1"].status, CheckStatus::kWarn);  // Xids 13 and 31: not critical
  EXPECT_EQ(r["gpu.xid|gpu1"].value, 2);
  EXPECT_EQ(r["gpu.xid_new|gpu1"].status, CheckStatus::kFail);
  EXPECT_EQ(r["gpu.xid_new|gpu1"].value, 1);
  EXPECT_EQ(r["gpu.xid|pci:0000:c1:00"].status, CheckStatus::kFail);
}

TEST(VetGpuErrors, UnreadableKernelLogSkipsOnlyTheBootCount) {
  FakeTree t;
  std::filesystem::remove(t.dir.path() + "/dev/kmsg");
  t.env.set("PACER_FAKE_NVML_XID", "48");
  auto r = vet("default", {"gpu.xid", "gpu.xid_new"});
  EXPECT_EQ(r["gpu.xid|gpu0"].status, CheckStatus::kSkip);
  EXPECT_NE(r["gpu.xid|gpu0"].reason.find("kernel log not readable"), std::string::npos) << r["gpu.xid|gpu0"].reason;
  EXPECT_EQ(r["gpu.xid_new|gpu0"].status, CheckStatus::kFail);  // NVML still saw it
}

TEST(VetGpuErrors, PendingPageRetirementFails) {
  FakeTree t;
  t.env.set("PACER_FAKE_NVML_RETIRED", "2").set("PACER_FAKE_NVML_RETIRE_PENDING", "1");
  auto r = vet("default", {"gpu.retired_pages"});
  EXPECT_EQ(r["gpu.retired_pages|gpu0"].status, CheckStatus::kFail);
  EXPECT_EQ(r["gpu.retired_pages|gpu0"].value, 2);
  EXPECT_EQ(r["gpu.retired_pages|gpu1"].status, CheckStatus::kPass);
}

TEST(VetGpuTopology, NumaAffinity) {
  FakeTree t;
  auto r = vet("h200", {"gpu.numa_node", "gpu.nic_numa"});
  EXPECT_EQ(r["gpu.numa_node|gpu0"].value, 0);
  EXPECT_EQ(r["gpu.numa_node|gpu1"].value, 1);
  EXPECT_EQ(r["gpu.nic_numa|gpu0"].status, CheckStatus::kPass);
  EXPECT_EQ(r["gpu.nic_numa|gpu1"].status, CheckStatus::kWarn);  // its socket has no NIC
  const std::string site = t.dir.file("site.toml", "name = \"site\"\ninherits = \"h200\"\n[checks.\"gpu.numa_node\"]\nnuma_nodes = \"0,0\"\n");
  r = vet(site, {"gpu.numa_node"});
  EXPECT_EQ(r["gpu.numa_node|gpu0"].status, CheckStatus::kPass);
  EXPECT_EQ(r["gpu.numa_node|gpu1"].status, CheckStatus::kFail);
  EXPECT_NE(r["gpu.numa_node|gpu1"].reason.find("expects 0"), std::string::npos) << r["gpu.numa_node|gpu1"].reason;
  const std::string bad = t.dir.file("bad.toml", "name = \"bad\"\n[checks.\"gpu.numa_node\"]\nnuma_nodes = \"0,x\"\n");
  r = vet(bad, {"gpu.numa_node"});
  EXPECT_EQ(r["gpu.numa_node|"].status, CheckStatus::kError);
  EXPECT_NE(r["gpu.numa_node|"].reason.find("numa_nodes"), std::string::npos) << r["gpu.numa_node|"].reason;
  std::filesystem::remove_all(t.dir.path() + "/sys/class/infiniband");
  r = vet("h200", {"gpu.nic_numa"});
  EXPECT_EQ(r["gpu.nic_numa|gpu0"].status, CheckStatus::kSkip);
}

TEST(VetGrace, HmmStatus) {
  FakeTree t;
  EXPECT_EQ(vet("gh200", {"gpu.hmm"})["gpu.hmm|"].status, CheckStatus::kSkip);  // no driver
  t.dir.file("sys/module/nvidia/initstate", "live\n");
  EXPECT_EQ(vet("gh200", {"gpu.hmm"})["gpu.hmm|"].status, CheckStatus::kSkip);  // nvidia_uvm not loaded yet
  t.dir.file("sys/module/nvidia_uvm/parameters/uvm_disable_hmm", "N\n");
  auto r = vet("gh200", {"gpu.hmm"});
  EXPECT_EQ(r["gpu.hmm|"].text, "enabled");
  EXPECT_EQ(r["gpu.hmm|"].status, CheckStatus::kWarn);
  EXPECT_EQ(vet("default", {"gpu.hmm"})["gpu.hmm|"].status, CheckStatus::kPass);
  t.dir.file("sys/module/nvidia_uvm/parameters/uvm_disable_hmm", "Y\n");
  EXPECT_EQ(vet("gh200", {"gpu.hmm"})["gpu.hmm|"].status, CheckStatus::kPass);
}

TEST(VetGrace, C2cSkipsWithoutGh200) {
  FakeTree t;
  auto r = vet("gh200", {"gpu.c2c_bandwidth"});
  EXPECT_EQ(r["gpu.c2c_bandwidth|"].status, CheckStatus::kSkip);
  EXPECT_NE(r["gpu.c2c_bandwidth|"].reason.find("no GH200"), std::string::npos) << r["gpu.c2c_bandwidth|"].reason;
}

}  // namespace
}  // namespace pacer::vet
