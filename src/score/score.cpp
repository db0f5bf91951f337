#include "pacer/score.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "pacer/core/table.hpp"
#include "pacer/telemetry/catalog.hpp"

namespace pacer::score {
namespace {

using telemetry::Catalog;
using telemetry::QueryResult;
using telemetry::Value;

double num(const Value& v) {
  if (const auto* i = std::get_if<std::int64_t>(&v)) return static_cast<double>(*i);
  if (const auto* d = std::get_if<double>(&v)) return *d;
  return NAN;
}
bool null(const Value& v) { return std::holds_alternative<std::monostate>(v); }
std::string str(const Value& v) {
  if (const auto* s = std::get_if<std::string>(&v)) return *s;
  return null(v) ? "" : fmt::format("{}", num(v));
}
std::optional<double> opt(const Value& v) {
  if (null(v)) return std::nullopt;
  return num(v);
}

// Per-direction NVLink bandwidth of one GPU by product name (NVIDIA data
// sheets: 900 GB/s total for H100/H200 SXM, 600 GB/s for A100, 1.8 TB/s for
// Blackwell). PCIe cards and unknown names: 0, not judged.
double nvlink_capacity(const std::string& gpu_name) {
  auto has = [&](const char* s) { return gpu_name.find(s) != std::string::npos; };
  if (has("PCIe")) return 0;
  if (has("B200") || has("B300")) return 900e9;
  if (has("H100") || has("H200")) return 450e9;
  if (has("A100")) return 300e9;
  return 0;
}

const char* const kMetricNames[] = {
    "gpm.sm_util", "gpm.tensor_util", "gpm.dram_bw_util", "gpm.fp16_util", "gpm.fp32_util", "gpm.fp64_util",
    "gpu.util", "gpm.nvlink_tx_bytes_per_s", "gpm.nvlink_rx_bytes_per_s", "gpu.mem_util", "cpu.busy",
    "proc.cpu_seconds", "disk.io_seconds", "net.rx_bytes", "net.tx_bytes", "ib.rx_bytes", "ib.tx_bytes"};

struct GpuKey {
  std::string label;  // node:index
  double nvlink_capacity = 0;
};

// The run to score (--run, else the newest): its id and catalog status.
Status find_run(Catalog& cat, const ScoreOptions& o, RunFacts& f) {
  if (o.run_id)
    if (auto s = telemetry::check_run(cat, *o.run_id); !s) return s;
  const std::string where = o.run_id ? fmt::format("WHERE run_id = {}", *o.run_id) : "";
  auto r = cat.query(fmt::format("SELECT run_id, catalog_status FROM runs {} ORDER BY started DESC, run_id DESC LIMIT 1", where));
  if (!r) return r.error();
  if (r->rows.empty()) return Error{ErrorKind::kUsage, fmt::format("{}: the catalog holds no run", cat.path())};
  f.run_id = static_cast<std::int64_t>(num(r->rows[0][0]));
  if (!null(r->rows[0][1])) f.catalog_status = str(r->rows[0][1]);
  return {};
}

// The step facts (time, data wait, comm, ranks, the rank that waits most).
// Returns the SQL condition that limits samples to the steps' window ("" with
// no steps: every sample of the run counts), so that idle time before the
// first step and after the last does not dilute the scores.
Expected<std::string> collect_step_facts(Catalog& cat, RunFacts& f) {
  const std::int64_t run = f.run_id;
  auto steps = cat.query(fmt::format(
      "SELECT count(*), min(t - step_time_s), max(t), sum(step_time_s), sum(data_wait_s), "
      "sum(CASE WHEN data_wait_s IS NOT NULL THEN step_time_s END), sum(comm_s), "
      "sum(CASE WHEN comm_s IS NOT NULL THEN step_time_s END), count(DISTINCT rank) "
      "FROM steps WHERE run_id = {} AND step_time_s > 0", run));
  if (!steps) return steps.error();
  const auto& s = steps->rows.at(0);
  f.steps = static_cast<std::int64_t>(num(s[0]));
  if (f.steps == 0) return std::string();
  f.window_from_steps = true;
  f.window_start = num(s[1]);
  f.window_end = num(s[2]);
  f.step_time_s = num(s[3]);
  f.data_wait_s = opt(s[4]);
  f.data_wait_step_time_s = null(s[5]) ? 0 : num(s[5]);
  f.comm_s = opt(s[6]);
  f.comm_step_time_s = null(s[7]) ? 0 : num(s[7]);
  f.ranks = static_cast<int>(num(s[8]));
  if (f.data_wait_s) {
    auto w = cat.query(fmt::format("SELECT rank, sum(data_wait_s) / sum(step_time_s) AS share FROM steps WHERE run_id = {} "
                                   "AND step_time_s > 0 AND data_wait_s IS NOT NULL GROUP BY rank ORDER BY share DESC LIMIT 1", run));
    if (!w) return w.error();
    if (!w->rows.empty()) {
      f.worst_rank = static_cast<int>(num(w->rows[0][0]));
      f.worst_rank_data_wait_share = opt(w->rows[0][1]);
    }
  }
  // Rates and GPM figures describe the interval that ends at the sample.
  return fmt::format(" AND s.t > {:.17g} AND s.t <= {:.17g} + coalesce((SELECT interval_s FROM runs WHERE run_id = {}), 1)",
                     f.window_start, f.window_end, run);
}

// The catalog's GPUs and nodes, by id: labels for the evidence and the
// capacities that utilisation is judged against.
struct Inventory {
  std::map<std::int64_t, GpuKey> gpus;
  std::map<std::int64_t, std::string> hosts;
  std::map<std::int64_t, double> cpus;
};

Expected<Inventory> read_inventory(Catalog& cat) {
  Inventory inv;
  auto g = cat.query("SELECT g.gpu_id, n.hostname, g.gpu_index, g.name FROM gpus g JOIN nodes n USING(node_id)");
  if (!g) return g.error();
  for (const auto& row : g->rows)
    inv.gpus[static_cast<std::int64_t>(num(row[0]))] = {fmt::format("{}:{}", str(row[1]), str(row[2])), nvlink_capacity(str(row[3]))};
  auto n = cat.query("SELECT node_id, hostname, cpus FROM nodes");
  if (!n) return n.error();
  for (const auto& row : n->rows) {
    inv.hosts[static_cast<std::int64_t>(num(row[0]))] = str(row[1]);
    inv.cpus[static_cast<std::int64_t>(num(row[0]))] = null(row[2]) ? 0 : num(row[2]);
  }
  return inv;
}

// Per-GPU means by metric: metric name -> gpu id -> (mean, samples).
using PerGpu = std::map<std::string, std::map<std::int64_t, std::pair<double, std::int64_t>>>;

// The GPU metric `name` reduced over GPUs: the mean, and the lowest GPU
// (the one that holds the others back).
std::optional<RunFacts::GpuMetric> reduce_gpus(const PerGpu& per_gpu, const std::string& name, const Inventory& inv) {
  auto it = per_gpu.find(name);
  if (it == per_gpu.end() || it->second.empty()) return std::nullopt;
  RunFacts::GpuMetric m;
  m.min = INFINITY;
  double sum = 0;
  for (const auto& [gpu, v] : it->second) {
    sum += v.first;
    m.samples += v.second;
    if (v.first < m.min) {
      m.min = v.first;
      auto g = inv.gpus.find(gpu);
      m.min_gpu = g == inv.gpus.end() ? "" : g->second.label;
    }
  }
  m.gpus = static_cast<int>(it->second.size());
  m.mean = sum / m.gpus;
  return m;
}

// The node metrics (CPU, disk, network) into the facts; GPU rows into `per_gpu`.
void fold_samples(const QueryResult& r, const Inventory& inv, RunFacts& f, PerGpu& per_gpu) {
  std::map<std::int64_t, double> node_cpu_busy, node_proc, node_rx, node_tx;
  std::map<std::int64_t, bool> nodes_seen;
  for (const auto& row : r.rows) {
    const std::string name = str(row[0]);
    const auto node = static_cast<std::int64_t>(num(row[1]));
    const std::string device = str(row[3]);
    const double mean = num(row[4]);
    const auto n = static_cast<std::int64_t>(num(row[5]));
    nodes_seen[node] = true;
    f.samples += n;
    if (!null(row[2])) {
      if (device.empty()) per_gpu[name][static_cast<std::int64_t>(num(row[2]))] = {mean, n};
      continue;
    }
    if (name == "cpu.busy") {
      if (device.empty()) node_cpu_busy[node] = mean;
      else f.busiest_core = std::max(f.busiest_core.value_or(0), mean);
    } else if (name == "proc.cpu_seconds") {
      node_proc[node] += mean;
    } else if (name == "disk.io_seconds") {
      if (!f.disk_busy || mean > *f.disk_busy) {
        f.disk_busy = mean;
        auto h = inv.hosts.find(node);
        f.disk_busy_device = (h == inv.hosts.end() ? "" : h->second) + ":" + device;
      }
    } else if (name == "net.rx_bytes" || name == "ib.rx_bytes") {
      node_rx[node] += mean;
    } else if (name == "net.tx_bytes" || name == "ib.tx_bytes") {
      node_tx[node] += mean;
    }
  }
  f.nodes = static_cast<int>(nodes_seen.size());
  for (const auto& [node, seen] : nodes_seen)
    if (auto c = inv.cpus.find(node); c != inv.cpus.end()) f.cpus += c->second;
  if (!node_cpu_busy.empty()) {
    double sum = 0;
    for (const auto& [node, v] : node_cpu_busy) sum += v;
    f.cpu_busy = sum / static_cast<double>(node_cpu_busy.size());
  }
  if (!node_proc.empty()) {
    double sum = 0;
    for (const auto& [node, v] : node_proc) sum += v;
    f.process_cores = sum;
  }
  for (const auto& [node, rx] : node_rx) f.net_bytes_per_s = std::max(f.net_bytes_per_s.value_or(0), std::max(rx, node_tx[node]));
  for (const auto& [node, tx] : node_tx) f.net_bytes_per_s = std::max(f.net_bytes_per_s.value_or(0), tx);
}

// The GPU facts, each metric reduced over GPUs.
void reduce_gpu_facts(PerGpu& per_gpu, const Inventory& inv, RunFacts& f) {
  f.sm_util = reduce_gpus(per_gpu, "gpm.sm_util", inv);
  f.tensor_util = reduce_gpus(per_gpu, "gpm.tensor_util", inv);
  f.dram_bw_util = reduce_gpus(per_gpu, "gpm.dram_bw_util", inv);
  f.fp16_util = reduce_gpus(per_gpu, "gpm.fp16_util", inv);
  f.fp32_util = reduce_gpus(per_gpu, "gpm.fp32_util", inv);
  f.fp64_util = reduce_gpus(per_gpu, "gpm.fp64_util", inv);
  f.gpu_util = reduce_gpus(per_gpu, "gpu.util", inv);
  f.gpu_mem_util = reduce_gpus(per_gpu, "gpu.mem_util", inv);
  // NVLink: the mean of both directions per GPU, against one direction's capacity.
  for (const auto& [gpu, tx] : per_gpu["gpm.nvlink_tx_bytes_per_s"]) {
    const double rx = per_gpu["gpm.nvlink_rx_bytes_per_s"].contains(gpu) ? per_gpu["gpm.nvlink_rx_bytes_per_s"][gpu].first : tx.first;
    per_gpu["nvlink"][gpu] = {(tx.first + rx) / 2, tx.second};
    auto g = inv.gpus.find(gpu);
    const double capacity = g == inv.gpus.end() ? 0 : g->second.nvlink_capacity;
    if (capacity > 0)
      f.nvlink_capacity_bytes_per_s = f.nvlink_capacity_bytes_per_s == 0 ? capacity : std::min(f.nvlink_capacity_bytes_per_s, capacity);
  }
  f.nvlink_bytes_per_s = reduce_gpus(per_gpu, "nvlink", inv);
  for (const auto& [name, m] : per_gpu) f.gpus = std::max(f.gpus, static_cast<int>(m.size()));
}

// The busiest thread (ThreadRecord rows) over the window. A catalog made
// before the threads table, or a run sampled with --no-threads, has none.
Status collect_thread_facts(Catalog& cat, const Inventory& inv, const std::string& window, RunFacts& f) {
  auto has = cat.query("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'threads'");
  if (!has) return has.error();
  if (has->rows.empty() || num(has->rows[0][0]) == 0) return {};
  auto r = cat.query(fmt::format(
      "SELECT s.node_id, s.pid, s.tid, s.comm, max(s.main), max(s.python), sum(s.busy) / n.intervals AS mean, n.intervals, n.busy_threads "
      "FROM threads s JOIN (SELECT node_id, count(*) AS intervals, avg(busy_threads) AS busy_threads FROM threads s "
      "WHERE s.run_id = {0}{1} GROUP BY node_id) n USING(node_id) WHERE s.run_id = {0}{1} "
      "GROUP BY s.node_id, s.pid, s.tid, s.comm ORDER BY mean DESC LIMIT 1", f.run_id, window));
  if (!r) return r.error();
  if (r->rows.empty()) return {};
  const auto& row = r->rows[0];
  RunFacts::Thread t;
  auto h = inv.hosts.find(static_cast<std::int64_t>(num(row[0])));
  t.node = h == inv.hosts.end() ? "" : h->second;
  t.pid = static_cast<int>(num(row[1]));
  t.tid = static_cast<int>(num(row[2]));
  t.comm = str(row[3]);
  t.main = num(row[4]) != 0;
  t.python = num(row[5]) != 0;
  t.busy = std::clamp(num(row[6]), 0.0, 1.0);
  t.intervals = static_cast<std::int64_t>(num(row[7]));
  t.busy_threads = null(row[8]) ? 0 : num(row[8]);
  f.busiest_thread = t;
  return {};
}

}  // namespace

Expected<RunFacts> collect_facts(Catalog& cat, const ScoreOptions& o) {
  RunFacts f;
  f.nic_capacity_bytes_per_s = o.nic_capacity_bytes_per_s;
  if (Status s = find_run(cat, o, f); !s) return s.error();
  auto window = collect_step_facts(cat, f);
  if (!window) return window.error();
  auto inv = read_inventory(cat);
  if (!inv) return inv.error();

  std::string names;
  for (const char* n : kMetricNames) names += fmt::format("{}'{}'", names.empty() ? "" : ", ", n);
  auto r = cat.query(fmt::format(
      "SELECT m.name, s.node_id, s.gpu_id, s.device, avg(s.value), count(*) FROM samples s "
      "JOIN metrics m ON m.metric_id = s.metric_id WHERE s.run_id = {} AND m.name IN ({}){} "
      "GROUP BY s.metric_id, s.node_id, s.gpu_id, s.device", f.run_id, names, *window));
  if (!r) return r.error();
  PerGpu per_gpu;
  fold_samples(*r, *inv, f, per_gpu);
  reduce_gpu_facts(per_gpu, *inv, f);
  if (Status s = collect_thread_facts(cat, *inv, *window, f); !s) return s.error();
  return f;
}

namespace {

std::string pct(double v) { return fmt::format("{:.0f}%", 100 * v); }

Evidence gpu_evidence(const std::string& what, const RunFacts::GpuMetric& m, const std::string& metric) {
  return {what, m.mean, "ratio",
          fmt::format("{}: mean of {} GPU(s) over {} samples; lowest {} on {}", metric, m.gpus, m.samples, pct(m.min), m.min_gpu)};
}

double clamp01(double v) { return std::clamp(v, 0.0, 1.0); }

// "`python3` (main)" for a process's main thread, else with its ids.
std::string thread_label(const RunFacts::Thread& t) {
  return t.main ? fmt::format("`{}` (main)", t.comm)
                : fmt::format("`{}` (thread {} of {}process {})", t.comm, t.tid, t.python ? "Python " : "", t.pid);
}

// The thread that holds the run back, when one does: busy at least
// kThreadBound of a core while the node's other threads do little.
const RunFacts::Thread* bound_thread(const RunFacts& f) {
  if (!f.busiest_thread) return nullptr;
  const auto& t = *f.busiest_thread;
  return t.busy >= kThreadBound && t.busy_threads < kOtherThreadsBusy ? &t : nullptr;
}

// compute: the busiest arithmetic pipe (GPM), else NVML utilization.
Score score_compute(const RunFacts& f) {
  Score compute{"compute", {}, {}, {}};
  const std::pair<const char*, const std::optional<RunFacts::GpuMetric>*> pipes[] = {
      {"gpm.tensor_util", &f.tensor_util}, {"gpm.fp16_util", &f.fp16_util},
      {"gpm.fp32_util", &f.fp32_util},     {"gpm.fp64_util", &f.fp64_util}};
  for (const auto& [name, m] : pipes)
    if (*m) {
      compute.value = std::max(compute.value.value_or(0), (*m)->mean);
      compute.evidence.push_back(gpu_evidence(std::string(name + 4) + " pipe activity", **m, name));
    }
  if (f.sm_util) compute.evidence.push_back(gpu_evidence("SM activity", *f.sm_util, "gpm.sm_util"));
  if (!compute.value && f.gpu_util) {
    compute.value = f.gpu_util->mean;
    compute.evidence.push_back(gpu_evidence("NVML utilization (time a kernel ran, not how much of the GPU it used)",
                                            *f.gpu_util, "gpu.util"));
  }
  if (!compute.value)
    compute.why_not = f.gpus ? "no GPM pipe activity and no NVML utilization samples" : "no GPU samples (see host_cpu)";
  return compute;
}

// memory: DRAM bandwidth (GPM), else NVML's memory-controller busy time.
Score score_memory(const RunFacts& f) {
  Score memory{"memory", {}, {}, {}};
  if (f.dram_bw_util) {
    memory.value = f.dram_bw_util->mean;
    memory.evidence.push_back(gpu_evidence("DRAM bandwidth used", *f.dram_bw_util, "gpm.dram_bw_util"));
  } else if (f.gpu_mem_util) {
    memory.value = f.gpu_mem_util->mean;
    memory.evidence.push_back(gpu_evidence("NVML memory-controller busy time (coarse, no GPM)", *f.gpu_mem_util, "gpu.mem_util"));
  } else {
    memory.why_not = f.gpus ? "no GPM DRAM activity (needs Hopper or newer) and no NVML memory utilization" : "no GPU samples";
  }
  return memory;
}

// communication: the larger of the comm-time share and link utilisation. A
// score judged on part of its evidence says which part is missing, in
// `not_judged`.
Score score_communication(const RunFacts& f, std::vector<std::string>& not_judged) {
  Score comm{"communication", {}, {}, {}};
  std::vector<std::string> missing;
  if (f.comm_s && f.comm_step_time_s > 0) {
    const double share = *f.comm_s / f.comm_step_time_s;
    comm.value = clamp01(share);
    comm.evidence.push_back({"comm_s share of step time", share, "ratio", fmt::format("steps: sum(comm_s) / sum(step_time_s), {} steps", f.steps)});
  } else {
    missing.push_back("no comm_s in the steps");
  }
  if (f.nvlink_bytes_per_s) {
    comm.evidence.push_back({"NVLink bytes/s per GPU (mean of tx and rx)", f.nvlink_bytes_per_s->mean, "B/s",
                             fmt::format("gpm.nvlink_tx/rx_bytes_per_s, {} GPU(s)", f.nvlink_bytes_per_s->gpus)});
    if (f.nvlink_capacity_bytes_per_s > 0) {
      const double u = f.nvlink_bytes_per_s->mean / f.nvlink_capacity_bytes_per_s;
      comm.value = std::max(comm.value.value_or(0), clamp01(u));
      comm.evidence.push_back({"NVLink utilization", u, "ratio", fmt::format("against {:.0f} GB/s per direction (GPU model)", f.nvlink_capacity_bytes_per_s / 1e9)});
    } else {
      missing.push_back("NVLink capacity unknown for this GPU model");
    }
  }
  if (f.net_bytes_per_s) {
    comm.evidence.push_back({"network bytes/s, busiest node and direction", *f.net_bytes_per_s, "B/s", "net.* + ib.* rx/tx"});
    if (f.nic_capacity_bytes_per_s > 0) {
      const double u = *f.net_bytes_per_s / f.nic_capacity_bytes_per_s;
      comm.value = std::max(comm.value.value_or(0), clamp01(u));
      comm.evidence.push_back({"network utilization", u, "ratio", fmt::format("against --nic-gbps ({:.0f} Gb/s)", f.nic_capacity_bytes_per_s * 8 / 1e9)});
    } else {
      missing.push_back("network capacity not given (--nic-gbps)");
    }
  }
  if (!comm.value) comm.why_not = missing.empty() ? "no comm_s, NVLink or network figures" : fmt::format("{}", fmt::join(missing, "; "));
  else if (!missing.empty()) not_judged.push_back("communication (partly): " + fmt::format("{}", fmt::join(missing, "; ")));
  return comm;
}

// input: the share of step time spent waiting for data.
Score score_input(const RunFacts& f) {
  Score input{"input", {}, {}, {}};
  if (f.data_wait_s && f.data_wait_step_time_s > 0) {
    const double share = *f.data_wait_s / f.data_wait_step_time_s;
    input.value = clamp01(share);
    input.evidence.push_back({"data_wait_s share of step time", share, "ratio",
                              fmt::format("steps: sum(data_wait_s) / sum(step_time_s), {} steps of {} rank(s)", f.steps, f.ranks)});
    if (f.worst_rank_data_wait_share)
      input.evidence.push_back({fmt::format("rank {} (waits most)", f.worst_rank), *f.worst_rank_data_wait_share, "ratio", "pacer query DB data-wait"});
  } else {
    input.why_not = f.steps ? "the steps carry no data_wait_s" : "no training steps in the catalog";
  }
  return input;
}

// host CPU: the command's process tree against the node's CPUs.
Score score_host_cpu(const RunFacts& f) {
  Score host{"host_cpu", {}, {}, {}};
  if (f.process_cores && f.cpus > 0) {
    host.value = clamp01(*f.process_cores / f.cpus);
    host.evidence.push_back({"cores busy in the command's processes", *f.process_cores, "cores",
                             fmt::format("proc.cpu_seconds rate, against {:.0f} CPU(s)", f.cpus)});
    // A command that computes on the CPU is slowed by a saturated node,
    // whoever saturates it; an idle one is not.
    if (*f.process_cores >= kCpuActiveCores && f.cpu_busy && *f.cpu_busy > *host.value) {
      host.value = clamp01(*f.cpu_busy);
      host.evidence.push_back({"the node's CPUs are saturated and the command computes on them (other processes compete)",
                               *f.cpu_busy, "ratio", "cpu.busy, mean over nodes"});
    }
  } else if (f.cpu_busy) {
    host.value = clamp01(*f.cpu_busy);
  }
  if (f.cpu_busy) host.evidence.push_back({"all CPUs busy (every process on the node)", *f.cpu_busy, "ratio", "cpu.busy, mean over nodes"});
  if (f.busiest_core) host.evidence.push_back({"busiest core", *f.busiest_core, "ratio", "cpu.busy per core"});
  if (const auto& t = f.busiest_thread) {
    host.evidence.push_back({fmt::format("busiest thread {}, share of one core", thread_label(*t)), t->busy, "ratio",
                             fmt::format("threads: pid {} tid {}{}{} on {}, mean over {} intervals", t->pid, t->tid,
                                         t->python ? ", a Python interpreter" : "", t->main ? ", main thread" : "", t->node,
                                         t->intervals)});
    host.evidence.push_back({"threads of its process busy at least half a core (mean)", t->busy_threads, "threads", "threads.busy_threads"});
  }
  if (!host.value) host.why_not = "no CPU samples (no sampler ran)";
  return host;
}

// I/O: the busiest block device.
Score score_io(const RunFacts& f) {
  Score io{"io", {}, {}, {}};
  if (f.disk_busy) {
    io.value = clamp01(*f.disk_busy);
    io.evidence.push_back({"busiest block device busy time", *f.disk_busy, "ratio", "disk.io_seconds on " + f.disk_busy_device});
  } else {
    io.why_not = f.samples ? "no disk activity recorded" : "no samples (no sampler ran)";
  }
  return io;
}

// The verdict: the first rule that holds (docs/score.md), over the scores in
// the order score_* made them (compute, memory, communication, input,
// host_cpu, io).
Verdict decide(const RunFacts& f, const std::vector<Score>& scores) {
  const Score &compute = scores[0], &memory = scores[1], &comm = scores[2], &input = scores[3], &host = scores[4],
              &io = scores[5];
  const auto v = [&](const Score& s) { return s.value.value_or(-1); };
  // GPUs are busy when SMs are active or, by NVML, a kernel runs most of the
  // time: memory-bound kernels can hold few SMs yet keep the GPU occupied.
  const double sm = f.sm_util ? f.sm_util->mean : -1, util = f.gpu_util ? f.gpu_util->mean : -1;
  const double busy = std::max(sm, util);
  const std::string busy_what = sm >= util ? "SMs active" : "a kernel running";
  const double comm_share = f.comm_s && f.comm_step_time_s > 0 ? *f.comm_s / f.comm_step_time_s : 0;
  Verdict d;
  if (v(input) >= kInputBoundShare && v(input) >= comm_share) {
    d.kind = "input-bound";
    d.sentence = fmt::format("input-bound: {} {} of step time while waiting for data; see data-wait by rank (pacer query DB data-wait{})",
                             f.gpus ? "GPUs idle" : "ranks stall", pct(v(input)),
                             f.worst_rank >= 0 ? fmt::format(": rank {} waits {}", f.worst_rank, pct(*f.worst_rank_data_wait_share)) : "");
  } else if (v(comm) >= kLinkBound || comm_share >= kCommBoundShare) {
    d.kind = "communication-bound";
    d.sentence = fmt::format("communication-bound: {} of step time in communication and links up to {} busy; see comm share by rank (pacer query DB data-wait)",
                             pct(comm_share), pct(v(comm)));
  } else if (const auto* t = bound_thread(f); t && sm >= 0 && util >= kLaunchUtil && util < kLaunchBusyUtil && sm < kGpuBusy &&
                                                util >= kLaunchRatio * sm) {
    // Kernels run a good part of the time yet hold few SMs, and the thread
    // that launches them never rests: the GPU waits between small kernels.
    d.kind = "launch-bound";
    d.sentence = fmt::format("launch-bound: a kernel ran {} of the time but SMs were active only {} while thread {}{} is busy {} of a "
                             "core: kernels too small to fill the GPU (fuse them, give each more work, or capture them in a CUDA graph)",
                             pct(util), pct(sm), thread_label(*t), f.nodes > 1 ? " on " + t->node : "", pct(t->busy));
  } else if (busy >= kGpuBusy) {
    const bool mem = v(memory) >= kMemoryBound && v(memory) >= v(compute);
    d.kind = mem ? "memory-bound" : "compute-bound";
    d.sentence = fmt::format("{}: {} {} of the time, {} {} against {} {}", d.kind, busy_what, pct(busy),
                             mem ? "DRAM bandwidth" : "busiest compute pipe", pct(mem ? v(memory) : std::max(0.0, v(compute))),
                             mem ? "busiest compute pipe" : "DRAM bandwidth", v(mem ? compute : memory) < 0 ? "not measured" : pct(v(mem ? compute : memory)));
  } else if (const auto* t = bound_thread(f); t && (f.gpus > 0 || f.cpus != 1)) {
    // With GPUs: they wait on the thread. Without: the command is one
    // thread's work, which more cores would not speed up (on a one-CPU node
    // that is the whole host: host-cpu-bound).
    d.kind = "host-bound";
    const std::string where = f.nodes > 1 ? " on " + t->node : "";
    if (f.gpus > 0) {
      d.sentence = fmt::format("host-bound (one thread): {} thread {}{} is busy {} of a core: single-threaded host work (data "
                               "preparation, Python overhead or kernel launches) limits the GPU",
                               busy >= 0 ? fmt::format("GPUs idle {} of the time while", pct(1 - busy)) : "GPU activity not recorded;",
                               thread_label(*t), where, pct(t->busy));
    } else {
      std::string node;
      if (f.cpu_busy && f.cpus > 0) {
        const double idle_cores = (1 - *f.cpu_busy) * f.cpus;
        node = fmt::format(" while the {} CPUs are {} busy ({:.1f} of {:.0f} cores idle{})", f.nodes > 1 ? "nodes'" : "node's",
                           pct(*f.cpu_busy), idle_cores, f.cpus, idle_cores < 0.5 ? ", other processes take the rest" : "");
      }
      d.sentence = fmt::format("host-bound (one thread): no GPU was recorded and thread {}{} is busy {} of a core{}: the command is "
                               "single-threaded host work; more threads or processes (data-loader workers, torch.set_num_threads) "
                               "would use more cores",
                               thread_label(*t), where, pct(t->busy), node);
    }
  } else if (v(host) >= kHostBound) {
    d.kind = "host-cpu-bound";
    const double own = f.process_cores && f.cpus > 0 ? *f.process_cores / f.cpus : v(host);
    d.sentence = fmt::format("host-cpu-bound: the host CPUs are {} busy, {} of them by the command's processes{}, while {}",
                             pct(v(host)), pct(own), own < v(host) - 0.2 ? " (other processes compete)" : "",
                             busy >= 0 ? fmt::format("{} only {}", busy_what, pct(busy)) : "no GPU was recorded");
  } else if (v(io) >= kIoBound) {
    d.kind = "io-bound";
    d.sentence = fmt::format("io-bound: {} busy {} of the time{}", f.disk_busy_device, pct(v(io)),
                             busy >= 0 ? fmt::format(" while {} only {}", busy_what, pct(busy)) : "");
  } else {
    double top = -1;
    std::string top_name;
    for (const auto& s : scores)
      if (v(s) > top) top = v(s), top_name = s.name;
    if (top < 0 && busy < 0) {
      d.kind = "unknown";
      d.sentence = "unknown: the catalog holds nothing to judge for this run";
    } else if (f.samples == 0 && !f.busiest_thread && busy < 0 && !f.cpu_busy && !f.process_cores && !f.disk_busy) {
      // Steps alone (pacer.telemetry without pacer monitor) show neither
      // GPUs nor CPUs: low wait shares do not make the run idle.
      d.kind = "unknown";
      d.sentence = fmt::format("unknown: no sampler data for this run, only {} training steps (data wait {}, communication {} of step "
                               "time); run the command under pacer monitor to judge its GPUs and CPUs",
                               f.steps, v(input) >= 0 ? pct(v(input)) : "not reported", f.comm_s ? pct(comm_share) : "not reported");
    } else if (std::max(top, busy) < kIdle) {
      d.kind = "idle";
      d.sentence = fmt::format("idle: nothing is busy ({}; highest score {} {})",
                               busy >= 0 ? fmt::format("{} {}", busy_what, pct(busy)) : "no GPU recorded", top_name, pct(std::max(0.0, top)));
    } else {
      d.kind = "unsaturated";
      d.sentence = fmt::format("unsaturated: no resource is saturated; highest score {} {}{}", top_name, pct(top),
                               busy >= 0 ? fmt::format(", {} {}", busy_what, pct(busy)) : "");
    }
  }
  return d;
}

}  // namespace

ScoreReport judge(const RunFacts& f) {
  ScoreReport rep;
  rep.facts = f;
  // Communication is scored first: a score judged on part of its evidence
  // is named in not_judged ahead of the scores that have none.
  Score comm = score_communication(f, rep.not_judged);
  rep.scores = {score_compute(f), score_memory(f), std::move(comm), score_input(f), score_host_cpu(f), score_io(f)};
  for (const auto& s : rep.scores)
    if (!s.value) rep.not_judged.push_back(s.name + ": " + s.why_not);
  if (f.catalog_status != "ok") rep.not_judged.push_back("after the catalog stopped writing: " + f.catalog_status);
  rep.verdict = decide(f, rep.scores);
  return rep;
}

Expected<ScoreReport> score_catalog(const std::string& db, const ScoreOptions& options) {
  auto cat = Catalog::open(db, telemetry::CatalogOptions{.read_only = true});
  if (!cat) return cat.error();
  auto facts = collect_facts(**cat, options);
  if (!facts) return facts.error();
  ScoreReport r = judge(*facts);
  r.db = db;
  return r;
}

nlohmann::json to_json(const ScoreReport& r) {
  using nlohmann::json;
  json scores = json::array();
  for (const auto& s : r.scores) {
    json ev = json::array();
    for (const auto& e : s.evidence)
      ev.push_back({{"what", e.what}, {"value", std::isfinite(e.value) ? json(e.value) : json(nullptr)}, {"unit", e.unit}, {"source", e.source}});
    json o = {{"name", s.name}, {"score", s.value ? json(*s.value) : json(nullptr)}, {"evidence", ev}};
    if (!s.value) o["why_not"] = s.why_not;
    scores.push_back(std::move(o));
  }
  const RunFacts& f = r.facts;
  return {{"schema", "pacer.score/1"},
          {"db", r.db},
          {"run_id", f.run_id},
          {"window", {{"start", f.window_start}, {"end", f.window_end}, {"from_steps", f.window_from_steps}}},
          {"nodes", f.nodes},
          {"gpus", f.gpus},
          {"ranks", f.ranks},
          {"steps", f.steps},
          {"samples", f.samples},
          {"catalog_status", f.catalog_status},
          {"scores", scores},
          {"busiest_thread", f.busiest_thread ? json{{"node", f.busiest_thread->node}, {"pid", f.busiest_thread->pid},
                                                     {"tid", f.busiest_thread->tid}, {"comm", f.busiest_thread->comm},
                                                     {"main", f.busiest_thread->main}, {"python", f.busiest_thread->python},
                                                     {"busy", f.busiest_thread->busy}, {"busy_threads", f.busiest_thread->busy_threads},
                                                     {"intervals", f.busiest_thread->intervals}}
                                              : json(nullptr)},
          {"verdict", {{"kind", r.verdict.kind}, {"sentence", r.verdict.sentence}}},
          {"not_judged", r.not_judged}};
}

std::string to_text(const ScoreReport& r) {
  Table t({{"RESOURCE"}, {"SCORE", true}, {"EVIDENCE", false, 110}});
  for (const auto& s : r.scores) {
    std::string ev;
    for (const auto& e : s.evidence) {
      const std::string val = e.unit == "ratio" ? pct(e.value) : e.unit == "B/s" ? fmt::format("{:.3g} GB/s", e.value / 1e9)
                                                                                   : fmt::format("{:.3g} {}", e.value, e.unit);
      ev += (ev.empty() ? "" : "; ") + e.what + " " + val;
    }
    t.add_row({s.name, s.value ? fmt::format("{:.2f}", *s.value) : "-", s.value ? ev : "not judged (below)"});
  }
  const RunFacts& f = r.facts;
  std::string out = fmt::format("run {}: {} node(s), {} GPU(s), {} rank(s), {} steps, {} samples, {}\n", f.run_id, f.nodes,
                                f.gpus, f.ranks, f.steps, f.samples, f.window_from_steps ? "scored over the steps' span" : "scored over the whole run");
  out += t.render();
  for (const auto& n : r.not_judged) out += "not judged: " + n + "\n";
  out += "OK: " + r.verdict.sentence + "\n";
  return out;
}

}  // namespace pacer::score
