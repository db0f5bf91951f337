// The cluster vet's report: JSON (pacer.vet.cluster/1), the tables, the exit code and the host files.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <set>

#include "pacer/core/atomic_file.hpp"
#include "pacer/core/table.hpp"
#include "pacer/core/units.hpp"
#include "pacer/vet/cluster.hpp"
#include "cluster_rdma.hpp"

namespace pacer::vet {

using nlohmann::json;

namespace {

json opt(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }
std::string status_text(CheckStatus s) { return std::string(to_string(s)); }

json allreduce_json(const AllReduceResult& a) {
  return {{"bytes", a.bytes},          {"ranks", a.ranks},   {"algbw_gbps", opt(a.algbw_gbps)},
          {"busbw_gbps", opt(a.busbw_gbps)}, {"status", status_text(a.status)}, {"reason", a.reason}};
}

std::string gbps(const std::optional<double>& v) { return v ? fmt::format("{} GB/s", format_number(*v)) : "-"; }

}  // namespace

int exit_code(const ClusterReport& r) {
  const std::string v = r.verdict();
  if (v == "pass") return static_cast<int>(ExitCode::kOk);
  if (v == "too_few") return kExitTooFewNodes;
  return static_cast<int>(ExitCode::kCheckFailed);
}

json to_json(const ClusterReport& r) {
  json nodes = json::array();
  for (const auto& n : r.nodes) {
    json report = nullptr;
    if (n.report) {
      report = to_json(*n.report);
      report.erase("profile");  // the same on every node; recorded once at the top
    }
    nodes.push_back({{"name", n.name},
                     {"host", n.host},
                     {"ranks", n.ranks},
                     {"status", status_text(n.status)},
                     {"healthy", n.healthy()},
                     {"score", n.score},
                     {"reasons", n.reasons},
                     {"report", report}});
  }
  json links = json::array();
  for (const auto& l : r.links)
    links.push_back({{"a", l.a}, {"b", l.b}, {"kind", l.kind}, {"bandwidth_gbps", opt(l.bandwidth_gbps)},
                     {"latency_us", opt(l.latency_us)}, {"status", status_text(l.status)}, {"reason", l.reason}});
  json rdma = json::array();
  for (const auto& x : r.rdma) rdma.push_back(rdma_to_json(x));
  json drift = json::array();
  for (const auto& d : r.drift) drift.push_back({{"key", d.key}, {"reference", d.reference}, {"values", d.values}, {"status", "fail"}});
  json outliers = json::array();
  for (const auto& o : r.outliers) {
    json entries = json::array();
    for (const auto& e : o.nodes)
      entries.push_back({{"node", e.node}, {"value", e.value}, {"ratio", e.ratio}, {"z", e.z}, {"status", status_text(e.status)}});
    outliers.push_back({{"check", o.check}, {"target", o.target}, {"unit", o.unit}, {"median", o.median}, {"mad", o.mad}, {"nodes", entries}});
  }
  json selection = nullptr;
  if (r.selection)
    selection = {{"need", r.selection->need}, {"chosen", r.selection->chosen}, {"excluded", r.selection->excluded},
                 {"enough", r.selection->enough()}};
  json inj = json::array();
  for (const auto& i : r.injections) inj.push_back(i);
  return {{"schema", kClusterReportSchema},
          {"started_at", r.started_at},
          {"duration_s", r.duration_s},
          {"bound_s", r.bound_s},
          {"mode", r.mode},
          {"profile", r.profile},
          {"ranks", r.ranks},
          {"missing_ranks", r.missing_ranks},
          {"nodes", nodes},
          {"network", {{"links", links}, {"suspects", r.suspects}, {"allreduce", allreduce_json(r.allreduce)}, {"nccl", allreduce_json(r.nccl)}, {"rdma", rdma}}},
          {"drift", drift},
          {"outliers", outliers},
          {"selection", selection},
          {"injections", inj},
          {"verdict", r.verdict()},
          {"exit_code", exit_code(r)}};
}

std::string render_table(const ClusterReport& r) {
  std::string out;
  Table nodes({{"NODE"}, {"HOST"}, {"RANKS", true}, {"STATUS"}, {"SCORE", true}, {"PASS", true}, {"WARN", true}, {"FAIL", true}, {"ERROR", true}, {"REASON", false, 90}});
  for (const auto& n : r.nodes) {
    std::map<std::string, int> c;
    if (n.report) c = n.report->counts();
    auto count = [&](const char* k) { return n.report ? std::to_string(c[k]) : "-"; };
    nodes.add_row({n.name, n.host, std::to_string(n.ranks.size()), status_text(n.status), fmt::format("{:.2f}", n.score),
                   count("pass"), count("warn"), count("fail"), count("error"),
                   n.reasons.empty() ? "" : n.reasons.front() + (n.reasons.size() > 1 ? fmt::format(" (+{} more)", n.reasons.size() - 1) : "")});
  }
  out += nodes.render();

  if (!r.links.empty() || r.allreduce.status != CheckStatus::kSkip) {
    Table net({{"LINK"}, {"KIND"}, {"BANDWIDTH", true}, {"LATENCY", true}, {"STATUS"}, {"REASON", false, 90}});
    for (const auto& l : r.links)
      net.add_row({l.a + " - " + l.b, l.kind, gbps(l.bandwidth_gbps), l.latency_us ? fmt::format("{} us", format_number(*l.latency_us)) : "-",
                   status_text(l.status), l.reason});
    net.add_row({"all-reduce (MPI)", fmt::format("{} nodes", r.allreduce.ranks), gbps(r.allreduce.busbw_gbps), "",
                 status_text(r.allreduce.status), r.allreduce.busbw_gbps ? fmt::format("busbw; algbw {}; {}", gbps(r.allreduce.algbw_gbps), r.allreduce.reason) : r.allreduce.reason});
    net.add_row({"all-reduce (NCCL)", fmt::format("{} nodes", r.nccl.ranks), gbps(r.nccl.busbw_gbps), "", status_text(r.nccl.status), r.nccl.reason});
    out += "\n" + net.render();
    if (!r.suspects.empty()) out += fmt::format("network suspects (every link tested with them was slow): {}\n", fmt::join(r.suspects, ", "));
  }

  if (!r.rdma.empty()) {
    std::set<std::string> skip_reasons;
    bool measured = false;
    // Reasons name the node ("node3: no active ... port"): the same lack on
    // every node is one line, not a row per pair.
    for (const auto& x : r.rdma) {
      if (x.status == CheckStatus::kSkip) {
        const auto colon = x.reason.find(": ");
        skip_reasons.insert(colon == std::string::npos ? x.reason : x.reason.substr(colon + 2));
      } else {
        measured = true;
      }
    }
    if (!measured && skip_reasons.size() == 1) {
      out += fmt::format("\nrdma (perftest): skip on every pair: {}\n", *skip_reasons.begin());
    } else {
      Table rdma({{"RDMA PORTS"}, {"GPU"}, {"BANDWIDTH", true}, {"LATENCY", true}, {"STATUS"}, {"REASON", false, 90}});
      for (const auto& x : r.rdma)
        rdma.add_row({fmt::format("{} {} - {} {}", x.a, x.device.empty() ? "-" : x.device, x.b, x.peer_device.empty() ? "-" : x.peer_device),
                      x.gpudirect ? "yes" : "no", x.bandwidth_gbits ? fmt::format("{} Gb/s", format_number(*x.bandwidth_gbits)) : "-",
                      x.latency_us ? fmt::format("{} us", format_number(*x.latency_us)) : "-", status_text(x.status), x.reason});
      out += "\n" + rdma.render();
    }
  }

  if (!r.drift.empty()) {
    Table drift({{"DRIFT"}, {"VALUE"}, {"NODES", false, 90}});
    for (const auto& d : r.drift)
      for (const auto& [value, names] : d.values)
        drift.add_row({d.key, value + (value == d.reference ? "" : "  <- differs"), fmt::format("{}", fmt::join(names, ","))});
    out += "\n" + drift.render();
  }

  if (!r.outliers.empty()) {
    Table outl({{"CHECK"}, {"TARGET", false, 28}, {"NODE"}, {"VALUE", true}, {"MEDIAN", true}, {"OF MEDIAN", true}, {"Z", true}, {"STATUS"}});
    for (const auto& o : r.outliers)
      for (const auto& e : o.nodes)
        outl.add_row({o.check, o.target, e.node, fmt::format("{} {}", format_number(e.value), o.unit),
                      fmt::format("{} {}", format_number(o.median), o.unit), fmt::format("{:.0f}%", 100 * e.ratio),
                      fmt::format("{:.1f}", e.z), status_text(e.status)});
    out += "\n" + outl.render();
  }

  int healthy = 0;
  for (const auto& n : r.nodes) healthy += n.healthy() ? 1 : 0;
  out += "\n";
  if (!r.missing_ranks.empty()) out += fmt::format("ranks that never answered: {}\n", fmt::join(r.missing_ranks, ", "));
  if (r.selection)
    out += fmt::format("selected {} of {} needed: {}; excluded: {}\n", r.selection->chosen.size(), r.selection->need,
                       r.selection->chosen.empty() ? "-" : fmt::format("{}", fmt::join(r.selection->chosen, ",")),
                       r.selection->excluded.empty() ? "-" : fmt::format("{}", fmt::join(r.selection->excluded, ",")));
  const std::string v = r.verdict();
  const auto plural = [](std::size_t n, const char* word) { return fmt::format("{} {}{}", n, word, n == 1 ? "" : "s"); };
  out += fmt::format("{}: {} ({}, {} profile, {}) in {}: {} healthy, {} not{}\n", v == "pass" ? "OK" : "FAILED",
                     plural(r.nodes.size(), "node"), plural(static_cast<std::size_t>(r.ranks), "rank"), r.profile, r.mode,
                     format_duration(r.duration_s), healthy,
                     static_cast<int>(r.nodes.size()) - healthy,
                     v == "too_few" ? fmt::format("; {} needed", r.selection->need) : "");
  return out;
}

Status write_selection(const Selection& s, const std::string& hostfile, const std::string& exclude_file) {
  std::string hosts, excluded;
  for (const auto& n : s.chosen) hosts += n + "\n";
  for (const auto& n : s.excluded) excluded += n + "\n";
  if (Status st = write_file_atomic(hostfile, hosts); !st) return st;
  return write_file_atomic(exclude_file, excluded);
}

}  // namespace pacer::vet
