// Readings of the host from /proc and /sys: memory, THP, clock source, CPU time.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pacer/core/error.hpp"

namespace pacer::hw {

// Bytes, from /proc/meminfo.
struct MemInfo {
  std::uint64_t total = 0;
  std::uint64_t available = 0;
  std::uint64_t swap_total = 0;
  std::uint64_t swap_free = 0;
};
Expected<MemInfo> parse_meminfo(std::string_view text);
// `root` is prefixed to /proc (tests use a fake tree).
Expected<MemInfo> read_meminfo(const std::string& root = "");

// The selected word of a sysfs choice file such as "always [madvise] never".
Expected<std::string> parse_bracketed_choice(std::string_view text);

// Transparent huge page policy; empty strings where the kernel has no THP.
struct ThpSettings {
  std::string enabled;
  std::string defrag;
};
Expected<ThpSettings> read_thp();

Expected<std::string> read_clocksource();

// Aggregate CPU time from /proc/stat, in clock ticks.
struct CpuTimes {
  std::uint64_t busy = 0;
  std::uint64_t total = 0;
};
Expected<CpuTimes> parse_proc_stat(std::string_view text);
Expected<CpuTimes> read_cpu_times();
// CPU time this process has used (user + system), in seconds.
double process_cpu_seconds();

// CPUs this process may run on (its affinity mask, which honours cgroups and
// Slurm's task binding), in ascending order.
std::vector<int> allowed_cpus();
// Pins the calling thread to one CPU.
Status pin_current_thread(int cpu);

std::string kernel_release();
std::string hostname();

// Reads a small text file (sysfs, procfs) with trailing whitespace removed.
Expected<std::string> read_text(const std::string& path);

// ---- Counters for the telemetry sampler ----------------------------------
// Every reader below takes `root`, a directory prefixed to /proc and /sys
// ("" for the real ones), so that tests can point it at a fake tree. All
// counters are cumulative since boot (or since the process started); the
// sampler turns them into rates. Parsers skip lines they do not understand
// rather than failing, because kernels add columns over time.

// One CPU's time from a "cpuN ..." line of /proc/stat, in clock ticks.
struct CoreTimes {
  int cpu = 0;
  CpuTimes times;
};
std::vector<CoreTimes> parse_proc_stat_cores(std::string_view text);
// The aggregate line and every "cpuN" line in one read.
struct CpuStat {
  CpuTimes total;
  std::vector<CoreTimes> cores;
};
Expected<CpuStat> read_cpu_stat(const std::string& root = "");

// /proc/PID/stat: the fields the sampler uses. CPU times in clock ticks.
struct PidStat {
  int pid = 0;
  int ppid = 0;
  std::string comm;
  char state = '?';
  std::uint64_t utime = 0;
  std::uint64_t stime = 0;
  std::uint64_t rss_pages = 0;
  std::uint64_t starttime = 0;  // clock ticks after boot: with the pid, names one process or thread for good
};
// The command name may contain spaces and parentheses; it ends at the last ')'.
Expected<PidStat> parse_pid_stat(std::string_view text);

// /proc/PID/io: bytes that reached the storage layer (read_bytes,
// write_bytes) and bytes passed through read()/write() (rchar, wchar).
struct PidIo {
  std::uint64_t rchar = 0;
  std::uint64_t wchar = 0;
  std::uint64_t read_bytes = 0;
  std::uint64_t write_bytes = 0;
};
Expected<PidIo> parse_pid_io(std::string_view text);

// A process and its descendants, summed. `io_readable` is false when
// /proc/PID/io could not be read for some process (another user's process,
// or a kernel without task I/O accounting); those bytes are then missing.
struct ProcessTreeStat {
  int root_pid = 0;
  unsigned processes = 0;
  double cpu_seconds = 0;        // utime + stime of live processes in the tree
  std::uint64_t rss_bytes = 0;
  PidIo io;
  bool io_readable = true;
};
// Fails when `pid` itself is gone or a zombie (the message names it).
Expected<ProcessTreeStat> read_process_tree(int pid, const std::string& root = "");
// The two halves of read_process_tree, for samplers that list the tree (a
// scan of every process) less often than they read it: `pid` and its
// descendants, root first; and the sums over `pids` (gone ones are skipped).
Expected<std::vector<int>> process_tree_pids(int pid, const std::string& root = "");
ProcessTreeStat read_processes(int root_pid, const std::vector<int>& pids, const std::string& root = "");
long clock_ticks_per_second();
long page_size_bytes();

// /proc/net/dev: one row per interface.
struct NetDevCounters {
  std::string name;
  std::uint64_t rx_bytes = 0;
  std::uint64_t rx_packets = 0;
  std::uint64_t tx_bytes = 0;
  std::uint64_t tx_packets = 0;
};
std::vector<NetDevCounters> parse_net_dev(std::string_view text);
Expected<std::vector<NetDevCounters>> read_net_dev(const std::string& root = "");

// /sys/class/infiniband/DEV/ports/N/counters. port_rcv_data and
// port_xmit_data count 4-byte words (per the InfiniBand spec, lanes
// aggregated); the byte fields here are already multiplied by 4.
struct IbCounters {
  std::string device;  // "mlx5_0"
  int port = 0;
  std::uint64_t rx_bytes = 0;
  std::uint64_t tx_bytes = 0;
  std::uint64_t rx_packets = 0;
  std::uint64_t tx_packets = 0;
  std::uint64_t symbol_errors = 0;
  std::uint64_t link_downed = 0;
  std::uint64_t rcv_errors = 0;
};
// Every port of every device; empty (not an error) on a node without InfiniBand.
std::vector<IbCounters> read_ib_counters(const std::string& root = "");

// One InfiniBand or RoCE port's link, beside its counters: state ("ACTIVE"),
// physical state ("LinkUp") and rate as sysfs words them, without the
// numeric code sysfs puts first ("4: ACTIVE"). A counter the driver does not
// provide is nullopt, not 0: vet must not pass a check it could not read.
struct IbPort {
  std::string device;
  int port = 0;
  std::string state;
  std::string phys_state;
  std::string rate;            // "400 Gb/sec (4X NDR)", as written
  std::optional<double> rate_gbits;  // 400: the leading number of `rate`
  std::string link_layer;      // "InfiniBand" or "Ethernet" (RoCE)
  std::optional<std::uint64_t> symbol_errors;
  std::optional<std::uint64_t> link_downed;
  std::optional<std::uint64_t> rcv_errors;
};
// Every port of every device under ROOT/sys/class/infiniband, sorted; empty
// on a node without RDMA devices.
std::vector<IbPort> read_ib_ports(const std::string& root = "");
// The RDMA devices' directories (ROOT/sys/class/infiniband/DEV), sorted by name.
std::vector<std::filesystem::path> ib_device_dirs(const std::string& root = "");
// "4: ACTIVE" -> "ACTIVE"; text without a "N: " prefix is returned trimmed.
std::string strip_sysfs_code(std::string_view text);
// The leading number of a sysfs rate ("400 Gb/sec (4X NDR)" -> 400).
std::optional<double> parse_ib_rate(std::string_view text);

// /proc/diskstats: whole devices and partitions as the kernel lists them.
// Sectors are always 512 bytes there, whatever the device's block size.
struct DiskCounters {
  std::string name;
  std::uint64_t reads = 0;
  std::uint64_t read_bytes = 0;
  std::uint64_t writes = 0;
  std::uint64_t write_bytes = 0;
  std::uint64_t io_ms = 0;  // milliseconds with I/O in flight
};
std::vector<DiskCounters> parse_diskstats(std::string_view text);
Expected<std::vector<DiskCounters>> read_diskstats(const std::string& root = "");

}  // namespace pacer::hw
