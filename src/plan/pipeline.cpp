// Pipeline partitioning: exact min-max contiguous partitions of measured layer times, and the step time,
// bubble and memory per stage of the gpipe, 1F1B and interleaved 1F1B schedules.
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <numeric>

#include "pacer/plan.hpp"

namespace pacer::plan {
namespace {

Error usage(std::string m) { return Error{ErrorKind::kUsage, std::move(m)}; }

// Micro-batches whose activations stage `i` holds at the peak of the schedule.
double in_flight(Schedule s, int i, int stages, int microbatches, int chunks) {
  if (s == Schedule::kGpipe) return microbatches;
  if (s == Schedule::k1f1b || chunks == 1) return std::min(microbatches, stages - i);
  // Interleaved 1F1B (Megatron): warm-up of 2 (P - i - 1) + (V - 1) P chunk-micro-batches plus the one in
  // flight, each holding 1/V of the device's layers.
  const double chunk_mbs = std::min<double>(double(microbatches) * chunks, 2.0 * (stages - i - 1) + double(chunks - 1) * stages + 1);
  return chunk_mbs / chunks;
}

// Builds stages (one per device) from the first layer of each of stages * chunks groups.
PipelinePlan build(const std::vector<Layer>& layers, const std::vector<int>& starts, int stages, int microbatches,
                   Schedule schedule, int chunks) {
  PipelinePlan p;
  p.stages.assign(stages, Stage{});
  const int groups = static_cast<int>(starts.size());
  double max_chunk = 0;
  std::vector<double> layer_memory(stages, 0);
  if (chunks > 1) p.chunk_bounds.assign(stages, {});
  for (int g = 0; g < groups; ++g) {
    const int first = starts[g];
    const int end = g + 1 < groups ? starts[g + 1] : static_cast<int>(layers.size());
    double t = 0, mem = 0;
    for (int l = first; l < end; ++l) {
      t += layers[l].time_s;
      mem += layers[l].memory_bytes;
    }
    Stage& s = p.stages[g % stages];
    if (g < stages) s.first_layer = first;
    s.layer_count += end - first;
    s.time_s += t;
    layer_memory[g % stages] += mem;
    if (chunks > 1) p.chunk_bounds[g % stages].push_back(first);
    max_chunk = std::max(max_chunk, t);
  }
  double sum = 0;
  for (int i = 0; i < stages; ++i) {
    Stage& s = p.stages[i];
    s.in_flight = in_flight(schedule, i, stages, microbatches, chunks);
    s.memory_bytes = layer_memory[i] * s.in_flight;
    p.max_stage_time_s = std::max(p.max_stage_time_s, s.time_s);
    sum += s.time_s;
  }
  // The first micro-batch crosses every stage once; after that the slowest stage sets the pace. With
  // interleaving the fill and drain cross chunks, each a 1/V share of a device.
  if (chunks > 1) p.step_time_s = microbatches * p.max_stage_time_s + (stages - 1) * max_chunk;
  else p.step_time_s = sum + (microbatches - 1) * p.max_stage_time_s;
  p.bubble_fraction = p.step_time_s > 0 ? 1 - microbatches * p.max_stage_time_s / p.step_time_s : 0;
  return p;
}

}  // namespace

std::vector<int> partition_min_max(const std::vector<double>& times, int parts) {
  const int n = static_cast<int>(times.size());
  std::vector<double> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + times[i];
  constexpr double kInf = std::numeric_limits<double>::infinity();
  // best[j][i]: the smallest possible largest group when the first i layers form j groups.
  std::vector<std::vector<double>> best(parts + 1, std::vector<double>(n + 1, kInf));
  std::vector<std::vector<int>> cut(parts + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int j = 1; j <= parts; ++j)
    for (int i = j; i <= n - (parts - j); ++i)
      for (int k = j - 1; k < i; ++k) {
        const double v = std::max(best[j - 1][k], prefix[i] - prefix[k]);
        if (v < best[j][i]) {
          best[j][i] = v;
          cut[j][i] = k;
        }
      }
  std::vector<int> starts(parts);
  for (int j = parts, i = n; j >= 1; --j) {
    starts[j - 1] = cut[j][i];
    i = cut[j][i];
  }
  return starts;
}

Expected<std::vector<Layer>> read_layers_csv(const std::string& path) {
  auto t = read_csv(path);
  if (!t) return t.error();
  auto time_col = t->required_column("time_ms");
  if (!time_col) return time_col.error();
  const int name = t->column("layer"), time = *time_col, mem = t->column("memory_mb");
  std::vector<Layer> layers;
  for (const auto& row : t->rows) {
    Layer l;
    l.line = row.line;
    l.name = name >= 0 ? row.cells[name] : std::to_string(layers.size());
    auto v = t->number(row, time);
    if (!v) return v.error();
    if (!(*v > 0)) return Error{ErrorKind::kConfig, fmt::format("{}:{}: column 'time_ms': {} must be positive", path, row.line, *v)};
    l.time_s = *v / 1e3;
    if (mem >= 0) {
      auto m = t->number(row, mem);
      if (!m) return m.error();
      if (*m < 0) return Error{ErrorKind::kConfig, fmt::format("{}:{}: column 'memory_mb': {} is negative", path, row.line, *m)};
      l.memory_bytes = *m * 1e6;
    }
    layers.push_back(std::move(l));
  }
  return layers;
}

Expected<PipelineReport> plan_pipeline(const std::vector<Layer>& layers, int stages, int microbatches, Schedule schedule,
                                       int chunks) {
  if (stages < 1) return usage(fmt::format("--stages {}: expected at least 1", stages));
  if (microbatches < 1) return usage(fmt::format("--microbatches {}: expected at least 1", microbatches));
  if (chunks < 1) return usage(fmt::format("--chunks {}: expected at least 1", chunks));
  if (schedule != Schedule::kInterleaved && chunks != 1) return usage("--chunks needs --schedule interleaved");
  const int groups = stages * chunks;
  if (groups > static_cast<int>(layers.size()))
    return usage(fmt::format("{} stages x {} chunks need at least {} layers; the file has {}", stages, chunks, groups,
                             layers.size()));
  for (const auto& l : layers)
    if (!(l.time_s > 0)) return usage(fmt::format("layer '{}': time must be positive", l.name));
  PipelineReport r;
  r.schedule = schedule;
  r.stages = stages;
  r.microbatches = microbatches;
  r.chunks = chunks;
  r.has_memory = std::any_of(layers.begin(), layers.end(), [](const Layer& l) { return l.memory_bytes > 0; });
  std::vector<double> times;
  for (const auto& l : layers) times.push_back(l.time_s);
  r.optimal = build(layers, partition_min_max(times, groups), stages, microbatches, schedule, chunks);
  std::vector<int> even(groups);
  const int n = static_cast<int>(layers.size());
  for (int g = 0, at = 0; g < groups; ++g) {
    even[g] = at;
    at += n / groups + (g < n % groups ? 1 : 0);
  }
  r.by_count = build(layers, even, stages, microbatches, schedule, chunks);
  r.gain = r.by_count.step_time_s / r.optimal.step_time_s - 1;
  return r;
}

}  // namespace pacer::plan
