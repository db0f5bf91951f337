// The system sampler: one pass over /proc, /sys and NVML (through pacer::hw) turned into Readings.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "pacer/hw/nvml.hpp"
#include "pacer/hw/system.hpp"
#include "pacer/telemetry/records.hpp"

namespace pacer::telemetry {

// Per-thread CPU time of a process tree, from /proc/PID/task/TID/stat: each
// pass reads every thread of the given processes and returns the one that
// used the most CPU time since the previous pass. Threads are told apart by
// tid and start time, so a tid reused by a new thread starts from nothing
// rather than yielding a difference against another thread's time; a thread
// that ends between the listing and the read is skipped; a thread first seen
// in this pass has no interval yet and counts from the next. Not thread-safe.
class ThreadSampler {
 public:
  explicit ThreadSampler(std::string root = "") : root_(std::move(root)) {}
  // One pass at time `now` (seconds, any clock that does not step back).
  std::optional<ThreadRecord> sample(const std::vector<int>& pids, double now);

 private:
  struct Seen {
    std::uint64_t starttime = 0;
    std::uint64_t ticks = 0;  // utime + stime
    std::uint64_t pass = 0;   // the last pass that saw it
  };
  struct Interpreter {
    std::uint64_t starttime = 0;
    std::string comm;  // the main thread's, which exec changes
    bool python = false;
  };
  bool is_python(int pid, std::uint64_t starttime, const std::string& main_comm);

  std::string root_;
  std::unordered_map<int, Seen> seen_;  // by tid
  std::unordered_map<int, Interpreter> interpreters_;  // by pid
  std::uint64_t pass_ = 0;
  double prev_t_ = 0;
};

struct SamplerOptions {
  std::string root{};       // prefixed to /proc and /sys; "" for the real ones
  int pid = 0;              // process tree to follow; 0: none
  bool gpus = true;         // query NVML (and GPM where the GPU has it)
  bool per_core = true;     // one cpu.busy reading per core as well as the total
  bool threads = true;      // the followed tree's busiest thread (ThreadSampler), at most once a second
  std::shared_ptr<hw::Nvml> nvml = nullptr;  // used when set; otherwise opened when `gpus`
};

// Samples the host and its GPUs. Counters become rates from the second pass
// on. A source that fails (no NVML, no permission on /proc/PID/io, no
// InfiniBand) is skipped and explained once in notes(); sample() itself
// never fails. Not thread-safe: one thread calls sample().
class Sampler {
 public:
  explicit Sampler(SamplerOptions options);
  ~Sampler();
  Sampler(const Sampler&) = delete;
  Sampler& operator=(const Sampler&) = delete;

  const NodeInfo& node() const { return node_; }
  const std::vector<GpuRecord>& gpus() const { return gpus_; }
  // Why sources were skipped ("no NVIDIA driver ...", "GPM not supported on gpu 0 ...").
  const std::vector<std::string>& notes() const { return notes_; }
  // One pass at Unix time `now`; `self_cpu_s` is the sampler's own CPU time
  // so far (recorded as sampler.cpu_seconds), negative to leave it out.
  Sample sample(double now, double self_cpu_s = -1);
  // Follows the process tree rooted at `pid` from the next pass on.
  void follow(int pid) {
    opt_.pid = pid;
    process_alive_ = true;
    tree_pids_.clear();
  }
  // False once the followed process tree's root is gone.
  bool process_alive() const { return process_alive_; }

 private:
  void note(const std::string& text);
  void counter(Sample& s, const MetricDef* def, int gpu, const std::string& device, double total);
  void sample_host(Sample& s);
  void sample_gpus(Sample& s);
  bool root_alive() const;
  // True (and `last` set to now) when `every` seconds have passed since
  // `last`, or when `force`d by a longer period's read that includes this one.
  bool due(double& last, double every, bool force = false);

  SamplerOptions opt_;
  NodeInfo node_;
  std::vector<GpuRecord> gpus_;
  std::vector<std::string> notes_;
  std::vector<std::unique_ptr<hw::GpmSampler>> gpm_;  // by GPU; null where unsupported
  std::vector<std::uint64_t> last_reasons_;
  std::map<std::string, std::pair<double, double>> prev_totals_;  // counter key -> (time, total) last read
  double prev_t_ = 0;
  static constexpr double kFullQueryEverySeconds = 10;
  static constexpr double kSlowQueryEverySeconds = 5;
  static constexpr double kGpmEverySeconds = 1;
  static constexpr double kTreeScanEverySeconds = 1;
  static constexpr double kThreadsEverySeconds = 1;
  double last_threads_ = -1e300;
  std::vector<int> tree_pids_;
  ThreadSampler threads_;
  double last_tree_scan_ = 0;
  double last_full_query_ = -1e300;
  double last_slow_query_ = -1e300;
  double last_per_second_query_ = -1e300;
  double last_gpm_ = -1e300;
  double now_ = 0;
  hw::CpuStat prev_cpu_;
  bool have_prev_cpu_ = false;
  bool process_alive_ = true;
};

// Bits of the clock event reason mask that mean the GPU is being slowed down
// (power cap, hardware slowdown, thermal, power brake), not merely idle.
inline constexpr std::uint64_t kThrottleReasons = hw::kClockEventSwPowerCap | hw::kClockEventHwSlowdown |
                                                  hw::kClockEventSwThermal | hw::kClockEventHwThermal |
                                                  hw::kClockEventHwPowerBrake;

}  // namespace pacer::telemetry
