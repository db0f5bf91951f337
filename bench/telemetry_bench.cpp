// Catalog ingest rate and named-question times on a synthetic multi-node job (see bench/README.md).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/telemetry/catalog.hpp"
#include "pacer/telemetry/questions.hpp"

using namespace pacer::telemetry;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// One node's pass: 8 GPUs x 12 metrics and 24 host readings (total CPU,
// 16 cores, memory, two NICs, one InfiniBand port, one disk): 120 values, as
// a 16-core 8-GPU node at 1 Hz gives.
Sample node_pass(double t, int node, bool hot) {
  static const char* kGpu[] = {"gpu.util", "gpu.mem_util", "gpu.memory_used_bytes", "gpu.temperature_c", "gpu.power_w",
                               "gpu.sm_clock_hz", "gpu.clock_event_reasons", "gpm.sm_util", "gpm.tensor_util",
                               "gpm.dram_bw_util", "gpm.nvlink_tx_bytes_per_s", "gpm.nvlink_rx_bytes_per_s"};
  Sample s;
  s.t = t;
  const double phase = std::sin(t / 30.0 + node);
  for (int g = 0; g < 8; ++g)
    for (const char* m : kGpu) {
      double v = 0.5 + 0.4 * phase;
      if (std::string_view(m) == "gpu.temperature_c") v = hot && g == 3 ? 91 : 60 + 10 * phase;
      if (std::string_view(m) == "gpu.power_w") v = 500 + 100 * phase;
      if (std::string_view(m) == "gpu.clock_event_reasons") v = hot && g == 3 ? 0x40 : 0;
      s.readings.push_back({find_metric(m), g, "", v, {}});
    }
  s.readings.push_back({find_metric("cpu.busy"), -1, "", 0.3, {}});
  for (int c = 0; c < 16; ++c) s.readings.push_back({find_metric("cpu.busy"), -1, fmt::format("cpu{}", c), 0.3, {}});
  s.readings.push_back({find_metric("mem.used_bytes"), -1, "", 1e11, {}});
  s.readings.push_back({find_metric("net.rx_bytes"), -1, "eth0", 1e6, {}});
  s.readings.push_back({find_metric("net.tx_bytes"), -1, "eth0", 1e6, {}});
  s.readings.push_back({find_metric("ib.rx_bytes"), -1, "mlx5_0:1", 2e10, {}});
  s.readings.push_back({find_metric("ib.tx_bytes"), -1, "mlx5_0:1", 2e10, {}});
  s.readings.push_back({find_metric("disk.read_bytes"), -1, "nvme0n1", 5e8, {}});
  s.readings.push_back({find_metric("disk.write_bytes"), -1, "nvme0n1", 1e7, {}});
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: telemetry_bench DIR [SAMPLES=10000000]\n");
    return 2;
  }
  const std::string dir = argv[1];
  const long target = argc > 2 ? std::atol(argv[2]) : 10'000'000;
  const std::string db = dir + "/bench.db";
  for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(db + suffix);
  auto cat = std::move(Catalog::open(db).value());
  constexpr int kNodes = 8, kRanksPerNode = 8, kValuesPerPass = 120;
  const long ticks = target / (kNodes * kValuesPerPass);
  std::vector<std::int64_t> node_ids;
  for (int n = 0; n < kNodes; ++n) {
    node_ids.push_back(cat->node_id(NodeInfo{fmt::format("node{:03}", n), 16, 1ull << 40, "6.1"}).value());
    std::vector<GpuRecord> gpus;
    for (unsigned g = 0; g < 8; ++g) gpus.push_back({g, fmt::format("GPU-{}-{}", n, g), "NVIDIA H200", 141ull << 30});
    (void)cat->add_gpus(node_ids.back(), gpus);
  }
  const auto run = cat->begin_run(RunInfo{"bench", "synthetic", "node000", 1e9, 1.0}).value();

  // Ingest: one transaction per node pass, as pacer monitor writes; steps in
  // one transaction per tick for all ranks, with the step time derived.
  long values = 0, steps = 0;
  double sample_s = 0, step_s = 0;
  for (long k = 0; k < ticks; ++k) {
    const double t = 1e9 + static_cast<double>(k);
    const bool hot = k % 1000 >= 990;  // node 5 GPU 3 runs hot 1% of the time, and steps slow down then
    for (int n = 0; n < kNodes; ++n) {
      const Sample s = node_pass(t, n, hot && n == 5);
      const auto t0 = Clock::now();
      if (!cat->write_sample(run, node_ids[n], s)) return 3;
      sample_s += seconds_since(t0);
      values += static_cast<long>(s.readings.size());
    }
    if (k % 1000 == 990 || k % 1000 == 999) {
      EventRecord e{t, k % 1000 == 990 ? "gpu.throttle" : "gpu.throttle_end", "hw_thermal", 3, -1};
      if (!cat->write_event(run, node_ids[5], e)) return 3;
    }
    std::vector<StepRecord> batch;
    for (int r = 0; r < kNodes * kRanksPerNode; ++r)
      batch.push_back(StepRecord{k, t + (hot ? 0.5 : 0.0), r, fmt::format("node{:03}", r / kRanksPerNode), {}, 2.0, 4096,
                                 r == 17 ? 0.3 : 0.05, 0.1, "", {}});
    const auto t0 = Clock::now();
    if (!cat->write_steps(run, batch)) return 3;
    step_s += seconds_since(t0);
    steps += static_cast<long>(batch.size());
  }
  cat.reset();
  const auto bytes = std::filesystem::file_size(db);

  auto ro = std::move(Catalog::open(db, CatalogOptions{.read_only = true}).value());
  nlohmann::json answers = nlohmann::json::array();
  const auto time_sql = [&](const std::string& name, const std::string& sql) {
    std::vector<double> times;
    std::size_t rows = 0;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = Clock::now();
      auto r = ro->query(sql);
      times.push_back(seconds_since(t0));
      if (!r) {
        std::fprintf(stderr, "%s: %s\n", name.c_str(), r.error().message.c_str());
        std::exit(3);
      }
      rows = r->rows.size();
    }
    std::sort(times.begin(), times.end());
    answers.push_back({{"query", name}, {"rows", rows}, {"median_s", times[1]}, {"min_s", times[0]}});
  };
  for (const auto& q : questions()) {
    QuestionArgs a;
    a.limit = 10;
    time_sql(std::string(q.name), question_sql(q.name, a).value());
  }
  time_sql("one GPU's power over 10 minutes",
           "SELECT t, value FROM samples_named WHERE metric='gpu.power_w' AND hostname='node005' AND gpu_index=3 "
           "AND t BETWEEN 1000000600 AND 1000001200");
  time_sql("mean tensor activity per node", "SELECT hostname, avg(value) FROM samples_named WHERE metric='gpm.tensor_util' GROUP BY 1");
  nlohmann::json out = {{"schema", "pacer.bench.telemetry/1"},
                        {"samples", values},
                        {"nodes", kNodes},
                        {"ranks", kNodes * kRanksPerNode},
                        {"steps", steps},
                        {"catalog_bytes", bytes},
                        {"ingest_samples_per_s", values / sample_s},
                        {"ingest_steps_per_s", steps / step_s},
                        {"ingest_sample_s", sample_s},
                        {"ingest_step_s", step_s},
                        {"queries", answers}};
  std::puts(out.dump(2).c_str());
  return 0;
}
