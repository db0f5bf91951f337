#include "pacer/telemetry/questions.hpp"

#include <fmt/format.h>

namespace pacer::telemetry {

const std::vector<Question>& questions() {
  static const std::vector<Question> kQuestions = {
      {"slowest-steps", "the N slowest steps and what each node's GPUs did during them"},
      {"hot-nodes", "GPUs hotter than --threshold C while step time regressed (> --regression x median)"},
      {"data-wait", "per rank: share of step time waiting for data and in communication"},
      {"throttle", "GPU throttle episodes (power cap, thermal, hardware slowdown) with their duration"},
  };
  return kQuestions;
}

namespace {

// A GPU sample belongs to a step when it was taken during the step or within
// one sampling interval after it ends (rates and GPM figures describe the
// interval that ends at the sample).
constexpr const char* kSlowest = R"sql(
WITH slow AS (
  SELECT st.run_id, st.rank, st.node_id, st.step, st.t, st.step_time_s, coalesce(r.interval_s, 1.0) AS interval_s
  FROM steps st JOIN runs r USING(run_id) WHERE st.step_time_s IS NOT NULL{run_st}
  ORDER BY st.step_time_s DESC LIMIT {limit}),
gpu_metrics AS (
  SELECT metric_id, name FROM metrics WHERE name IN
    ('gpu.util', 'gpm.sm_util', 'gpm.tensor_util', 'gpm.dram_bw_util', 'gpu.power_w', 'gpu.temperature_c',
     'gpu.clock_event_reasons', 'gpu.sm_clock_hz'))
SELECT slow.run_id, slow.step, slow.rank, rn.hostname AS rank_node, round(slow.step_time_s, 4) AS step_time_s,
  n.hostname AS node, g.gpu_index AS gpu,
  round(avg(CASE WHEN m.name = 'gpu.util' THEN s.value END), 3) AS gpu_util,
  round(avg(CASE WHEN m.name = 'gpm.sm_util' THEN s.value END), 3) AS sm_active,
  round(avg(CASE WHEN m.name = 'gpm.tensor_util' THEN s.value END), 3) AS tensor_active,
  round(avg(CASE WHEN m.name = 'gpm.dram_bw_util' THEN s.value END), 3) AS dram_active,
  round(avg(CASE WHEN m.name = 'gpu.power_w' THEN s.value END), 1) AS power_w,
  max(CASE WHEN m.name = 'gpu.temperature_c' THEN s.value END) AS temp_c_max,
  round(min(CASE WHEN m.name = 'gpu.sm_clock_hz' THEN s.value END) / 1e6) AS sm_clock_mhz_min,
  printf('0x%x', max(CASE WHEN m.name = 'gpu.clock_event_reasons' THEN CAST(s.value AS INTEGER) END)) AS clock_reasons
FROM slow
LEFT JOIN samples s ON s.run_id = slow.run_id AND s.gpu_id IS NOT NULL
  AND s.metric_id IN (SELECT metric_id FROM gpu_metrics)
  AND s.t BETWEEN slow.t - slow.step_time_s AND slow.t + slow.interval_s
LEFT JOIN gpu_metrics m ON m.metric_id = s.metric_id
LEFT JOIN gpus g ON g.gpu_id = s.gpu_id
LEFT JOIN nodes n ON n.node_id = s.node_id
LEFT JOIN nodes rn ON rn.node_id = slow.node_id
GROUP BY slow.run_id, slow.rank, slow.step, s.node_id, s.gpu_id
ORDER BY slow.step_time_s DESC, slow.run_id, slow.rank, slow.step, node, gpu
)sql";

// Regressed steps are reduced to one time window per (run, step) before the
// temperature samples are looked up through the (metric_id, t) index: ranks
// share their step windows, so this is one range scan per slow step rather
// than one per rank and step.
constexpr const char* kHot = R"sql(
WITH timed AS (
  SELECT run_id, step_time_s, row_number() OVER (PARTITION BY run_id ORDER BY step_time_s) AS pos,
    count(*) OVER (PARTITION BY run_id) AS n
  FROM steps WHERE step_time_s IS NOT NULL{run}),
median AS MATERIALIZED (
  SELECT timed.run_id, coalesce(r.interval_s, 1.0) AS interval_s, avg(timed.step_time_s) AS median_s
  FROM timed JOIN runs r USING(run_id) WHERE timed.pos IN ((timed.n + 1) / 2, (timed.n + 2) / 2) GROUP BY timed.run_id),
regressed AS MATERIALIZED (
  SELECT st.run_id, st.step, min(st.t - st.step_time_s) AS start_t, max(st.t) + median.interval_s AS end_t,
    avg(st.step_time_s / median.median_s) AS slowdown
  FROM steps st JOIN median USING(run_id)
  WHERE st.step_time_s > {regression} * median.median_s
  GROUP BY st.run_id, st.step)
SELECT regressed.run_id, n.hostname AS node, g.gpu_index AS gpu, max(s.value) AS temp_c_max,
  count(DISTINCT regressed.run_id || ':' || regressed.step) AS regressed_steps,
  round(avg(regressed.slowdown), 3) AS slowdown_vs_median
FROM regressed
JOIN samples s ON s.metric_id = (SELECT metric_id FROM metrics WHERE name = 'gpu.temperature_c')
  AND s.t BETWEEN regressed.start_t AND regressed.end_t AND s.run_id = regressed.run_id AND s.value > {threshold}
JOIN nodes n ON n.node_id = s.node_id JOIN gpus g ON g.gpu_id = s.gpu_id
GROUP BY regressed.run_id, s.node_id, s.gpu_id
ORDER BY temp_c_max DESC, regressed.run_id, node, gpu
)sql";

