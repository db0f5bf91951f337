// The saturation scorer: how busy a run kept each resource, from its job catalog, and which one bounded it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"

namespace pacer::telemetry {
class Catalog;
}

namespace pacer::score {

// One number behind a score, and where it came from ("gpm.tensor_util, mean
// of 8 GPUs over 1200 samples"). `value` is in `unit` (ratio = fraction).
struct Evidence {
  std::string what;
  double value = 0;
  std::string unit;
  std::string source;
};

// A resource's saturation in [0, 1]; no value when it could not be judged,
// and then `why_not` says why. Names: compute, memory, communication, input,
// host_cpu, io.
struct Score {
  std::string name;
  std::optional<double> value;
  std::vector<Evidence> evidence;
  std::string why_not;
};

// What the catalog says about one run, reduced to the figures the scorer
// judges (means over the scoring window). Filled by collect_facts(); tests
// build it directly to check the rules.
struct RunFacts {
  std::int64_t run_id = 0;
  double window_start = 0, window_end = 0;  // Unix seconds
  bool window_from_steps = false;           // the steps' span rather than the whole run
  int nodes = 0, gpus = 0, ranks = 0;
  double cpus = 0;  // logical CPUs on all nodes of the run
  std::int64_t samples = 0;

  // Per-GPU means averaged over GPUs; nullopt when no sample had the metric.
  struct GpuMetric {
    double mean = 0;      // mean of the per-GPU means
    double min = 0;       // lowest per-GPU mean
    std::string min_gpu;  // "node:index" of that GPU
    int gpus = 0;
    std::int64_t samples = 0;
  };
  std::optional<GpuMetric> sm_util, tensor_util, dram_bw_util, fp16_util, fp32_util, fp64_util, gpu_util,
      gpu_mem_util, nvlink_bytes_per_s;  // nvlink: mean of tx and rx, bytes/s per GPU
  double nvlink_capacity_bytes_per_s = 0;  // per GPU and direction, from the GPU name; 0 = unknown

  std::optional<double> cpu_busy;           // all-CPU busy fraction, mean over nodes
  std::optional<double> busiest_core;       // highest per-core mean busy fraction
  std::optional<double> process_cores;      // the command's process tree, cores busy (sum over nodes)
  std::optional<double> disk_busy;          // busiest block device, mean busy fraction
  std::string disk_busy_device;             // "node:device"
  std::optional<double> net_bytes_per_s;    // busiest node, max(rx, tx) over Ethernet + InfiniBand
  double nic_capacity_bytes_per_s = 0;      // per node and direction, from ScoreOptions; 0 = unknown

  // The command's busiest thread over the window (the threads table): the
  // thread with the most CPU time on any node, its mean share of a core over
  // the window's intervals, and how many threads of its process were busy.
  struct Thread {
    std::string node;
    int pid = 0, tid = 0;
    std::string comm;
    bool main = false, python = false;
    double busy = 0;               // mean share of one core over the node's intervals
    double busy_threads = 0;       // mean count of threads at >= half a core in the busiest thread's process
    std::int64_t intervals = 0;    // the node's intervals with a thread record
  };
  std::optional<Thread> busiest_thread;

  std::int64_t steps = 0;
  double step_time_s = 0;     // sum over ranks and steps
  std::optional<double> data_wait_s, comm_s;  // sums over the steps that report them
  double data_wait_step_time_s = 0, comm_step_time_s = 0;  // step time of those steps
  std::optional<double> worst_rank_data_wait_share;
  int worst_rank = -1;
  std::string catalog_status = "ok";
};

struct Verdict {
  // compute-bound, memory-bound, communication-bound, input-bound,
  // launch-bound, host-bound (one thread: the sentence starts
  // "host-bound (one thread):"), host-cpu-bound, io-bound, unsaturated, idle,
  // unknown.
  std::string kind;
  std::string sentence;  // one sentence, starting with the kind
};

struct ScoreReport {
  std::string db;
  RunFacts facts;
  std::vector<Score> scores;
  Verdict verdict;
  std::vector<std::string> not_judged;  // "memory: no GPM DRAM activity (needs Hopper or newer)"
};

struct ScoreOptions {
  std::optional<std::int64_t> run_id;   // default: the run that started last
  double nic_capacity_bytes_per_s = 0;  // per node and direction; 0: network utilisation not judged
};

// Thresholds of the verdict (docs/score.md explains them).
inline constexpr double kInputBoundShare = 0.25;
inline constexpr double kCommBoundShare = 0.25;
inline constexpr double kLinkBound = 0.7;
inline constexpr double kGpuBusy = 0.5;
inline constexpr double kMemoryBound = 0.5;
inline constexpr double kHostBound = 0.7;
inline constexpr double kIoBound = 0.7;
inline constexpr double kIdle = 0.15;
// One thread holds the run back: it is busy at least kThreadBound of a core
// while, on average, fewer than kOtherThreadsBusy threads of its process are
// at half a core or more (itself included), so the work is not spread over a
// pool. (Ranks are processes: eight busy ranks on a node are eight threads
// of one each.)
inline constexpr double kThreadBound = 0.85;
inline constexpr double kOtherThreadsBusy = 1.5;
// Kernels too small to fill the GPU: a kernel runs at least kLaunchUtil of
// the time (NVML) and at least kLaunchRatio times the SM activity (GPM), yet
// less than kLaunchBusyUtil (a GPU that always has a kernel is not waiting
// on launches), and the launching thread is bound as above.
inline constexpr double kLaunchUtil = 0.15;
inline constexpr double kLaunchRatio = 2.0;
inline constexpr double kLaunchBusyUtil = 0.9;
// The command computes on the CPU (cores busy, mean): then the node's whole
// CPU load counts towards host_cpu.
inline constexpr double kCpuActiveCores = 0.25;

// Reads the figures of one run from an open catalog (read-only queries).
Expected<RunFacts> collect_facts(telemetry::Catalog& catalog, const ScoreOptions& options);
// The scores and the verdict from the figures alone (no I/O).
ScoreReport judge(const RunFacts& facts);
// Opens `db` read-only, collects and judges.
Expected<ScoreReport> score_catalog(const std::string& db, const ScoreOptions& options);

// The `pacer.score/1` document.
nlohmann::json to_json(const ScoreReport& report);
// The human table, ending in "OK: <verdict>".
std::string to_text(const ScoreReport& report);

}  // namespace pacer::score
