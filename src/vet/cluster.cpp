// `pacer vet --cluster`: the protocol between ranks, with a deadline on every message.
#include "pacer/vet/cluster.hpp"

#include <fmt/chrono.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <thread>

#include "cluster_messages.hpp"
#include "cluster_nccl.hpp"
#include "cluster_rdma.hpp"
#include "probes.hpp"
#include "pacer/core/stats.hpp"
#include "pacer/core/units.hpp"
#include "pacer/hw/system.hpp"
#include "pacer/core/time.hpp"

namespace pacer::vet {

using nlohmann::json;
using comm::Deadline;
using Clock = std::chrono::steady_clock;

namespace {

enum Tag : int { kHello = 101, kRole, kRingResult, kPlan, kReport, kPairBase = 200, kRdmaBase = 300 };

Deadline after(Deadline t, double seconds) {
  return t + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}
double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Every phase has a fixed end counted from this rank's start, so a phase that
// waits on a hung peer cannot push the next one past the bound.
struct Schedule {
  Deadline start, hello, role, ring[3], ring_results, plan, bisect[2], allreduce, nccl, rdma[3], checks_end, report;
  explicit Schedule(Deadline t0, double bound_s, bool quick) {
    const double slot = std::clamp(0.04 * bound_s, 1.0, quick ? 3.0 : 10.0);
    start = t0;
    hello = after(t0, std::clamp(0.1 * bound_s, 1.0, 10.0));
    role = after(hello, slot);
    for (int k = 0; k < 3; ++k) ring[k] = after(role, (k + 1) * slot);
    ring_results = after(ring[2], slot);
    plan = after(ring_results, slot);
    bisect[0] = after(plan, slot);
    bisect[1] = after(plan, 2 * slot);
    allreduce = after(bisect[1], slot);
    nccl = after(allreduce, 2 * slot);  // CUDA contexts and NCCL's init come first
    // Two slots a phase: perftest opens the device and connects twice (bandwidth, latency).
    for (int k = 0; k < 3; ++k) rdma[k] = after(nccl, 2 * (k + 1) * slot);
    checks_end = after(t0, bound_s - 2.5);
    report = after(t0, bound_s - 1.0);
  }
};

struct Role {
  bool leader = false;
  int node = 0;
  std::vector<std::string> names;  // node names by index
  std::vector<int> leaders;        // world rank of each node's leader
};

const Injection* find_injection(const std::vector<Injection>& inj, const std::string& check, const std::string& node) {
  for (const auto& i : inj)
    if (i.check == check && i.applies_to(node)) return &i;
  return nullptr;
}

json link_to_json(const LinkResult& l) {
  json j = {{"a", l.a}, {"b", l.b}, {"kind", l.kind}, {"status", std::string(to_string(l.status))}, {"reason", l.reason}};
  j["bandwidth_gbps"] = number_or_null(l.bandwidth_gbps);
  j["latency_us"] = number_or_null(l.latency_us);
  return j;
}

LinkResult link_from_json(const json& j) {
  LinkResult l;
  l.a = j.value("a", "");
  l.b = j.value("b", "");
  l.kind = j.value("kind", "");
  l.reason = j.value("reason", "");
  l.bandwidth_gbps = number_at(j, "bandwidth_gbps");
  l.latency_us = number_at(j, "latency_us");
  l.status = status_at(j);
  return l;
}

// The parts of a node's pacer.vet/1 report the cluster analysis uses.
VetReport report_from_json(const json& j, const Profile& profile) {
  VetReport r;
  r.host = j.value("host", "");
  r.started_at = j.value("started_at", "");
  r.duration_s = j.value("duration_s", 0.0);
  r.mode = j.value("mode", "");
  r.profile = profile;
  r.interrupted = j.value("interrupted", false);
  if (j.contains("versions") && j["versions"].is_object()) r.versions = j["versions"].get<std::map<std::string, std::string>>();
  if (j.contains("checks") && j["checks"].is_array())
    for (const auto& c : j["checks"]) r.checks.push_back(c.get<CheckResult>());
  return r;
}

// Ping-pong between two leaders: latency from small messages, bandwidth from
// large ones (one way: bytes / half the round trip). The initiator measures
// and decides how many round trips fit: up to the configured counts, but the
// latency part stops at a quarter of the time to the deadline and the
// bandwidth part at two thirds, so a slow or busy pair still gives a figure
// instead of an error. A one-byte message tells the responder, which echoes
// everything else, that a part is over. Returns the initiator's result.
class PairTester {
 public:
  PairTester(comm::TimedComm& leaders, const ClusterOptions& o, const Role& role)
      : c_(leaders), o_(o), role_(role), big_(std::make_shared<const std::string>(pattern(o.p2p_bytes))),
        small_(std::make_shared<const std::string>(8, 'p')), done_(std::make_shared<const std::string>(1, 'q')),
        inbox_(o.p2p_bytes) {}

