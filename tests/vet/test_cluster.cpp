// The cluster vet's analysis on hand-made node reports: drift, outliers, links, health and selection.
#include <gtest/gtest.h>

#include "pacer/vet/cluster.hpp"
#include "vet/outliers.hpp"

namespace pacer::vet {
namespace {

CheckResult result(const std::string& name, CheckStatus s) {
  CheckResult c;
  c.name = name;
  c.category = name.substr(0, name.find('.'));
  c.status = s;
  return c;
}

CheckResult numeric(const std::string& name, double v, CheckStatus s = CheckStatus::kPass) {
  CheckResult c = result(name, s);
  c.value = v;
  return c;
}

CheckResult text(const std::string& name, const std::string& t, CheckStatus s = CheckStatus::kPass) {
  CheckResult c = result(name, s);
  c.text = t;
  return c;
}

NodeResult node(const std::string& name, std::vector<CheckResult> checks) {
  NodeResult n;
  n.name = name;
  n.report = VetReport{};
  n.report->host = name;
  n.report->checks = std::move(checks);
  return n;
}

LinkResult link(const std::string& a, const std::string& b, double gbps, const std::string& kind = "ring") {
  LinkResult l;
  l.a = a;
  l.b = b;
  l.kind = kind;
  l.bandwidth_gbps = gbps;
  return l;
}

TEST(ClusterOutliers, FlagsOnlyTheWorseSideBeyondK) {
  Profile p;  // outlier_warn 3, outlier_fail 5, floor 5% of the median
  std::vector<NodeResult> nodes;
  const double bw[] = {100, 102, 98, 101, 80, 60, 130};
  for (int i = 0; i < 7; ++i) nodes.push_back(node("n" + std::to_string(i), {numeric("memory.bandwidth", bw[i])}));
  const auto out = find_outliers(nodes, p);
  ASSERT_EQ(out.size(), 1u);
  const OutlierCheck& o = out[0];
  EXPECT_EQ(o.median, 100);
  EXPECT_EQ(o.mad, 2);  // deviations 0 2 2 1 20 40 30
  // sigma = max(1.4826 * 2, 5) = 5: 80 is z -4 (warn), 60 is z -8 (fail), 130 is better, never flagged.
  std::map<std::string, CheckStatus> st;
  for (const auto& e : o.nodes) st[e.node] = e.status;
  EXPECT_EQ(st["n4"], CheckStatus::kWarn);
  EXPECT_EQ(st["n5"], CheckStatus::kFail);
  EXPECT_EQ(st["n6"], CheckStatus::kPass);
  EXPECT_EQ(st["n0"], CheckStatus::kPass);
  EXPECT_DOUBLE_EQ(o.nodes[5].ratio, 0.6);
  EXPECT_DOUBLE_EQ(o.nodes[5].z, -8);
}

TEST(ClusterOutliers, NeedsEnoughNodesAndADirection) {
  Profile p;
  std::vector<NodeResult> two = {node("a", {numeric("cpu.flops", 10)}), node("b", {numeric("cpu.flops", 1)})};
  EXPECT_TRUE(find_outliers(two, p).empty());
  std::vector<NodeResult> three = {node("a", {numeric("system.nofile", 10)}), node("b", {numeric("system.nofile", 10)}),
                                   node("c", {numeric("system.nofile", 1)})};
  EXPECT_TRUE(find_outliers(three, p).empty());  // no better direction: differences are not outliers
  p.cluster.outlier_min_nodes = 2;
  EXPECT_EQ(find_outliers(two, p).size(), 1u);
}

CheckResult on_gpu(const std::string& name, int gpu, double v, CheckStatus s = CheckStatus::kPass) {
  CheckResult c = numeric(name, v, s);
  c.target = "gpu" + std::to_string(gpu);
  c.unit = "TFLOP/s";
  return c;
}

TEST(GpuOutliers, FlagsTheSlowGpuOfANode) {
  Profile p;
  // Eight GPUs at ~700 TFLOP/s; gpu6 at 600 (z -2.8: within), gpu7 at 480 (z -6.3: fails).
  std::vector<CheckResult> checks;
  const double tf[] = {700, 705, 698, 702, 701, 699, 600, 480};
  for (int g = 0; g < 8; ++g) checks.push_back(on_gpu("gpu.gemm_bf16", g, tf[g]));
  checks.push_back(on_gpu("gpu.temperature", 7, 90));  // lower is better: never an outlier here
  for (int g = 0; g < 7; ++g) checks.push_back(on_gpu("gpu.temperature", g, 30));
  judge_gpu_outliers(checks, p.cluster);
  EXPECT_EQ(checks[5].status, CheckStatus::kPass);
  EXPECT_EQ(checks[6].status, CheckStatus::kPass);
  EXPECT_EQ(checks[7].status, CheckStatus::kFail);
  EXPECT_NE(checks[7].reason.find("of the median of the node's 8 GPUs"), std::string::npos) << checks[7].reason;
  EXPECT_EQ(checks[8].status, CheckStatus::kPass);
  // A warning keeps its own reason and gains the outlier's; a stricter setting warns on gpu6 too.
  checks[6].status = CheckStatus::kWarn;
  checks[6].reason = "below 680";
  p.cluster.outlier_warn = 2;
  judge_gpu_outliers(checks, p.cluster);
  EXPECT_EQ(checks[6].status, CheckStatus::kWarn);
  EXPECT_EQ(checks[6].reason.rfind("below 680; outlier:", 0), 0u) << checks[6].reason;
}

TEST(GpuOutliers, NeedsThreeGpusAndIgnoresNodeWideChecks) {
  Profile p;
  std::vector<CheckResult> two = {on_gpu("gpu.gemm_bf16", 0, 700), on_gpu("gpu.gemm_bf16", 1, 100)};
  judge_gpu_outliers(two, p.cluster);  // which of two is the bad one cannot be told
  EXPECT_EQ(two[1].status, CheckStatus::kPass);
  p.cluster.outlier_min_nodes = 2;
  judge_gpu_outliers(two, p.cluster);  // still three: the floor for GPUs
  EXPECT_EQ(two[1].status, CheckStatus::kPass);
  std::vector<CheckResult> nodewide = {numeric("gpu.nccl_busbw", 300), numeric("gpu.nccl_busbw", 300), numeric("gpu.nccl_busbw", 10)};
  judge_gpu_outliers(nodewide, p.cluster);
  EXPECT_EQ(nodewide[2].status, CheckStatus::kPass);
  std::vector<CheckResult> skipped = {on_gpu("gpu.gemm_bf16", 0, 700), on_gpu("gpu.gemm_bf16", 1, 700),
                                      on_gpu("gpu.gemm_bf16", 2, 0, CheckStatus::kSkip)};
  judge_gpu_outliers(skipped, p.cluster);
  EXPECT_EQ(skipped[2].status, CheckStatus::kSkip);
}

TEST(ClusterDrift, NamesTheNodesAndTheMajorityValue) {
  std::vector<NodeResult> nodes = {
      node("a", {text("software.kernel", "6.1"), text("system.thp_enabled", "madvise")}),
      node("b", {text("software.kernel", "6.1"), text("system.thp_enabled", "madvise")}),
      node("c", {text("software.kernel", "6.5"), text("system.thp_enabled", "madvise")}),
      node("d", {text("software.kernel", "6.1"), text("system.thp_enabled", "always", CheckStatus::kWarn)}),
  };
  const auto drift = find_drift(nodes);
  ASSERT_EQ(drift.size(), 2u);
  EXPECT_EQ(drift[0].key, "software.kernel");
  EXPECT_EQ(drift[0].reference, "6.1");
  EXPECT_EQ(drift[0].values.at("6.5"), std::vector<std::string>{"c"});
  EXPECT_EQ(drift[1].key, "system.thp_enabled");
  EXPECT_EQ(drift[1].values.at("always"), std::vector<std::string>{"d"});

  ClusterReport r;
  r.nodes = nodes;
  r.drift = drift;
  judge_nodes(r);
  EXPECT_EQ(r.nodes[2].status, CheckStatus::kFail);
  EXPECT_NE(r.nodes[2].reasons[0].find("drift: software.kernel is '6.5'"), std::string::npos);
  EXPECT_EQ(r.nodes[0].status, CheckStatus::kPass);
}

TEST(ClusterLinks, BisectionIsolatesTheNodeWhoseEveryLinkIsSlow) {
  Profile p;
  std::vector<LinkResult> ring = {link("a", "b", 10), link("b", "c", 1), link("c", "d", 1.2), link("d", "a", 11)};
  judge_links(ring, p);  // median 5.6: the two links of c are below half of it
  EXPECT_EQ(ring[1].status, CheckStatus::kFail);
  EXPECT_EQ(ring[0].status, CheckStatus::kPass);
  // b and d each have a fast link; c has none and is tested against a node whose links are all fast.
  const auto pairs = bisection_pairs(ring);
  ASSERT_EQ(pairs.size(), 1u);
  EXPECT_EQ(pairs[0], std::make_pair(std::string("c"), std::string("a")));
  ring.push_back(link("c", "a", 0.9, "bisect"));
  judge_links(ring, p);
  EXPECT_EQ(ring.back().status, CheckStatus::kFail);  // against the ring's median, not one dragged down by bisection links
  EXPECT_EQ(blame(ring), std::vector<std::string>{"c"});
  // A slow cable between two good nodes blames neither.
  std::vector<LinkResult> cable = {link("a", "b", 10), link("b", "c", 1), link("c", "d", 10), link("d", "a", 11)};
  judge_links(cable, p);
  EXPECT_TRUE(bisection_pairs(cable).empty());
  EXPECT_TRUE(blame(cable).empty());
}

TEST(ClusterSelection, PicksTheBestHealthyNodesAndExcludesTheRest) {
  std::vector<NodeResult> nodes = {node("a", {}), node("b", {}), node("c", {}), node("d", {})};
  nodes[0].score = 0.9;
  nodes[1].score = 1.1;
  nodes[2].status = CheckStatus::kFail;
  nodes[3].status = CheckStatus::kWarn;
  nodes[3].score = 1.5;
  Selection s = select_nodes(nodes, 2);
  EXPECT_EQ(s.chosen, (std::vector<std::string>{"b", "a"}));  // clean nodes before warned ones, then by score
  EXPECT_EQ(s.excluded, (std::vector<std::string>{"c", "d"}));
  EXPECT_TRUE(s.enough());
  s = select_nodes(nodes, 4);
  EXPECT_FALSE(s.enough());
  EXPECT_EQ(s.chosen, (std::vector<std::string>{"b", "a", "d"}));

  ClusterReport r;
  r.nodes = nodes;
  r.selection = s;
  EXPECT_EQ(exit_code(r), kExitTooFewNodes);
  r.selection = select_nodes(nodes, 3);
  EXPECT_EQ(exit_code(r), 0);
  r.selection.reset();
  EXPECT_EQ(exit_code(r), 1);  // without --need every node must be healthy
}

TEST(ClusterInjection, ParsesNodeTargetsAndTextValues) {
  auto i = parse_injection("node2:memory.bandwidth=1.5");
  ASSERT_TRUE(i);
  EXPECT_EQ(i->node, "node2");
  EXPECT_EQ(i->check, "memory.bandwidth");
  EXPECT_EQ(i->value, 1.5);
  EXPECT_TRUE(i->applies_to("node2"));
  EXPECT_FALSE(i->applies_to("node1"));
  i = parse_injection("software.kernel=6.99.0-test");
  ASSERT_TRUE(i);
  EXPECT_EQ(i->text, "6.99.0-test");
  EXPECT_TRUE(i->applies_to("anything"));
  i = parse_injection("n1:cluster.report=hang");
  ASSERT_TRUE(i);
  EXPECT_EQ(i->action, Injection::Action::kHang);
  EXPECT_FALSE(parse_injection(":cpu.flops=1"));
  EXPECT_FALSE(parse_injection("node2:cpu.flops=fast"));
  EXPECT_FALSE(parse_injection("node2:no.such=1"));
}

TEST(ClusterProfile, ReadsTheClusterTable) {
  auto p = parse_profile("[cluster]\noutlier_warn = 2.5\noutlier_fail = 4\nlink_fail_ratio = 0.3\n", "site.toml");
  ASSERT_TRUE(p) << p.error().message;
  EXPECT_EQ(p->cluster.outlier_warn, 2.5);
  EXPECT_EQ(p->cluster.outlier_fail, 4);
  EXPECT_EQ(p->cluster.link_fail_ratio, 0.3);
  EXPECT_EQ(p->cluster.outlier_floor, 0.05);
  auto bad = parse_profile("[cluster]\noutlier_wrn = 2\n", "site.toml");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find("site.toml:2:15: unknown key 'outlier_wrn' in [cluster]"), std::string::npos);
  EXPECT_FALSE(parse_profile("[cluster]\nlink_warn_ratio = 1.5\n", "site.toml"));
}

}  // namespace
}  // namespace pacer::vet
