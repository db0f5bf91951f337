#include <fmt/format.h>

#include <charconv>
#include <map>

#include "pacer/telemetry/catalog.hpp"
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

Status StepGauges::update(Catalog& catalog, std::int64_t run_id) {
  auto top = catalog.query("SELECT max(rowid) FROM steps");
  if (!top) return top.error();
  const auto* hi = top->rows.empty() ? nullptr : std::get_if<std::int64_t>(&top->rows[0][0]);
  if (!hi || *hi <= seen_rowid_) return {};
  // SQLite takes the bare columns of a max() aggregate from the row that
  // holds the maximum: one row per rank, the newest of the new ones.
  auto r = catalog.query(fmt::format(
      "SELECT st.rank, max(st.t), n.hostname, st.step_time_s, st.loss, st.tokens, st.data_wait_s FROM steps st "
      "LEFT JOIN nodes n ON n.node_id = st.node_id WHERE st.rowid > {} AND st.rowid <= {} AND st.run_id = {} GROUP BY st.rank",
      seen_rowid_, *hi, run_id));
  if (!r) return r.error();
  seen_rowid_ = *hi;
  const auto num = [](const Value& v) -> std::optional<double> {
    if (const auto* i = std::get_if<std::int64_t>(&v)) return static_cast<double>(*i);
    if (const auto* d = std::get_if<double>(&v)) return *d;
    return std::nullopt;
  };
  for (const auto& row : r->rows) {
    const auto rank = num(row[0]);
    const auto t = num(row[1]);
    if (!rank || !t) continue;
    auto [it, added] = by_rank_.try_emplace(static_cast<std::int64_t>(*rank));
    if (!added && it->second.t > *t) continue;  // a late write of an older step
    const auto* host = std::get_if<std::string>(&row[2]);
    it->second = Latest{*t, host ? *host : "", num(row[3]), num(row[4]), num(row[5]), num(row[6])};
  }
  return {};
}

std::string StepGauges::render(const std::string& node) const {
  if (by_rank_.empty()) return "";
  struct Family {
    const char* name;
    const char* help;
    std::optional<double> (*value)(const Latest&);
  };
  static const auto ratio = [](std::optional<double> part, std::optional<double> step) -> std::optional<double> {
    if (!part || !step || !(*step > 0)) return std::nullopt;
    return *part / *step;
  };
  static const Family kFamilies[] = {
      {"pacer_step_time_seconds", "Duration of the newest training step of each rank",
       [](const Latest& l) { return l.step_time_s; }},
      {"pacer_loss", "Loss of the newest training step of each rank", [](const Latest& l) { return l.loss; }},
      {"pacer_tokens_per_second", "Tokens per second of the newest training step of each rank (tokens / step time)",
       [](const Latest& l) { return ratio(l.tokens, l.step_time_s); }},
      {"pacer_data_wait_ratio", "Share of the newest training step of each rank spent waiting for data (0-1)",
       [](const Latest& l) { return ratio(l.data_wait_s, l.step_time_s); }},
  };
  std::string out;
  for (const auto& f : kFamilies) {
    std::string lines;
    for (const auto& [rank, l] : by_rank_)
      if (const auto v = f.value(l))
        lines += fmt::format("{}{{rank=\"{}\",node=\"{}\"}} {}\n", f.name, rank, escape_label(l.node.empty() ? node : l.node), *v);
    if (!lines.empty()) out += fmt::format("# HELP {0} {1}\n# TYPE {0} gauge\n", f.name, f.help) + lines;
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