constexpr const char* kDataWait = R"sql(
SELECT st.run_id, st.rank, n.hostname AS node, count(*) AS steps,
  round(sum(st.step_time_s), 3) AS step_time_s,
  round(sum(st.data_wait_s), 3) AS data_wait_s,
  round(sum(st.data_wait_s) / sum(st.step_time_s), 4) AS data_wait_share,
  round(sum(st.comm_s) / sum(st.step_time_s), 4) AS comm_share
FROM steps st LEFT JOIN nodes n USING(node_id)
WHERE st.step_time_s > 0{run_st}
GROUP BY st.run_id, st.rank
ORDER BY data_wait_share DESC, st.run_id, st.rank
)sql";

constexpr const char* kThrottle = R"sql(
SELECT e.run_id, n.hostname AS node, g.gpu_index AS gpu,
  strftime('%Y-%m-%dT%H:%M:%fZ', e.t, 'unixepoch') AS start,
  round((SELECT min(x.t) FROM events x WHERE x.kind = 'gpu.throttle_end' AND x.node_id = e.node_id
         AND x.gpu_id = e.gpu_id AND x.t > e.t) - e.t, 3) AS duration_s,
  e.detail AS reasons
FROM events e LEFT JOIN nodes n USING(node_id) LEFT JOIN gpus g ON g.gpu_id = e.gpu_id
WHERE e.kind = 'gpu.throttle'{run_e}
ORDER BY e.t
)sql";

}  // namespace

Expected<std::string> question_sql(std::string_view name, const QuestionArgs& a) {
  const auto only = [&](const char* column) {
    return a.run_id ? fmt::format(" AND {} = {}", column, *a.run_id) : std::string();
  };
  const auto filters = [&](const char* sql, auto&&... more) {
    return fmt::format(fmt::runtime(sql), fmt::arg("run", only("run_id")), fmt::arg("run_st", only("st.run_id")),
                       fmt::arg("run_e", only("e.run_id")), more...);
  };
  if (name == "slowest-steps") {
    if (a.limit < 1) return Error{ErrorKind::kUsage, "--limit must be at least 1"};
    return filters(kSlowest, fmt::arg("limit", a.limit));
  }
  if (name == "hot-nodes")
    return filters(kHot, fmt::arg("threshold", a.threshold_c), fmt::arg("regression", a.regression));
  if (name == "data-wait") return filters(kDataWait);
  if (name == "throttle") return filters(kThrottle);
  std::string known;
  for (const auto& q : questions()) known += (known.empty() ? "" : ", ") + std::string(q.name);
  return Error{ErrorKind::kUsage, fmt::format("no question named '{}' (known: {})", name, known)};
}

}  // namespace pacer::telemetry
