// What the host knows about its GPUs beyond NVML: Xid reports in the kernel log, PCI NUMA affinity, RDMA NICs, nvidia_uvm's HMM.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pacer/core/error.hpp"

namespace pacer::hw {

// One "NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus." line.
struct KernelXid {
  std::optional<double> time_s;  // seconds after boot, from a /dev/kmsg record; empty in plain text
  std::string pci;               // "0000:3b:00" (domain:bus:device), lower case
  unsigned xid = 0;
  std::string message;           // what follows the Xid number
};
// Lines that are not Xid reports, or are malformed, are skipped. Accepts
// /dev/kmsg records ("PRIO,SEQ,USEC,FLAGS;TEXT") and plain text (dmesg).
std::vector<KernelXid> parse_kernel_xids(std::string_view text);
// The Xid reports in the kernel's ring buffer: root + /dev/kmsg, read without
// blocking (at most 64 MiB). Fails where the log is not readable (dmesg_restrict
// without CAP_SYSLOG, a container without /dev/kmsg); the message names the path.
Expected<std::vector<KernelXid>> read_kernel_xids(const std::string& root = "");

// The NUMA node of a PCI device ("0000:3b:00.0") from root + /sys/bus/pci/devices;
// -1 where the machine has no NUMA affinity.
Expected<int> read_pci_numa_node(const std::string& pci_bus_id, const std::string& root = "");

// RDMA devices (InfiniBand, RoCE) from root + /sys/class/infiniband and their NUMA nodes.
struct RdmaNic {
  std::string name;   // "mlx5_0"
  int numa_node = -1;
};
std::vector<RdmaNic> read_rdma_nics(const std::string& root = "");

// nvidia_uvm's HMM setting from root + /sys/module/nvidia_uvm/parameters/uvm_disable_hmm:
// "enabled" or "disabled". Fails with a message starting "no NVIDIA driver" without the
// nvidia module, "nvidia_uvm not loaded" without nvidia_uvm.
Expected<std::string> read_uvm_hmm(const std::string& root = "");

}  // namespace pacer::hw
