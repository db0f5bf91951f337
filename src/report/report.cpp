#include "pacer/report.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "pacer/core/atomic_file.hpp"
#include "pacer/goodput.hpp"
#include "pacer/telemetry/catalog.hpp"
#include "report/assets.hpp"

namespace pacer::report {
namespace {

using nlohmann::json;
using telemetry::Catalog;
using telemetry::Value;

json cell(const Value& v) {
  if (const auto* i = std::get_if<std::int64_t>(&v)) return *i;
  if (const auto* d = std::get_if<double>(&v)) return std::isfinite(*d) ? json(*d) : json(nullptr);
  if (const auto* s = std::get_if<std::string>(&v)) return *s;
  return nullptr;
}
double num(const Value& v) {
  const json j = cell(v);
  return j.is_number() ? j.get<double>() : NAN;
}

// Charts need no more than milliseconds and four decimals (ratios, watts,
// degrees, cores, seconds); the shortest text of a rounded double is what
// keeps a page of 64 GPUs' timelines a few times smaller.
json rounded(const Value& v, double scale) {
  const json j = cell(v);
  return j.is_number_float() ? json(std::round(j.get<double>() * scale) / scale) : j;
}

// Series keyed by label, each a pair of time and value arrays.
void append(json& series, const std::string& label, const Value& t, const Value& v) {
  json& s = series[label];
  if (s.is_null()) s = {{"t", json::array()}, {"v", json::array()}};
  s["t"].push_back(rounded(t, 1e3));
  s["v"].push_back(rounded(v, 1e4));
}

// Six significant digits: a loss of 1e-5 keeps its value, a rate of 1e14 its size.
json significant(double v) { return std::isfinite(v) ? json(std::stod(fmt::format("{:.6g}", v))) : json(nullptr); }


// What MFU is made of: each step's own `flops`, else FLOPs per token from
// `pacer plan step --json` times the step's tokens, shared by the tp x pp
// ranks of a model replica (each of them reports the replica's tokens).
struct FlopsSource {
  std::optional<double> per_token;
  double replica_ranks = 1;
  std::optional<double> peak_flops;  // FLOP/s of one GPU
  std::string per_token_from, peak_from;
};

Expected<FlopsSource> flops_source(const ReportOptions& o) {
  FlopsSource f;
  if (!o.plan_file.empty()) {
    auto doc = goodput::read_plan_step(o.plan_file);
    if (!doc) return doc.error();
    const json& j = *doc;
    const auto positive = [&](const json& v) { return v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() > 0; };
    const json config = j.value("config", json::object());
    const json flops = j.value("model_flops", json());
    const json seq = config.value("seq", json()), batch = config.value("global_batch", json());
    if (!positive(flops) || !positive(seq) || !positive(batch))
      return Error{ErrorKind::kConfig, fmt::format("{}: model_flops, config.seq and config.global_batch: expected positive numbers "
                                                   "(a `pacer plan step --json` document)", o.plan_file)};
    f.per_token = flops.get<double>() / (seq.get<double>() * batch.get<double>());
    const json tp = config.value("tp", json(1)), pp = config.value("pp", json(1));
    f.replica_ranks = (positive(tp) ? tp.get<double>() : 1) * (positive(pp) ? pp.get<double>() : 1);
    f.per_token_from = "--plan " + o.plan_file;
    const json peak = j.value("hardware", json::object()).value("peak_tflops", json());
    if (positive(peak)) f.peak_flops = peak.get<double>() * 1e12, f.peak_from = "--plan " + o.plan_file;
  }
  if (o.peak_tflops) f.peak_flops = *o.peak_tflops * 1e12, f.peak_from = "--peak-tflops";
  return f;
}

// Loss, tokens/s and MFU (model FLOP/s without a peak: `rate`) per rank against the step. A step done again after
// a restart counts once, as its last record (the one the run kept); steps
// are averaged into at most max_points buckets of whole steps.
Expected<json> training(Catalog& cat, std::int64_t run, const ReportOptions& o) {
  auto src = flops_source(o);
  if (!src) return src.error();
  // A catalog older than steps.flops lacks the column (readers add nothing).
  // The PRAGMA statement, as the table-valued pragma_table_info counts as a write to the read-only guard.
  auto r = cat.query("PRAGMA table_info(steps)");
  if (!r) return r.error();
  const bool has_flops = std::any_of(r->rows.begin(), r->rows.end(), [](const auto& c) { return cell(c.at(1)) == "flops"; });
  r = cat.query(fmt::format("SELECT min(step), max(step) FROM steps WHERE run_id = {}", run));
  if (!r) return r.error();
  const auto& range = r->rows.at(0);
  // Per rank one array of steps (and their end times) that every curve shares: the page's size is what it is.
  json out = {{"step_bucket", nullptr}, {"ranks", json::object()}, {"rate", src->peak_flops ? "mfu" : "model_flops_per_s"},
              {"flops_from", nullptr},
              {"peak_flops", src->peak_flops ? json(*src->peak_flops) : json(nullptr)},
              {"peak_from", src->peak_flops ? json(src->peak_from) : json(nullptr)}};
  if (std::holds_alternative<std::monostate>(range[0])) return out;
  // Whole steps per bucket, in doubles: the step numbers are the caller's, and their span may not fit an int64.
  const double span = num(range[1]) - num(range[0]) + 1;
  const double stride = std::clamp(std::ceil(span / std::max(1, o.max_points)), 1.0, 4e18);
  out["step_bucket"] = stride;
  const std::string own = has_flops ? "st.flops" : "NULL";
  const std::string flops = src->per_token
      ? fmt::format("coalesce({}, {:.17g} * st.tokens / {:.17g})", own, *src->per_token, src->replica_ranks) : own;
  r = cat.query(fmt::format(
      "SELECT st.rank, n.hostname, CAST(st.step / {1:.0f} AS INTEGER) AS b, min(st.step), max(st.t), avg(st.loss), "
      "sum(CASE WHEN st.tokens IS NOT NULL AND st.step_time_s > 0 THEN st.tokens END), "
      "sum(CASE WHEN st.tokens IS NOT NULL AND st.step_time_s > 0 THEN st.step_time_s END), "
      "sum(CASE WHEN {2} >= 0 AND st.step_time_s > 0 THEN {2} END), "
      "sum(CASE WHEN {2} >= 0 AND st.step_time_s > 0 THEN st.step_time_s END), "
      "count({3}) "
      "FROM steps st LEFT JOIN nodes n USING(node_id) WHERE st.run_id = {0} AND NOT EXISTS "
      "(SELECT 1 FROM steps l WHERE l.run_id = st.run_id AND l.rank = st.rank AND l.step = st.step AND l.t > st.t) "
      "GROUP BY st.rank, b ORDER BY st.rank, b",
      run, stride, flops, own));
  if (!r) return r.error();
  bool own_flops = false, any_flops = false;
  for (const auto& s : r->rows) {
    const std::string label = fmt::format("rank {} ({})", std::get<std::int64_t>(s[0]), cell(s[1]).is_string() ? cell(s[1]).get<std::string>() : "?");
    json& curves = out["ranks"][label];
    if (curves.is_null())
      curves = {{"step", json::array()}, {"t", json::array()}, {"loss", json::array()}, {"tokens_per_s", json::array()},
                {"rate", json::array()}};
    curves["step"].push_back(num(s[3]));
    curves["t"].push_back(std::round(num(s[4]) * 1e3) / 1e3);
    curves["loss"].push_back(significant(num(s[5])));
    curves["tokens_per_s"].push_back(num(s[7]) > 0 ? significant(num(s[6]) / num(s[7])) : json(nullptr));
    const double rate = num(s[9]) > 0 ? num(s[8]) / num(s[9]) : NAN;
    any_flops = any_flops || std::isfinite(rate);
    curves["rate"].push_back(significant(src->peak_flops ? rate / *src->peak_flops : rate));
    own_flops = own_flops || num(s[10]) > 0;
  }
  if (!any_flops) {
    for (auto& curves : out["ranks"]) curves.erase("rate");
    out["rate"] = nullptr;
  }
  if (any_flops)
    out["flops_from"] = own_flops && src->per_token ? "steps' flops, else " + src->per_token_from
                        : own_flops ? "steps' flops" : src->per_token_from;
  return out;
}

// The events marked on the timelines, each with its class.
std::string mark_class(const std::string& kind) {
  if (goodput::is_checkpoint_event(kind)) return "checkpoint";
  if (kind == "run.restart") return "restart";
  if (kind == "run.hang") return "hang";
  if (kind.rfind("vet", 0) == 0) return "vet";
  return "";
}

}  // namespace

Expected<json> report_data(const std::string& db, const ReportOptions& o) {
  auto opened = Catalog::open(db, telemetry::CatalogOptions{.read_only = true});
  if (!opened) return opened.error();
  Catalog& cat = **opened;
  auto facts = score::collect_facts(cat, o.score);
  if (!facts) return facts.error();
  score::ScoreReport scored = score::judge(*facts);
  scored.db = db;
  const std::int64_t run = facts->run_id;

  json data = {{"schema", "pacer.report.data/1"}, {"db", db}, {"score", score::to_json(scored)}};
  auto r = cat.query(fmt::format(
      "SELECT run_id, job_id, command, hostname, started, ended, exit_code, interval_s, catalog_status, pacer_version, "
      "(SELECT min(t) FROM samples WHERE run_id = {0}), (SELECT max(t) FROM samples WHERE run_id = {0}), "
      "(SELECT min(t - coalesce(step_time_s, 0)) FROM steps WHERE run_id = {0}), (SELECT max(t) FROM steps WHERE run_id = {0}) "
      "FROM runs WHERE run_id = {0}", run));
  if (!r) return r.error();
  const auto& row = r->rows.at(0);
  json info = json::object();
  for (std::size_t i = 0; i < 10; ++i) info[r->columns[i]] = cell(row[i]);
  data["run"] = info;
  // The time axis spans samples and steps; buckets keep every series under max_points.
  double t0 = INFINITY, t1 = -INFINITY;
  for (std::size_t i : {4u, 10u, 12u})
    if (std::isfinite(num(row[i]))) t0 = std::min(t0, num(row[i]));
  for (std::size_t i : {5u, 11u, 13u})
    if (std::isfinite(num(row[i]))) t1 = std::max(t1, num(row[i]));
  if (!std::isfinite(t0) || !std::isfinite(t1) || t1 <= t0) t1 = (std::isfinite(t0) ? t0 : 0) + 1, t0 = t1 - 1;
  const double interval = std::isfinite(num(row[7])) && num(row[7]) > 0 ? num(row[7]) : 0;
  const double bucket = std::max(interval, (t1 - t0) / std::max(1, o.max_points));
  data["time"] = {{"start", t0}, {"end", t1}, {"bucket_s", bucket}};

  // Steps per rank: bucket means of step time and data wait (and comm).
  r = cat.query(fmt::format(
      "SELECT st.rank, n.hostname, {1} + (CAST((st.t - {1}) / {2} AS INTEGER) + 0.5) * {2} AS tb, "
      "avg(st.step_time_s), avg(st.data_wait_s), avg(st.comm_s), count(*) "
      "FROM steps st LEFT JOIN nodes n USING(node_id) WHERE st.run_id = {0} AND st.step_time_s IS NOT NULL "
      "GROUP BY st.rank, CAST((st.t - {1}) / {2} AS INTEGER) ORDER BY st.rank, tb",
      run, fmt::format("{:.17g}", t0), fmt::format("{:.17g}", bucket)));
  if (!r) return r.error();
  json step_time = json::object(), data_wait = json::object(), comm = json::object();
  for (const auto& s : r->rows) {
    const std::string label = fmt::format("rank {} ({})", std::get<std::int64_t>(s[0]), cell(s[1]).is_string() ? cell(s[1]).get<std::string>() : "?");
    append(step_time, label, s[2], s[3]);
    if (!std::holds_alternative<std::monostate>(s[4])) append(data_wait, label, s[2], s[4]);
    if (!std::holds_alternative<std::monostate>(s[5])) append(comm, label, s[2], s[5]);
  }
  data["steps"] = {{"step_time_s", step_time}, {"data_wait_s", data_wait}, {"comm_s", comm}};

  // GPU and host timelines: bucket means per GPU (or node) and metric.
  r = cat.query(fmt::format(
      "SELECT m.name, n.hostname, g.gpu_index, {1} + (CAST((s.t - {1}) / {2} AS INTEGER) + 0.5) * {2} AS tb, avg(s.value) "
      "FROM samples s JOIN metrics m ON m.metric_id = s.metric_id JOIN nodes n ON n.node_id = s.node_id "
      "LEFT JOIN gpus g ON g.gpu_id = s.gpu_id "
      "WHERE s.run_id = {0} AND s.device IS NULL AND m.name IN ('gpm.sm_util', 'gpm.tensor_util', 'gpm.dram_bw_util', "
      "'gpu.util', 'gpu.power_w', 'gpu.temperature_c', 'cpu.busy', 'proc.cpu_seconds') "
      "GROUP BY s.metric_id, s.node_id, s.gpu_id, CAST((s.t - {1}) / {2} AS INTEGER) ORDER BY m.name, n.hostname, g.gpu_index, tb",
      run, fmt::format("{:.17g}", t0), fmt::format("{:.17g}", bucket)));
  if (!r) return r.error();
  json series = json::object();
  for (const auto& s : r->rows) {
    const std::string metric = std::get<std::string>(s[0]);
    const std::string host = std::get<std::string>(s[1]);
    const std::string label = std::holds_alternative<std::monostate>(s[2]) ? host : fmt::format("{}:{}", host, std::get<std::int64_t>(s[2]));
    if (!series.contains(metric)) series[metric] = json::object();
    append(series[metric], label, s[3], s[4]);
  }
  data["series"] = series;

  // Heatmap: per node and time bucket, the mean GPU activity (SM activity,
  // else NVML utilization), or the all-CPU busy fraction on nodes without GPUs.
  const double hb = std::max(interval, (t1 - t0) / std::max(1, o.heatmap_buckets));
  r = cat.query(fmt::format(
      "WITH pick AS (SELECT CASE WHEN EXISTS (SELECT 1 FROM samples s JOIN metrics m USING(metric_id) WHERE s.run_id = {0} AND m.name = 'gpm.sm_util') "
      "THEN 'gpm.sm_util' WHEN EXISTS (SELECT 1 FROM samples s JOIN metrics m USING(metric_id) WHERE s.run_id = {0} AND m.name = 'gpu.util') "
      "THEN 'gpu.util' ELSE 'cpu.busy' END AS name) "
      "SELECT (SELECT name FROM pick), n.hostname, CAST((s.t - {1}) / {2} AS INTEGER) AS b, avg(s.value) "
      "FROM samples s JOIN nodes n ON n.node_id = s.node_id "
      "WHERE s.run_id = {0} AND s.device IS NULL AND s.metric_id = (SELECT metric_id FROM metrics WHERE name = (SELECT name FROM pick)) "
      "GROUP BY s.node_id, b ORDER BY n.hostname, b",
      run, fmt::format("{:.17g}", t0), fmt::format("{:.17g}", hb)));
  if (!r) return r.error();
  json heat = {{"metric", r->rows.empty() ? json(nullptr) : cell(r->rows[0][0])}, {"bucket_s", hb}, {"start", t0},
               {"buckets", static_cast<int>(std::ceil((t1 - t0) / hb)) + 1}, {"nodes", json::object()}};
  for (const auto& s : r->rows) {
    json& cells = heat["nodes"][std::get<std::string>(s[1])];
    if (cells.is_null()) cells = json::array();
    cells.push_back({cell(s[2]), cell(s[3])});
  }
  data["heatmap"] = heat;

  // Events (vet results among them), the earliest first.
  r = cat.query(fmt::format(
      "SELECT e.t, e.kind, n.hostname AS node, e.rank, g.gpu_index AS gpu, e.detail FROM events e "
      "LEFT JOIN nodes n ON n.node_id = e.node_id LEFT JOIN gpus g ON g.gpu_id = e.gpu_id "
      "WHERE e.run_id = {} ORDER BY e.t LIMIT {}", run, o.max_events + 1));
  if (!r) return r.error();
  json events = json::array();
  for (std::size_t i = 0; i < std::min(r->rows.size(), o.max_events); ++i) {
    json e = json::object();
    for (std::size_t c = 0; c < r->columns.size(); ++c) e[r->columns[c]] = cell(r->rows[i][c]);
    events.push_back(std::move(e));
  }
  data["events"] = events;
  data["events_truncated"] = r->rows.size() > o.max_events;

  auto train = training(cat, run, o);
  if (!train) return train.error();
  data["training"] = std::move(*train);

  // Marks: the narrowest kinds in SQL, the classes in mark_class.
  r = cat.query(fmt::format(
      "SELECT e.t, e.kind, n.hostname, e.rank, e.detail FROM events e LEFT JOIN nodes n ON n.node_id = e.node_id "
      "WHERE e.run_id = {} AND (e.kind IN ('run.committed', 'run.restart', 'run.hang') OR e.kind LIKE 'checkpoint.%' "
      "OR e.kind LIKE 'ckpt.%' OR e.kind LIKE 'vet%') ORDER BY e.t",
      run));
  if (!r) return r.error();
  json marks = json::array();
  bool marks_truncated = false;
  for (const auto& e : r->rows) {
    const std::string kind = cell(e[1]).is_string() ? cell(e[1]).get<std::string>() : "";
    const std::string cls = mark_class(kind);
    if (cls.empty() || !std::isfinite(num(e[0]))) continue;
    if (marks.size() == o.max_marks) {
      marks_truncated = true;
      break;
    }
    const json detail = cell(e[4]);
    marks.push_back({{"t", num(e[0])}, {"class", cls}, {"kind", kind}, {"node", cell(e[2])}, {"rank", cell(e[3])},
                     {"detail", detail.is_string() ? json(detail.get<std::string>().substr(0, 200)) : json(nullptr)}});
  }
  data["marks"] = std::move(marks);
  data["marks_truncated"] = marks_truncated;

  // The goodput ledger, for a run with steps; null for one without (docs/goodput.md).
  goodput::Options go;
  go.run_id = run;
  go.plan_file = o.plan_file;
  auto ledger = goodput::build_ledger(cat, go);
  if (!ledger && ledger.error().kind != ErrorKind::kUsage) return ledger.error();
  data["goodput"] = ledger ? goodput::to_json(*ledger) : json(nullptr);
  return data;
}

std::string render_html(const json& data) {
  // "</" inside a script element would end it early; JSON allows "<\/".
  std::string payload = data.dump(-1, ' ', false, json::error_handler_t::replace);
  for (std::size_t p = 0; (p = payload.find("</", p)) != std::string::npos; p += 3) payload.replace(p, 2, "<\\/");
  std::string html = std::string(assets::kPage);
  auto put = [&](std::string_view slot, std::string_view text) {
    const auto p = html.find(slot);
    if (p != std::string::npos) html.replace(p, slot.size(), text);
  };
  // The data goes in last, so a slot name inside it is never replaced.
  put("/*PACER_UPLOT_CSS*/", assets::kUplotCss);
  put("/*PACER_UPLOT_LICENSE*/", assets::kUplotLicense);
  put("/*PACER_UPLOT_JS*/", assets::kUplotJs);
  put("/*PACER_REPORT_JS*/", assets::kReportJs);
  put("/*PACER_DATA*/", payload);
  return html;
}

Status write_report(const std::string& db, const std::string& out, const ReportOptions& options) {
  auto data = report_data(db, options);
  if (!data) return data.error();
  return write_file_atomic(out, render_html(*data));
}

}  // namespace pacer::report