  std::optional<LinkResult> run(int peer, bool initiator, const std::string& kind, int tag, Deadline d) {
    if (!initiator) {
      for (int t : {tag, tag + 1})
        if (!echo(peer, t, d)) return std::nullopt;
      return std::nullopt;
    }
    LinkResult l;
    l.kind = kind;
    l.a = role_.names[role_.node];
    l.b = role_.names[peer];
    const auto start = Clock::now();
    std::vector<double> lat = timed_round_trips(peer, tag, small_, o_.latency_reps, 0, after(start, 0.25 * seconds_between(start, d)), d);
    std::vector<double> rtt;
    if (!lat.empty())  // the first large round trip warms up the path
      rtt = timed_round_trips(peer, tag + 1, big_, o_.p2p_reps, 1, after(start, 0.66 * seconds_between(start, d)), d);
    if (lat.empty() || rtt.empty()) {
      l.status = CheckStatus::kError;
      l.reason = fmt::format("no answer from {} by the deadline", l.b);
      return l;
    }
    l.latency_us = median(lat) / 2 * 1e6;
    l.bandwidth_gbps = static_cast<double>(o_.p2p_bytes) / (median(rtt) / 2) / 1e9;
    const Injection* ia = find_injection(o_.node.injections, "network.p2p", l.a);
    const Injection* ib = find_injection(o_.node.injections, "network.p2p", l.b);
    for (const Injection* i : {ia, ib})
      if (i && i->action == Injection::Action::kValue) {
        l.bandwidth_gbps = std::min(*l.bandwidth_gbps, i->value);
        l.reason = fmt::format("injected bandwidth {} GB/s", format_number(i->value));
      }
    if (l.reason.empty())
      l.reason = fmt::format("{} x {} ping-pong, median; latency from {} round trips of 8 B", rtt.size(),
                             format_bytes(static_cast<double>(o_.p2p_bytes)), lat.size());
    return l;
  }

 private:
  // Round trips of `msg` until `reps` are timed (after `warmup` untimed
  // ones) or `soft` has passed; empty when the peer stopped answering.
  std::vector<double> timed_round_trips(int peer, int tag, const std::shared_ptr<const std::string>& msg, int reps, int warmup,
                                        Deadline soft, Deadline hard) {
    std::vector<double> out;
    std::span<char> into(inbox_.data(), msg->size());
    for (int i = 0; i < reps + warmup; ++i) {
      if (i > warmup && Clock::now() >= soft) break;
      const auto t = Clock::now();
      if (!c_.send(peer, tag, msg, hard) || !c_.recv_into(peer, tag, into, hard)) return {};
      if (i >= warmup) out.push_back(seconds_between(t, Clock::now()));
    }
    c_.send(peer, tag, done_, hard);
    return out;
  }

  // The responder's side: returns every message until the one-byte end mark.
  bool echo(int peer, int tag, Deadline d) {
    for (;;) {
      auto msg = c_.recv(peer, tag, d);
      if (!msg) return false;
      if (msg->size() == 1) return true;
      if (!c_.send(peer, tag, std::make_shared<const std::string>(std::move(*msg)), d)) return false;
    }
  }

