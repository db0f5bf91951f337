// Telemetry records: the metric catalogue, samples, training steps and events that flow from samplers to stores.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace pacer::telemetry {

// A gauge is stored as read. A counter is read as a cumulative total; the
// catalog stores its rate per second over the sampling interval (unit
// "<unit>/s") and Prometheus exposes the total as NAME_total.
enum class MetricKind { kGauge, kCounter };

// One metric pacer records. `name` is the catalog's name ("gpu.power_w"),
// `prometheus` the exposition name ("pacer_gpu_power_watts"); `unit` is the
// base unit of the stored value (ratio means a fraction in [0, 1]).
struct MetricDef {
  std::string_view name;
  std::string_view unit;
  MetricKind kind;
  std::string_view prometheus;
  std::string_view help;
};

// Every metric, in a fixed order (docs/telemetry.md lists them).
const std::vector<MetricDef>& metric_defs();
// nullptr for an unknown name.
const MetricDef* find_metric(std::string_view name);

// One value of one metric at one sampling time. `gpu` is the NVML index on
// this node (-1 for host metrics); `device` names a part of the host ("cpu3",
// "eth0", "mlx5_0:1", "nvme0n1"), empty for the whole node or GPU.
struct Reading {
  const MetricDef* metric = nullptr;
  int gpu = -1;
  std::string device;
  double value = 0;             // gauge value, or a counter's rate per second
  std::optional<double> total;  // counters: the cumulative value, base units
};

// Something that happened at a point in time: a throttle starting, a
// checkpoint, a restart, a vet result, the catalog running out of space.
// `kind` is dotted ("gpu.throttle"); `detail` is free text or JSON.
struct EventRecord {
  double t = 0;  // Unix time, seconds
  std::string kind;
  std::string detail;
  int gpu = -1;
  int rank = -1;
};

// The busiest thread of the followed process tree over one sampling
// interval (the catalog's threads table): what finds a run held back by one
// host thread (a Python loop preparing batches, a thread launching kernels).
struct ThreadRecord {
  int pid = 0;                // its process
  int tid = 0;
  std::string comm;           // the thread's name (comm in /proc/PID/task/TID/stat, 15 characters at most)
  bool main = false;          // the process's main thread (tid == pid)
  bool python = false;        // the process runs a Python interpreter (exe or argv[0] named python*)
  double busy = 0;            // share of one core (user + system time over the interval), in [0, 1]
  unsigned threads = 0;       // threads of the tree seen in both passes
  unsigned busy_threads = 0;  // threads of its process busy at least half a core (itself included)
};
// {"pid", "tid", "comm", "main", "python", "busy", "threads", "busy_threads"}.
nlohmann::json to_json(const ThreadRecord& r);

// Everything one sampling pass produced. Times are Unix seconds.
struct Sample {
  double t = 0;
  double interval_s = 0;  // since the previous pass; 0 for the first
  std::vector<Reading> readings;
  std::vector<EventRecord> events;
  std::optional<ThreadRecord> busiest_thread;  // read at most once a second: none in other passes, the first, or without a process tree
};

// One training step as a rank reports it. All durations are seconds;
// `step_time_s`, when not given, is derived from the previous step's `t` of
// the same rank. `extra_json` holds any further fields as a JSON object.
struct StepRecord {
  std::int64_t step = 0;
  double t = 0;  // Unix time the step ended; 0 = now
  int rank = -1;
  std::string node;  // hostname; empty = this host
  std::optional<double> step_time_s;
  std::optional<double> loss;
  std::optional<double> tokens;
  std::optional<double> data_wait_s;
  std::optional<double> comm_s;
  std::string extra_json;
  // Model FLOPs this rank computed in the step (forward + backward, without
  // recomputation): what the report's MFU is made of. Last, so that
  // aggregate initialisers written before it still mean the same fields.
  std::optional<double> flops;
};

// What a node is, recorded once per catalog.
struct NodeInfo {
  std::string hostname;
  unsigned cpus = 0;
  std::uint64_t memory_bytes = 0;
  std::string kernel;
};

// A GPU as the catalog's gpus table records it.
struct GpuRecord {
  unsigned index = 0;
  std::string uuid;
  std::string name;
  std::uint64_t memory_bytes = 0;
};

}  // namespace pacer::telemetry
