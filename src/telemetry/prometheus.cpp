#include <fmt/format.h>

#include <charconv>
#include <map>

#include "pacer/telemetry/monitor.hpp"

namespace pacer::telemetry {

namespace {

// Label values escape backslash, double quote and newline (exposition format).
std::string escape_label(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

}  // namespace

std::string render_prometheus(const Sample& sample, const std::string& node) {
  // Families in metric_defs() order, so the output is stable between scrapes.
  std::map<const MetricDef*, std::vector<const Reading*>> by_metric;
  for (const auto& r : sample.readings)
    if (r.metric->kind == MetricKind::kGauge || r.total) by_metric[r.metric].push_back(&r);
  std::string out;
  for (const auto& def : metric_defs()) {
    auto it = by_metric.find(&def);
    if (it == by_metric.end()) continue;
    const bool counter = def.kind == MetricKind::kCounter;
    const std::string name = std::string(def.prometheus) + (counter ? "_total" : "");
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, def.help, name, counter ? "counter" : "gauge");
    for (const Reading* r : it->second) {
      std::string labels = fmt::format("node=\"{}\"", escape_label(node));
      if (r->gpu >= 0) labels += fmt::format(",gpu=\"{}\"", r->gpu);
      if (!r->device.empty()) labels += fmt::format(",device=\"{}\"", escape_label(r->device));
      out += fmt::format("{}{{{}}} {}\n", name, labels, counter ? *r->total : r->value);
    }
  }
  // Labelled by name, not tid: a tid per series would make a new series for
  // every thread that happens to be busiest.
  if (const auto& t = sample.busiest_thread) {
    out += "# HELP pacer_process_busiest_thread_ratio Share of one core used by the monitored tree's busiest thread over the "
           "last interval\n# TYPE pacer_process_busiest_thread_ratio gauge\n";
    out += fmt::format("pacer_process_busiest_thread_ratio{{node=\"{}\",comm=\"{}\",main=\"{}\"}} {}\n", escape_label(node),
                       escape_label(t->comm), t->main ? "true" : "false", t->busy);
  }
  return out;
}

Expected<ListenAddress> parse_listen_address(const std::string& text) {
  ListenAddress a{"127.0.0.1", 0};
  std::string port = text;
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find("]:");
    if (close == std::string::npos) return Error{ErrorKind::kUsage, fmt::format("'{}': expected [ADDRESS]:PORT", text)};
    a.host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else if (const auto colon = text.rfind(':'); colon != std::string::npos) {
    a.host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), a.port);
  if (a.host.empty() || ec != std::errc() || ptr != port.data() + port.size() || a.port < 0 || a.port > 65535)
    return Error{ErrorKind::kUsage, fmt::format("'{}': expected PORT or HOST:PORT (port 0-65535)", text)};
  return a;
}

}  // namespace pacer::telemetry
