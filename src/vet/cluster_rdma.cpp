#include "cluster_rdma.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "pacer/core/process.hpp"
#include "pacer/core/stats.hpp"
#include "pacer/core/units.hpp"
#include "pacer/hw/system.hpp"
#include "cluster_messages.hpp"
#include "perftest.hpp"
#include "probes.hpp"

namespace pacer::vet {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_left(comm::Deadline d) { return std::chrono::duration<double>(d - Clock::now()).count(); }

std::string port_name(const RdmaPort& p) { return fmt::format("{}/{}", p.device, p.port); }

// Why this node cannot take part, or "".
std::string cannot_test(const ClusterOptions& o, const std::vector<RdmaPort>& ports) {
  if (!o.rdma) return "RDMA tests skipped (--skip rdma)";
  if (ports.empty()) return "no active InfiniBand or RoCE port";
  return perftest_missing();
}

// An answer that is not an object is treated as none.
std::optional<json> receive(comm::TimedComm& c, int peer, int tag, comm::Deadline d) {
  auto j = recv_json(c, peer, tag, d);
  if (!j || !j->is_object()) return std::nullopt;
  return j;
}

// A client that starts before its server listens is refused: it tries again
// until the deadline.
Expected<CapturedOutput> run_client(const std::vector<std::string>& argv, comm::Deadline d) {
  for (;;) {
    const double left = seconds_left(d);
    if (left <= 0.1) return Error{ErrorKind::kIo, fmt::format("{}: no time left before the deadline", argv[0])};
    auto c = capture_output(argv, left);
    if (!c) return c;
    const bool refused = c->status != 0 && c->output.find("Couldn't connect") != std::string::npos;
    if (!refused || seconds_left(d) < 1) return c;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace

json rdma_to_json(const RdmaResult& r) {
  json j = {{"a", r.a}, {"b", r.b}, {"device", r.device}, {"peer_device", r.peer_device}, {"gpudirect", r.gpudirect},
            {"status", std::string(to_string(r.status))}, {"reason", r.reason}};
  j["bandwidth_gbits"] = number_or_null(r.bandwidth_gbits);
  j["latency_us"] = number_or_null(r.latency_us);
  return j;
}

RdmaResult rdma_from_json(const json& j) {
  RdmaResult r;
  r.a = j.value("a", "");
  r.b = j.value("b", "");
  r.device = j.value("device", "");
  r.peer_device = j.value("peer_device", "");
  r.gpudirect = j.value("gpudirect", false);
  r.reason = j.value("reason", "");
  r.bandwidth_gbits = number_at(j, "bandwidth_gbits");
  r.latency_us = number_at(j, "latency_us");
  r.status = status_at(j);
  return r;
}

std::vector<RdmaResult> rdma_pair_test(comm::TimedComm& leaders, const ClusterOptions& o, int peer, bool server,
                                       const std::string& me, const std::string& peer_name, int tag, comm::Deadline deadline) {
  const std::vector<RdmaPort> ports = o.rdma ? active_rdma_ports(vet_root()) : std::vector<RdmaPort>{};
  const std::string why_not = cannot_test(o, ports);
  const bool cuda = why_not.empty() && gpudirect_available(vet_root());
  const double duration = o.node.quick ? 1 : 2;
  if (server) {
    auto ready = receive(leaders, peer, tag, deadline);
    if (!ready) return {};  // the client's side reports the pair
    const int theirs = ready->value("ports", 0);
    if (!why_not.empty() || theirs <= 0) {
      send_json(leaders, peer, tag + 1, {{"skip", why_not.empty() ? "" : fmt::format("{}: {}", me, why_not)}}, deadline);
      return {};
    }
    const bool both_cuda = cuda && ready->value("cuda", false);
    const std::size_t n = std::min<std::size_t>(ports.size(), static_cast<std::size_t>(theirs));
    std::vector<std::thread> servers;
    json offer = {{"host", hw::hostname()}, {"cuda", both_cuda}, {"ports", json::array()}};
    for (std::size_t k = 0; k < n; ++k) {
      PerftestArgs a{ports[k], o.rdma_tcp_port + 2 * static_cast<int>(k), both_cuda ? std::optional<int>(static_cast<int>(k)) : std::nullopt, duration};
      PerftestArgs l = a;
      l.tcp_port += 1;
      // Each server serves one client run and exits; one that is never
      // connected to is killed at the deadline.
      for (auto argv : {perftest_bw_argv(a, ""), perftest_lat_argv(l, "")})
        servers.emplace_back([argv, deadline] { (void)capture_output(argv, std::max(0.1, seconds_left(deadline))); });
      offer["ports"].push_back({{"device", port_name(ports[k])}, {"bw_port", a.tcp_port}, {"lat_port", l.tcp_port}});
    }
    send_json(leaders, peer, tag + 1, offer, deadline);
    for (auto& t : servers) t.join();
    return {};
  }

  const bool told = send_json(leaders, peer, tag, {{"ports", why_not.empty() ? ports.size() : 0}, {"cuda", cuda}}, deadline);
  auto offer = told ? receive(leaders, peer, tag + 1, deadline) : std::nullopt;
  RdmaResult base;
  base.a = peer_name;
  base.b = me;
  if (!offer) {
    base.status = CheckStatus::kError;
    base.reason = fmt::format("{} did not answer by the deadline", peer_name);
    return {base};
  }
  if (!offer->contains("ports")) {
    const std::string theirs = offer->value("skip", "");
    base.reason = !why_not.empty() ? fmt::format("{}: {}", me, why_not) : theirs;
    return {base};
  }
  const std::string host = offer->value("host", "");
  base.gpudirect = offer->value("cuda", false);
  const auto& offered = (*offer)["ports"];
  std::vector<RdmaResult> out(std::min<std::size_t>(offered.size(), ports.size()), base);
  std::vector<std::thread> clients;
  for (std::size_t k = 0; k < out.size(); ++k) {
    RdmaResult& r = out[k];
    r.device = offered[k].value("device", "");
    r.peer_device = port_name(ports[k]);
    PerftestArgs a{ports[k], offered[k].value("bw_port", 0), base.gpudirect ? std::optional<int>(static_cast<int>(k)) : std::nullopt, duration};
    PerftestArgs l = a;
    l.tcp_port = offered[k].value("lat_port", 0);
    clients.emplace_back([&r, a, l, host, deadline] {
      auto bw = run_client(perftest_bw_argv(a, host), deadline);
      auto bw_value = bw ? parse_perftest_bw(bw->output) : Expected<double>(bw.error());
      auto lat = run_client(perftest_lat_argv(l, host), deadline);
      auto lat_value = lat ? parse_perftest_lat(lat->output) : Expected<double>(lat.error());
      if (bw_value) r.bandwidth_gbits = *bw_value;
      if (lat_value) r.latency_us = *lat_value;
      if (bw_value && lat_value) {
        r.status = CheckStatus::kPass;
        r.reason = "ib_write_bw, ib_write_lat";
      } else {
        r.status = CheckStatus::kError;
        r.reason = !bw_value ? "ib_write_bw: " + bw_value.error().message : "ib_write_lat: " + lat_value.error().message;
      }
    });
  }
  for (auto& t : clients) t.join();
  return out;
}

void judge_rdma(std::vector<RdmaResult>& results, const Profile& profile) {
  std::vector<double> bw;
  for (const auto& r : results)
    if (r.bandwidth_gbits) bw.push_back(*r.bandwidth_gbits);
  if (bw.empty()) return;
  const double med = median(bw);
  for (auto& r : results) {
    if (!r.bandwidth_gbits || med <= 0) continue;
    const double ratio = *r.bandwidth_gbits / med;
    const std::string what = fmt::format("{:.0f}% of the median RDMA port pair ({} Gb/s)", 100 * ratio, format_number(med));
    if (ratio < profile.cluster.link_fail_ratio) {
      r.status = worse(r.status, CheckStatus::kFail);
      r.reason = what;
    } else if (ratio < profile.cluster.link_warn_ratio) {
      r.status = worse(r.status, CheckStatus::kWarn);
      r.reason = what;
    }
  }
}

}  // namespace pacer::vet