  static std::string pattern(std::size_t n) {
    std::string s(n, '\0');
    for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 2654435761u) >> 13);
    return s;
  }
  comm::TimedComm& c_;
  const ClusterOptions& o_;
  const Role& role_;
  std::shared_ptr<const std::string> big_;
  std::shared_ptr<const std::string> small_;
  std::shared_ptr<const std::string> done_;
  std::vector<char> inbox_;
};

// Ring edges (i, i+1), in phases of disjoint pairs: even i, odd i, and the
// edge that closes an odd ring.
std::vector<std::vector<std::pair<int, int>>> ring_phases(int n) {
  std::vector<std::vector<std::pair<int, int>>> phases(3);
  if (n < 2) return phases;
  if (n == 2) {
    phases[0].push_back({0, 1});
    return phases;
  }
  for (int i = 0; i < n; ++i) {
    const int j = (i + 1) % n;
    const int phase = (n % 2 == 1 && i == n - 1) ? 2 : i % 2;
    phases[phase].push_back({i, j});
  }
  return phases;
}

AllReduceResult measure_allreduce(comm::TimedComm& leaders, const ClusterOptions& o, Deadline d) {
  AllReduceResult r;
  r.ranks = leaders.size();
  const std::size_t count = std::max<std::size_t>(1, o.allreduce_bytes / sizeof(float));
  r.bytes = count * sizeof(float);
  if (leaders.size() < 2) {
    r.reason = "one node: nothing to reduce across";
    return r;
  }
  auto buf = std::make_shared<std::vector<float>>(count);
  const int reps = o.node.quick ? 3 : 5;
  std::vector<double> times;
  const float n = static_cast<float>(leaders.size());
  for (int i = 0; i <= reps; ++i) {
    std::fill(buf->begin(), buf->end(), 1.0f);
    const auto t = Clock::now();
    if (!leaders.all_reduce_sum(buf, d)) {
      r.status = CheckStatus::kError;
      r.reason = "a node did not take part by the deadline";
      return r;
    }
    if (i > 0) times.push_back(seconds_between(t, Clock::now()));
    // Every element must be the number of nodes: a wrong sum is a broken path.
    if ((*buf)[0] != n || (*buf)[count - 1] != n || (*buf)[count / 2] != n) {
      r.status = CheckStatus::kFail;
      r.reason = fmt::format("wrong result: {} instead of {}", (*buf)[count / 2], n);
      return r;
    }
  }
  const double t = median(times);
  r.algbw_gbps = static_cast<double>(r.bytes) / t / 1e9;
  r.busbw_gbps = *r.algbw_gbps * *busbw_factor("all_reduce", static_cast<int>(leaders.size()));
  r.status = CheckStatus::kPass;
  r.reason = fmt::format("MPI_Iallreduce of {} float32 over {} nodes, median of {}", format_bytes(static_cast<double>(r.bytes)),
                         leaders.size(), reps);
  return r;
}

// Greedy rounds of disjoint pairs; pairs that do not fit in `max_rounds` are dropped.
std::vector<std::vector<std::pair<int, int>>> rounds_of(const std::vector<std::pair<int, int>>& pairs, int max_rounds) {
  std::vector<std::vector<std::pair<int, int>>> rounds;
  std::vector<std::set<int>> busy;
  for (const auto& p : pairs) {
    bool placed = false;
    for (std::size_t r = 0; r < rounds.size() && !placed; ++r)
      if (!busy[r].count(p.first) && !busy[r].count(p.second)) {
        rounds[r].push_back(p);
        busy[r].insert({p.first, p.second});
        placed = true;
      }
    if (!placed && static_cast<int>(rounds.size()) < max_rounds) {
      rounds.push_back({p});
      busy.push_back({p.first, p.second});
    }
  }
  return rounds;
}

// What rank 0 learns in the hello: which ranks are on which node, and the
// ranks that never said hello.
struct Roster {
  Role role;
  std::vector<int> missing_ranks;
  std::map<std::string, std::vector<int>> ranks_of;
  std::map<std::string, std::string> host_of;
};

