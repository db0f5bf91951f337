// The kernel-log Xid parser and the sysfs readers behind vet's GPU error, topology and Grace checks.
#include "pacer/hw/gpu_errors.hpp"

#include <gtest/gtest.h>

#include "test_util.hpp"

namespace pacer::hw {
namespace {

TEST(KernelXid, ParsesKmsgRecordsAndPlainText) {
  const auto xs = parse_kernel_xids(
      "6,1,1000,-;Linux version 6.1.0\n"
      "4,812,2000123,-;NVRM: Xid (PCI:0000:3B:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
      " SUBSYSTEM=pci\n"
      "[  12.5] NVRM: Xid (PCI:0001:86:00.0): 48, pid=77, DBE (double bit error) ECC error\n");
  ASSERT_EQ(xs.size(), 2u);
  EXPECT_EQ(xs[0].pci, "0000:3b:00");
  EXPECT_EQ(xs[0].xid, 79u);
  ASSERT_TRUE(xs[0].time_s);
  EXPECT_DOUBLE_EQ(*xs[0].time_s, 2.000123);
  EXPECT_EQ(xs[0].message, "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.");
  EXPECT_EQ(xs[1].pci, "0001:86:00");
  EXPECT_EQ(xs[1].xid, 48u);
  EXPECT_FALSE(xs[1].time_s);  // dmesg's own timestamps are not trusted for "during vet"
}

TEST(KernelXid, SkipsMalformedLines) {
  const auto xs = parse_kernel_xids(
      "NVRM: Xid (PCI:0000:3b:00) 79\n"          // no colon after the address
      "NVRM: Xid (PCI:zz:3b:00): 79, x\n"        // not hex
      "NVRM: Xid (PCI:0000:3b:00): , x\n"        // no number
      "NVRM: Xid (PCI:0000:3b:00): 99999999999999999999, x\n"  // overflows
      "NVRM: Xid (PCI:123456789:3b:00): 79, x\n"  // domain too long
      "NVRM: Xid (PCI:0000:3b\n"                  // cut off
      "4,1,notanumber,-;NVRM: Xid (PCI:0000:3b:00): 13, ok\n");
  ASSERT_EQ(xs.size(), 1u);
  EXPECT_EQ(xs[0].xid, 13u);
  EXPECT_FALSE(xs[0].time_s);
}

TEST(KernelXid, ReadsAFileInPlaceOfDevKmsg) {
  test::TempDir dir("kmsg-");
  EXPECT_FALSE(read_kernel_xids(dir.path()));  // no dev/kmsg: the error names it
  EXPECT_NE(read_kernel_xids(dir.path()).error().message.find("/dev/kmsg"), std::string::npos);
  // Longer than one read, and no newline at the end.
  std::string text(20000, 'x');
  text += "\n4,2,3000000,-;NVRM: Xid (PCI:0000:3b:00): 94, Contained ECC error";
  dir.file("dev/kmsg", text);
  auto xs = read_kernel_xids(dir.path());
  ASSERT_TRUE(xs) << xs.error().message;
  ASSERT_EQ(xs->size(), 1u);
  EXPECT_EQ((*xs)[0].xid, 94u);
}

TEST(GpuSysfs, NumaNodesNicsAndHmm) {
  test::TempDir dir("gpu-sysfs-");
  dir.file("sys/bus/pci/devices/0000:3b:00.0/numa_node", "1\n");
  dir.file("sys/bus/pci/devices/0000:86:00.0/numa_node", "-1\n");
  dir.file("sys/bus/pci/devices/0000:c1:00.0/numa_node", "one\n");
  EXPECT_EQ(read_pci_numa_node("0000:3b:00.0", dir.path()).value(), 1);
  EXPECT_EQ(read_pci_numa_node("0000:86:00.0", dir.path()).value(), -1);
  EXPECT_FALSE(read_pci_numa_node("0000:c1:00.0", dir.path()));
  EXPECT_FALSE(read_pci_numa_node("0000:00:00.0", dir.path()));
  EXPECT_TRUE(read_rdma_nics(dir.path()).empty());
  dir.file("sys/class/infiniband/mlx5_1/device/numa_node", "1\n");
  dir.file("sys/class/infiniband/mlx5_0/device/numa_node", "0\n");
  const auto nics = read_rdma_nics(dir.path());
  ASSERT_EQ(nics.size(), 2u);
  EXPECT_EQ(nics[0].name, "mlx5_0");
  EXPECT_EQ(nics[1].numa_node, 1);

  auto hmm = read_uvm_hmm(dir.path());
  ASSERT_FALSE(hmm);
  EXPECT_NE(hmm.error().message.find("no NVIDIA driver"), std::string::npos) << hmm.error().message;
  dir.file("sys/module/nvidia/initstate", "live\n");
  hmm = read_uvm_hmm(dir.path());
  ASSERT_FALSE(hmm);
  EXPECT_NE(hmm.error().message.find("nvidia_uvm not loaded"), std::string::npos) << hmm.error().message;
  dir.file("sys/module/nvidia_uvm/initstate", "live\n");
  EXPECT_FALSE(read_uvm_hmm(dir.path()));  // a driver without the switch
  dir.file("sys/module/nvidia_uvm/parameters/uvm_disable_hmm", "N\n");
  EXPECT_EQ(read_uvm_hmm(dir.path()).value(), "enabled");
  dir.file("sys/module/nvidia_uvm/parameters/uvm_disable_hmm", "Y\n");
  EXPECT_EQ(read_uvm_hmm(dir.path()).value(), "disabled");
  dir.file("sys/module/nvidia_uvm/parameters/uvm_disable_hmm", "maybe\n");
  EXPECT_FALSE(read_uvm_hmm(dir.path()));
}

}  // namespace
}  // namespace pacer::hw
