// Readings of the host from /proc and /sys: memory, THP, clock source, CPU time.
#pragma once

#include <cstdint>
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
Expected<MemInfo> read_meminfo();

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

}  // namespace pacer::hw
