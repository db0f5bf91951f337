#include "score/synthetic.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "pacer/telemetry/catalog.hpp"

namespace pacer::test {
namespace {

using namespace pacer::telemetry;

// What each workload's GPUs and host do, as fractions (nvlink in bytes/s).
struct Shape {
  bool gpus = true, sampler = true, steps = true;
  double sm = 0, tensor = 0, dram = 0, fp32 = 0, nvlink = 0;
  double proc_cores_share = 0.02, disk = 0.01;
  double data_wait = 0.02, comm = 0.05;  // shares of step time
  double node_busy = -1;                 // all-CPU busy; -1: the command's share plus a little
  double util = -1;                      // NVML utilization; -1: from sm
  double thread = -1;                    // the busiest thread's share of a core; -1: no threads table rows
  unsigned busy_threads = 1;             // threads at half a core or more
  std::string verdict;
};

const std::map<std::string, Shape>& shapes() {
  static const std::map<std::string, Shape> kShapes = {
      {"gemm", {.sm = 0.96, .tensor = 0.78, .dram = 0.32, .fp32 = 0.05, .nvlink = 5e9, .verdict = "compute-bound"}},
      {"memory", {.sm = 0.93, .tensor = 0.0, .dram = 0.86, .fp32 = 0.12, .verdict = "memory-bound"}},
      {"input", {.sm = 0.36, .tensor = 0.28, .dram = 0.12, .data_wait = 0.58, .verdict = "input-bound"}},
      {"comm", {.sm = 0.55, .tensor = 0.3, .dram = 0.2, .nvlink = 320e9, .comm = 0.45, .verdict = "communication-bound"}},
      {"host", {.steps = false, .sm = 0.08, .tensor = 0.02, .dram = 0.03, .proc_cores_share = 0.9, .verdict = "host-cpu-bound"}},
      {"io", {.steps = false, .sm = 0.07, .tensor = 0.01, .dram = 0.02, .disk = 0.96, .verdict = "io-bound"}},
      {"idle", {.steps = false, .sm = 0.01, .verdict = "idle"}},
      {"cpu", {.gpus = false, .steps = false, .proc_cores_share = 0.95, .verdict = "host-cpu-bound"}},
      {"cpu-contended", {.gpus = false, .steps = false, .proc_cores_share = 0.15, .node_busy = 1.0, .verdict = "host-cpu-bound"}},
      {"steps-only", {.gpus = false, .sampler = false, .data_wait = 0.5, .verdict = "input-bound"}},
      {"steps-quiet", {.gpus = false, .sampler = false, .data_wait = 0, .comm = 0, .verdict = "unknown"}},
      {"host-thread", {.steps = false, .sm = 0.25, .tensor = 0.05, .dram = 0.06, .proc_cores_share = 1.1 / 32, .thread = 0.97, .verdict = "host-bound"}},
      {"launch", {.steps = false, .sm = 0.04, .tensor = 0.0, .dram = 0.03, .proc_cores_share = 1.0 / 32, .util = 0.6, .thread = 0.99, .verdict = "launch-bound"}},
      {"cpu-thread", {.gpus = false, .steps = false, .proc_cores_share = 1.0 / 32, .thread = 0.96, .verdict = "host-bound"}},
      {"cpu-threads", {.gpus = false, .steps = false, .proc_cores_share = 8.0 / 32, .thread = 0.95, .busy_threads = 8, .verdict = "unsaturated"}},
      {"empty", {.gpus = false, .sampler = false, .steps = false, .verdict = "unknown"}},
  };
  return kShapes;
}

}  // namespace

const std::vector<std::string>& synthetic_workloads() {
  static const std::vector<std::string> kNames = [] {
    std::vector<std::string> v;
    for (const auto& [name, s] : shapes()) v.push_back(name);
    return v;
  }();
  return kNames;
}

std::string expected_verdict(const std::string& workload) {
  auto it = shapes().find(workload);
  return it == shapes().end() ? "" : it->second.verdict;
}

Status write_synthetic_catalog(const std::string& path, const std::string& workload) {
  auto it = shapes().find(workload);
  if (it == shapes().end()) return Error{ErrorKind::kUsage, "no synthetic workload named " + workload};
  const Shape& sh = it->second;
  auto opened = Catalog::open(path);
  if (!opened) return opened.error();
  Catalog& cat = **opened;
  const double t0 = 1764400000.0, cpus = 32;
  const int seconds = 60, gpus_per_node = sh.gpus ? 4 : 0;
  auto run = cat.begin_run(RunInfo{"4242", "torchrun train.py (" + workload + ")", "gpu001", t0, sh.sampler ? 1.0 : 0.0});
  if (!run) return run.error();
  for (int n = 0; n < 2; ++n) {
    const std::string host = fmt::format("gpu{:03d}", n + 1);
    auto node = cat.node_id(NodeInfo{host, static_cast<unsigned>(cpus), 512ull << 30, "6.1.0"});
    if (!node) return node.error();
    std::vector<GpuRecord> gpus;
    for (int g = 0; g < gpus_per_node; ++g) gpus.push_back({static_cast<unsigned>(g), fmt::format("GPU-{}-{}", n, g), "NVIDIA H200", 141ull << 30});
    if (Status s = cat.add_gpus(*node, gpus); !s) return s;
    if (n == 0) {
      if (Status s = cat.write_event(*run, *node, {t0 - 5, "vet.result", R"({"check": "gpu.gemm_tflops", "status": "ok", "value": 712})", -1, -1}); !s) return s;
    }
    if (!sh.sampler) continue;
    for (int i = 1; i <= seconds; ++i) {
      Sample s;
      s.t = t0 + i;
      s.interval_s = 1;
      // A slow wobble per GPU and node, so series differ as on real nodes.
      auto w = [&](int g, double base) { return std::clamp(base * (1 + 0.05 * std::sin(0.3 * i + g + 2 * n)), 0.0, 1.0); };
      auto add = [&](const char* name, int gpu, const std::string& dev, double v) { s.readings.push_back({find_metric(name), gpu, dev, v, {}}); };
      for (int g = 0; g < gpus_per_node; ++g) {
        add("gpu.util", g, "", sh.util >= 0 ? w(g, sh.util) : sh.sm > 0.05 ? std::min(1.0, w(g, sh.sm) + 0.03) : 0.0);
        add("gpu.mem_util", g, "", w(g, sh.dram));
        add("gpm.sm_util", g, "", w(g, sh.sm));
        add("gpm.tensor_util", g, "", w(g, sh.tensor));
        add("gpm.dram_bw_util", g, "", w(g, sh.dram));
        add("gpm.fp32_util", g, "", w(g, sh.fp32));
        add("gpm.fp16_util", g, "", 0.0);
        add("gpm.nvlink_tx_bytes_per_s", g, "", sh.nvlink * (1 + 0.02 * g));
        add("gpm.nvlink_rx_bytes_per_s", g, "", sh.nvlink * (1 - 0.02 * g));
        add("gpu.power_w", g, "", 90 + 600 * w(g, sh.sm * 0.7 + sh.dram * 0.3));
        add("gpu.temperature_c", g, "", 32 + 40 * w(g, sh.sm) + 2 * g);
      }
      add("cpu.busy", -1, "", sh.node_busy >= 0 ? sh.node_busy : std::clamp(sh.proc_cores_share + 0.03, 0.0, 1.0));
      for (int c = 0; c < 4; ++c) add("cpu.busy", -1, fmt::format("cpu{}", c), std::clamp(sh.proc_cores_share + 0.01 * c, 0.0, 1.0));
      add("proc.cpu_seconds", -1, "", sh.proc_cores_share * cpus);
      add("disk.io_seconds", -1, "nvme0n1", sh.disk);
      add("net.rx_bytes", -1, "eth0", 2e6);
      add("net.tx_bytes", -1, "eth0", 1e6);
      add("ib.rx_bytes", -1, "mlx5_0:1", 1e9);
      add("ib.tx_bytes", -1, "mlx5_0:1", 1e9);
      // The main thread of one Python process per node, steady near its share.
      if (sh.thread >= 0)
        s.busiest_thread = ThreadRecord{1000 + n, 1000 + n, "python3", true, true, std::clamp(sh.thread + 0.02 * std::sin(i), 0.0, 1.0),
                                        40, sh.busy_threads};
      if (workload == "gemm" && n == 1 && i == 30) s.events.push_back({s.t, "gpu.throttle", "sw_power_cap", 2, -1});
      if (workload == "gemm" && n == 1 && i == 34) s.events.push_back({s.t, "gpu.throttle_end", "", 2, -1});
      if (Status st = cat.write_sample(*run, *node, s); !st) return st;
    }
  }
  if (sh.steps) {
    std::vector<StepRecord> steps;
    for (int rank = 0; rank < 8; ++rank) {
      for (int step = 0; step < 100; ++step) {
        StepRecord r;
        r.step = step;
        r.rank = rank;
        r.node = rank < 4 ? "gpu001" : "gpu002";
        const double st = 0.5 * (1 + 0.1 * std::sin(step * 0.7 + rank)) * (step == 70 ? 1.8 : 1.0);
        r.t = t0 + 5 + 0.5 * step + st;
        r.step_time_s = st;
        r.loss = 4.0 * std::exp(-step / 60.0) + 1.5;
        r.tokens = 8192;
        r.data_wait_s = st * sh.data_wait * (rank == 5 ? 1.2 : 1.0);
        r.comm_s = st * sh.comm;
        steps.push_back(r);
      }
    }
    if (Status s = cat.write_steps(*run, steps); !s) return s;
  }
  return cat.end_run(*run, t0 + seconds, 0, 0.2);
}

}  // namespace pacer::test