// Hello: every rank tells rank 0 its node; rank 0 groups ranks into nodes
// (in order of their lowest rank, whose rank leads the node) and answers
// with each rank's role. nullopt on a rank that lost contact with rank 0:
// it has no part in the rest.
std::optional<Roster> greet(comm::TimedComm& world, const std::string& name, const Schedule& when) {
  Roster out;
  Role& role = out.role;
  if (world.rank() != 0) {
    if (!send_json(world, 0, kHello, {{"node", name}, {"host", hw::hostname()}}, when.hello)) return std::nullopt;
    auto j = recv_json(world, 0, kRole, when.role);
    if (!j) return std::nullopt;
    role.leader = j->value("leader", false);
    role.node = j->value("node", 0);
    role.names = (*j)["names"].get<std::vector<std::string>>();
    role.leaders = (*j)["leaders"].get<std::vector<int>>();
    return out;
  }
  std::vector<std::pair<std::string, std::string>> hello(world.size());
  hello[0] = {name, hw::hostname()};
  for (int r = 1; r < world.size(); ++r) {
    auto j = recv_json(world, r, kHello, when.hello);
    if (!j) out.missing_ranks.push_back(r);
    else hello[r] = {j->value("node", ""), j->value("host", "")};
  }
  for (int r = 0; r < world.size(); ++r) {
    if (hello[r].first.empty()) continue;
    auto& ranks = out.ranks_of[hello[r].first];
    if (ranks.empty()) {
      role.names.push_back(hello[r].first);
      role.leaders.push_back(r);
      out.host_of[hello[r].first] = hello[r].second;
    }
    ranks.push_back(r);
  }
  for (int r = 1; r < world.size(); ++r) {
    if (hello[r].first.empty()) continue;
    const int node = static_cast<int>(std::find(role.names.begin(), role.names.end(), hello[r].first) - role.names.begin());
    send_json(world, r, kRole, {{"leader", role.leaders[node] == r}, {"node", node}, {"names", role.names}, {"leaders", role.leaders}},
              when.role);
  }
  role.leader = true;
  role.node = 0;
  return out;
}

using BisectionPlan = std::vector<std::vector<std::pair<int, int>>>;  // rounds of node pairs

// Rank 0's half of the ring's end: every link of the ring, judged (a link
// nobody reported is an error, not a gap), and the bisection rounds chosen
// from them, which go to every leader.
BisectionPlan judge_ring(comm::TimedComm& leaders, const Role& role, const Profile& profile, const Schedule& when,
                         std::vector<LinkResult>& ring_links) {
  const int n = leaders.size();
  std::vector<LinkResult> all = ring_links;
  std::set<std::pair<std::string, std::string>> have;
  for (const auto& l : ring_links) have.insert({l.a, l.b});
  for (int r = 1; r < n; ++r)
    if (auto j = recv_json(leaders, r, kRingResult, when.ring_results))
      for (const auto& e : *j) {
        all.push_back(link_from_json(e));
        have.insert({all.back().a, all.back().b});
      }
  for (const auto& phase : ring_phases(n))
    for (const auto& [a, b] : phase)
      if (!have.count({role.names[a], role.names[b]}))
        all.push_back({role.names[a], role.names[b], "ring", std::nullopt, std::nullopt, CheckStatus::kError,
                       fmt::format("no result: {} did not report by the deadline", role.names[a])});
  judge_links(all, profile);
  ring_links = all;
  std::vector<std::pair<int, int>> pairs;
  for (const auto& [x, y] : bisection_pairs(all)) {
    const auto ix = std::find(role.names.begin(), role.names.end(), x) - role.names.begin();
    const auto iy = std::find(role.names.begin(), role.names.end(), y) - role.names.begin();
    pairs.push_back({static_cast<int>(ix), static_cast<int>(iy)});
  }
  BisectionPlan plan = rounds_of(pairs, 2);
  for (int r = 1; r < n; ++r) send_json(leaders, r, kPlan, plan, when.plan);
  return plan;
}

struct NetworkResults {
  std::vector<LinkResult> ring_links, bisect_links;  // on rank 0 the ring's are every node's
  AllReduceResult allreduce, nccl;
  std::vector<RdmaResult> rdma;  // measured on this node (the clients' side)
};

