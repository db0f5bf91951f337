// The JSON records of `pacer monitor` (--json).
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

}  // namespace pacer::telemetry
