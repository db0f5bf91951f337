// Rank 0's judgement of an allocation: drift, outliers, slow links, node health and selection.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <tuple>

#include "pacer/core/stats.hpp"
#include "pacer/core/units.hpp"
#include "pacer/vet/cluster.hpp"
#include "outliers.hpp"
#include "probes.hpp"

namespace pacer::vet {

namespace {

bool is_slow(const LinkResult& l) { return l.status == CheckStatus::kWarn || l.status == CheckStatus::kFail || l.status == CheckStatus::kError; }

// Fast and slow links per node, nodes in order of first appearance.
struct LinkTally {
  std::map<std::string, int> fast, slow;
  std::vector<std::string> order;
};
LinkTally tally(const std::vector<LinkResult>& links) {
  LinkTally t;
  for (const auto& l : links)
    for (const std::string* n : {&l.a, &l.b}) {
      if (!t.fast.count(*n)) {
        t.order.push_back(*n);
        t.fast[*n] = 0;
        t.slow[*n] = 0;
      }
      (is_slow(l) ? t.slow : t.fast)[*n] += 1;
    }
  return t;
}

// Failures and errors are listed before warnings, so the first reason of a
// failed node says why it failed.
void raise(NodeResult& n, CheckStatus s, std::string why) {
  n.status = worse(n.status, s);
  const bool bad = s == CheckStatus::kFail || s == CheckStatus::kError;
  n.reasons.insert(bad ? n.reasons.begin() : n.reasons.end(), std::move(why));
}

}  // namespace

std::string ClusterReport::verdict() const {
  if (selection) return selection->enough() ? "pass" : "too_few";
  if (!missing_ranks.empty()) return "fail";
  for (const auto& n : nodes)
    if (!n.healthy()) return "fail";
  return "pass";
}

bool ClusterReport::complete() const {
  if (!missing_ranks.empty() || stalled) return false;
  for (const auto& n : nodes)
    if (!n.report) return false;
  return true;
}

std::vector<Drift> find_drift(const std::vector<NodeResult>& nodes) {
  // Versions the software probe records, and the THP settings the training
  // stack is sensitive to; anything else may differ between healthy nodes.
  std::map<std::string, std::map<std::string, std::vector<std::string>>> seen;
  for (const auto& n : nodes) {
    if (!n.report) continue;
    for (const auto& c : n.report->checks) {
      const bool versioned = c.category == "software" || c.name == "system.thp_enabled" || c.name == "system.thp_defrag";
      if (!versioned || c.status == CheckStatus::kError) continue;
      // A library missing on one node and present on another is drift too.
      const std::string value = c.status == CheckStatus::kSkip ? "(none)" : c.text;
      seen[c.name][value].push_back(n.name);
    }
  }
  std::vector<Drift> out;
  for (auto& [key, values] : seen) {
    if (values.size() < 2) continue;
    Drift d;
    d.key = key;
    d.values = values;
    std::size_t best = 0;
    for (const auto& [v, ns] : values)
      if (ns.size() > best) {  // ties: the first value in order wins, so the choice is stable
        best = ns.size();
        d.reference = v;
      }
    out.push_back(std::move(d));
  }
  return out;
}

std::vector<OutlierCheck> find_outliers(const std::vector<NodeResult>& nodes, const Profile& profile) {
  const ClusterConfig& cfg = profile.cluster;
  std::map<std::pair<std::string, std::string>, std::vector<std::pair<std::string, const CheckResult*>>> figures;
  for (const auto& n : nodes) {
    if (!n.report) continue;
    for (const auto& c : n.report->checks) {
      const CheckSpec* spec = find_check(c.name);
      if (!spec || spec->direction == Direction::kNone || !c.value || !std::isfinite(*c.value)) continue;  // failed on its node
      if (c.status == CheckStatus::kSkip || c.status == CheckStatus::kError) continue;
      figures[{c.name, c.target}].emplace_back(n.name, &c);
    }
  }
  std::vector<OutlierCheck> out;
  for (const auto& [key, list] : figures) {
    if (list.size() < std::max(1u, cfg.outlier_min_nodes)) continue;
    const CheckSpec* spec = find_check(key.first);
    OutlierCheck oc;
    oc.check = key.first;
    oc.target = key.second;
    oc.unit = spec->unit;
    std::vector<double> values;
    for (const auto& [node, c] : list) values.push_back(*c->value);
    const RobustScale scale = robust_scale(values, cfg.outlier_floor);
    oc.median = scale.median;
    oc.mad = scale.mad;
    const double sigma = scale.sigma;
    const double sign = spec->direction == Direction::kHigher ? 1.0 : -1.0;
    for (const auto& [node, c] : list) {
      OutlierEntry e;
      e.node = node;
      e.value = *c->value;
      e.ratio = oc.median != 0 ? e.value / oc.median : 1.0;
      e.z = sigma > 0 ? sign * (e.value - oc.median) / sigma : 0.0;
      if (e.z < -cfg.outlier_fail) e.status = CheckStatus::kFail;
      else if (e.z < -cfg.outlier_warn) e.status = CheckStatus::kWarn;
      oc.nodes.push_back(e);
    }
    out.push_back(std::move(oc));
  }
  return out;
}

void judge_links(std::vector<LinkResult>& links, const Profile& profile) {
  // The ring is the reference: bisection links are chosen because they may be
  // slow, and would drag the median down.
  std::vector<double> bw;
  for (const auto& l : links)
    if (l.bandwidth_gbps && l.kind != "bisect") bw.push_back(*l.bandwidth_gbps);
  if (bw.empty()) return;
  const double med = median(bw);
  for (auto& l : links) {
    if (!l.bandwidth_gbps || med <= 0) continue;
    const double ratio = *l.bandwidth_gbps / med;
    const std::string what = fmt::format("{:.0f}% of the median link ({} GB/s)", 100 * ratio, format_number(med));
    if (ratio < profile.cluster.link_fail_ratio) {
      l.status = CheckStatus::kFail;
      l.reason = what;
    } else if (ratio < profile.cluster.link_warn_ratio) {
      l.status = worse(l.status, CheckStatus::kWarn);
      l.reason = what;
    }
  }
}

std::vector<std::pair<std::string, std::string>> bisection_pairs(const std::vector<LinkResult>& ring) {
  const LinkTally t = tally(ring);
  std::set<std::pair<std::string, std::string>> tested;
  for (const auto& l : ring) tested.insert(std::minmax(l.a, l.b));
  // A node with one fast link has shown it can move data; one whose every
  // link is slow is tested against a node whose every link is fast.
  std::vector<std::string> good, doubtful;
  for (const auto& n : t.order) {
    if (t.slow.at(n) == 0) good.push_back(n);
    else if (t.fast.at(n) == 0) doubtful.push_back(n);
  }
  std::vector<std::pair<std::string, std::string>> out;
  std::size_t next = 0;
  for (const auto& d : doubtful) {
    for (std::size_t k = 0; k < good.size(); ++k) {
      const std::string& g = good[(next + k) % good.size()];
      if (tested.count(std::minmax(d, g))) continue;
      out.emplace_back(d, g);
      tested.insert(std::minmax(d, g));
      next = (next + k + 1) % good.size();
      break;
    }
  }
  return out;
}

std::vector<std::string> blame(const std::vector<LinkResult>& links) {
  const LinkTally t = tally(links);
  // A node is to blame when every link it took part in was slow, and at least
  // two were: one slow link alone cannot tell which end is at fault.
  std::vector<std::string> out;
  for (const auto& n : t.order)
    if (t.fast.at(n) == 0 && t.slow.at(n) >= 2) out.push_back(n);
  return out;
}

void judge_nodes(ClusterReport& r) {
  std::map<std::string, NodeResult*> by_name;
  for (auto& n : r.nodes) {
    by_name[n.name] = &n;
    n.status = CheckStatus::kPass;
    n.reasons.clear();
    if (!n.report) continue;
    for (const auto& c : n.report->checks) {
      if (c.status == CheckStatus::kFail || c.status == CheckStatus::kError || c.status == CheckStatus::kWarn)
        raise(n, c.status, fmt::format("{}{}: {}", c.name, c.target.empty() ? "" : " " + c.target, c.reason));
    }
    if (n.report->interrupted) raise(n, CheckStatus::kError, "interrupted");
  }
  for (auto& n : r.nodes)
    if (!n.report) raise(n, CheckStatus::kError, "no report: the node's leader did not answer within the bound");
  for (const auto& d : r.drift)
    for (const auto& [value, nodes] : d.values) {
      if (value == d.reference) continue;
      for (const auto& name : nodes)
        if (by_name.count(name))
          raise(*by_name[name], CheckStatus::kFail, fmt::format("drift: {} is '{}' here, '{}' on {} other nodes", d.key, value,
                                                                d.reference, d.values.at(d.reference).size()));
    }
  std::map<std::string, std::vector<double>> scores;
  for (const auto& oc : r.outliers)
    for (const auto& e : oc.nodes) {
      const CheckSpec* spec = find_check(oc.check);
      const double s = spec && spec->direction == Direction::kLower ? (e.value != 0 ? 1.0 / e.ratio : 0.0) : e.ratio;
      scores[e.node].push_back(s);
      if (e.status != CheckStatus::kPass && by_name.count(e.node))
        raise(*by_name[e.node], e.status, fmt::format("outlier: {}{} {} is {:.0f}% of the median {} (z {:.1f})", oc.check,
                                                      oc.target.empty() ? "" : " " + oc.target, format_number(e.value),
                                                      100 * e.ratio, format_number(oc.median), e.z));
    }
  for (const auto& s : r.suspects)
    if (by_name.count(s)) raise(*by_name[s], CheckStatus::kFail, "network: every link tested with this node was slow");
  // RDMA: a bad pair warns both ends; a port that was bad with two peers and
  // good with none is the common factor and fails its node.
  std::map<std::pair<std::string, std::string>, std::pair<int, int>> port_tally;  // (node, port) -> (bad, good)
  for (const auto& x : r.rdma) {
    if (x.status == CheckStatus::kSkip) continue;
    const bool bad = x.status == CheckStatus::kFail || x.status == CheckStatus::kError;
    for (const auto& key : {std::pair{x.a, x.device}, std::pair{x.b, x.peer_device}}) (bad ? port_tally[key].first : port_tally[key].second) += 1;
    if (!bad && x.status != CheckStatus::kWarn) continue;
    for (const auto& [node, other, port] : {std::tuple{x.a, x.b, x.device}, std::tuple{x.b, x.a, x.peer_device}})
      if (by_name.count(node))
        raise(*by_name[node], CheckStatus::kWarn, fmt::format("rdma: {} with {}: {}", port.empty() ? "-" : port, other, x.reason));
  }
  for (const auto& [key, t] : port_tally)
    if (t.first >= 2 && t.second == 0 && by_name.count(key.first))
      raise(*by_name[key.first], CheckStatus::kFail, fmt::format("rdma: {} was slow or failed with every peer tested", key.second));
  for (auto& n : r.nodes) {
    if (!n.report) {
      n.score = 0;
      continue;
    }
    const auto& v = scores[n.name];
    double sum = 0;
    for (double x : v) sum += x;
    n.score = v.empty() ? 1.0 : sum / static_cast<double>(v.size());
  }
}

Selection select_nodes(const std::vector<NodeResult>& nodes, unsigned need) {
  Selection s;
  s.need = need;
  std::vector<const NodeResult*> healthy;
  for (const auto& n : nodes)
    if (n.healthy()) healthy.push_back(&n);
  // Best first: clean before warned, then by score, then by name for a stable order.
  std::stable_sort(healthy.begin(), healthy.end(), [](const NodeResult* a, const NodeResult* b) {
    const bool ca = a->status == CheckStatus::kPass, cb = b->status == CheckStatus::kPass;
    if (ca != cb) return ca;
    if (a->score != b->score) return a->score > b->score;
    return a->name < b->name;
  });
  std::set<std::string> chosen;
  for (const auto* n : healthy) {
    if (s.chosen.size() >= need) break;
    s.chosen.push_back(n->name);
    chosen.insert(n->name);
  }
  for (const auto& n : nodes)
    if (!chosen.count(n.name)) s.excluded.push_back(n.name);
  return s;
}

}  // namespace pacer::vet