// Network: the ring, then bisection pairs chosen by rank 0, then the
// all-reduces. Every leader walks the same phases against the same
// deadlines, so a slow or silent node costs its partners only its slots.
NetworkResults test_network(comm::TimedComm& leaders, const ClusterOptions& o, const Role& role, const Profile& profile,
                            const Schedule& when, const std::string& name) {
  NetworkResults out;
  const int n = leaders.size();
  const Injection* net = find_injection(o.node.injections, "network.p2p", name);
  if (!o.network) {
    out.allreduce.ranks = n;
    out.allreduce.reason = "network tests skipped (--skip network)";
    out.nccl = out.allreduce;
    return out;
  }
  if (net && net->action == Injection::Action::kHang) {
    // An injected hang: this node sits the network out, as a wedged one would.
    std::this_thread::sleep_until(when.nccl);
    return out;
  }
  if (n >= 2) {
    PairTester tester(leaders, o, role);
    const auto phases = ring_phases(n);
    for (int p = 0; p < 3; ++p)
      for (const auto& [a, b] : phases[p]) {
        if (a != role.node && b != role.node) continue;
        auto l = tester.run(a == role.node ? b : a, a == role.node, "ring", kPairBase + 2 * p, when.ring[p]);
        if (l) out.ring_links.push_back(*l);
      }
    BisectionPlan plan;
    if (role.node == 0) {
      plan = judge_ring(leaders, role, profile, when, out.ring_links);
    } else {
      json mine = json::array();
      for (const auto& l : out.ring_links) mine.push_back(link_to_json(l));
      send_json(leaders, 0, kRingResult, mine, when.ring_results);
      if (auto j = recv_json(leaders, 0, kPlan, when.plan)) plan = j->get<BisectionPlan>();
    }
    for (std::size_t k = 0; k < plan.size() && k < 2; ++k)
      for (const auto& [a, b] : plan[k]) {
        if (a != role.node && b != role.node) continue;
        auto l = tester.run(a == role.node ? b : a, a == role.node, "bisect", kPairBase + 10 + 2 * static_cast<int>(k), when.bisect[k]);
        if (l) out.bisect_links.push_back(*l);
      }
  }
  out.allreduce = measure_allreduce(leaders, o, when.allreduce);
  out.nccl = nccl_allreduce_across_nodes(leaders, o.allreduce_bytes, o.node.quick ? 3 : 5, when.nccl);
  // RDMA ports, pair by pair along the ring: NCCL's traffic takes these
  // ports, not the path MPI's tests above may have used.
  if (n >= 2 && o.rdma) {
    const auto phases = ring_phases(n);
    for (int p = 0; p < 3; ++p)
      for (const auto& [a, b] : phases[p]) {
        if (a != role.node && b != role.node) continue;
        const int other = a == role.node ? b : a;
        auto got = rdma_pair_test(leaders, o, other, a == role.node, name, role.names[other], kRdmaBase + 2 * p, when.rdma[p]);
        out.rdma.insert(out.rdma.end(), got.begin(), got.end());
      }
  }
  return out;
}

// The node checks, cut to the time left before the reports are due. The
// cluster-only injections stay with the cluster phases.
Expected<VetReport> check_node(const ClusterOptions& o, const std::string& name, const Schedule& when) {
  VetOptions node = o.node;
  node.node_name = name;
  node.injections.clear();
  for (const auto& i : o.node.injections)
    if (!is_cluster_check(i.check)) node.injections.push_back(i);
  node.bound_s = seconds_between(Clock::now(), when.checks_end);
  return run_vet(node);
}

// A leader other than rank 0 sends its node's report and its bisection links.
void send_report(comm::TimedComm& leaders, const ClusterOptions& o, const std::string& name, const Schedule& when,
                 const VetReport& report, const std::vector<LinkResult>& bisect_links, const std::vector<RdmaResult>& rdma) {
  const Injection* wedge = find_injection(o.node.injections, "cluster.report", name);
  if (wedge && wedge->action == Injection::Action::kHang) {
    // A wedged node: silent past the bound; rank 0 reports it and ends the job.
    std::this_thread::sleep_until(after(when.start, o.bound_s + 5));
    return;
  }
  json j = to_json(report);
  j.erase("profile");  // rank 0 has it
  json links = json::array();
  for (const auto& l : bisect_links) links.push_back(link_to_json(l));
  json rdma_results = json::array();
  for (const auto& r : rdma) rdma_results.push_back(rdma_to_json(r));
  send_json(leaders, 0, kReport, {{"report", j}, {"links", links}, {"rdma", rdma_results}, {"stalled", leaders.abandoned()}}, when.report);
}

