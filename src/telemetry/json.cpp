// The JSON records of `pacer monitor`, `pacer query` and `pacer catalog merge` (--json).
#include <cmath>

#include "pacer/telemetry/catalog.hpp"
#include "pacer/telemetry/monitor.hpp"

namespace pacer::telemetry {

using nlohmann::json;

json to_json(const MonitorResult& r) {
  json j = {{"schema", "pacer.monitor/1"},
            {"db", r.db},
            {"run_id", r.run_id},
            {"exit_code", r.exit_code},
            {"samples", r.samples},
            {"readings", r.readings},
            {"steps", r.steps},
            {"malformed_lines", r.malformed_lines},
            {"malformed_examples", r.malformed_examples},
            {"dropped", r.dropped},
            {"nonfinite", r.nonfinite},
            {"catalog_status", r.catalog_status},
            {"wall_s", r.wall_s},
            {"sampler_cpu_s", r.sampler_cpu_s},
            {"sampler_core_percent", r.sampler_core_percent()},
            {"notes", r.notes}};
  if (!r.prometheus_url.empty()) j["prometheus_url"] = r.prometheus_url;
  return j;
}

namespace {
// JSON has no NaN or infinity: such cells are null, as SQL NULL is.
json cell_json(const Value& v) {
  if (std::holds_alternative<std::monostate>(v)) return nullptr;
  if (const auto* i = std::get_if<std::int64_t>(&v)) return *i;
  if (const auto* d = std::get_if<double>(&v)) return std::isfinite(*d) ? json(*d) : json(nullptr);
  return std::get<std::string>(v);
}
}  // namespace

json to_json(const QueryResult& r, const std::string& db, const std::string& query, bool named_question) {
  json rows = json::array();
  for (const auto& row : r.rows) {
    json o = json::object();
    for (std::size_t i = 0; i < row.size(); ++i) o[r.columns[i]] = cell_json(row[i]);
    rows.push_back(std::move(o));
  }
  json j = {{"schema", "pacer.query/1"}, {"db", db}, {"columns", r.columns}, {"rows", rows}};
  j[named_question ? "question" : "sql"] = query;
  return j;
}

json to_json(const MergeResult& r, const std::string& out, const std::vector<std::string>& inputs) {
  return {{"schema", "pacer.catalog.merge/1"}, {"out", out},         {"inputs", inputs}, {"runs", r.runs},
          {"nodes", r.nodes},                  {"samples", r.samples}, {"steps", r.steps}, {"events", r.events},
          {"skipped", r.skipped}};
}

}  // namespace pacer::telemetry