// The other leaders' reports, by node index (nullopt: none by the deadline).
// Taken in whatever order they arrive: a large message moves only while its
// sender polls, so waiting on a silent node first could leave the next one's
// sender to give up.
std::vector<std::optional<json>> receive_reports(comm::TimedComm& leaders, const Schedule& when) {
  const int n = leaders.size();
  std::vector<std::optional<json>> got(static_cast<std::size_t>(n));
  for (int left = n - 1; left > 0 && Clock::now() < when.report;) {
    bool any = false;
    for (int i = 1; i < n; ++i) {
      if (got[i]) continue;
      if ((got[i] = recv_json(leaders, i, kReport, Clock::now()))) {
        --left;
        any = true;
      }
    }
    if (!any) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return got;
}

}  // namespace

Expected<std::optional<ClusterReport>> run_cluster_vet(comm::TimedComm& world, const ClusterOptions& o) {
  const std::optional<ClusterReport> kNotRoot;
  const auto t0 = Clock::now();
  const std::string started_at = utc_iso_now();
  auto profile = load_profile(o.node.profile);
  if (!profile) return profile.error();
  const Schedule when(t0, o.bound_s, o.node.quick);
  const std::string name = o.node_name.empty() ? hw::hostname() : o.node_name;

  auto roster = greet(world, name, when);
  if (!roster || !roster->role.leader) return kNotRoot;
  const Role& role = roster->role;
  auto sub = world.subset(role.leaders);
  if (!sub) return sub.error();
  comm::TimedComm& leaders = **sub;
  const int n = leaders.size();

  NetworkResults net = test_network(leaders, o, role, *profile, when, name);
  auto report = check_node(o, name, when);
  if (!report) return report.error();
  if (role.node != 0) {
    send_report(leaders, o, name, when, *report, net.bisect_links, net.rdma);
    return kNotRoot;
  }

  ClusterReport r;
  r.started_at = started_at;
  r.bound_s = o.bound_s;
  r.mode = o.node.quick ? "quick" : "full";
  r.profile = profile->name;
  r.ranks = world.size();
  r.missing_ranks = roster->missing_ranks;
  r.injections = o.node.injections;
  r.allreduce = net.allreduce;
  r.nccl = net.nccl;
  r.stalled = leaders.abandoned();
  r.links = net.ring_links;
  r.links.insert(r.links.end(), net.bisect_links.begin(), net.bisect_links.end());
  r.rdma = net.rdma;
  const auto got = receive_reports(leaders, when);
  for (int i = 0; i < n; ++i) {
    NodeResult nr;
    nr.name = role.names[i];
    nr.host = roster->host_of[nr.name];
    nr.ranks = roster->ranks_of[nr.name];
    if (i == 0) {
      nr.report = *report;
    } else if (const auto& j = got[i]) {
      nr.report = report_from_json((*j)["report"], *profile);
      r.stalled = r.stalled || j->value("stalled", false);
      for (const auto& e : (*j)["links"]) r.links.push_back(link_from_json(e));
      if (j->contains("rdma") && (*j)["rdma"].is_array())
        for (const auto& e : (*j)["rdma"]) r.rdma.push_back(rdma_from_json(e));
    }
    r.nodes.push_back(std::move(nr));
  }
  judge_links(r.links, *profile);  // the bisection links against the same median
  r.suspects = blame(r.links);
  judge_rdma(r.rdma, *profile);
  r.drift = find_drift(r.nodes);
  r.outliers = find_outliers(r.nodes, *profile);
  judge_nodes(r);
  if (o.need) r.selection = select_nodes(r.nodes, *o.need);
  r.duration_s = seconds_between(t0, Clock::now());
  return std::optional<ClusterReport>(std::move(r));
}

}  // namespace pacer::vet
