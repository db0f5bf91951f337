// pacer plan pipeline: the exact partitioner against brute force, schedules against hand-computed cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>

#include "pacer/plan.hpp"
#include "test_util.hpp"

namespace pacer::plan {
namespace {

using test::contains;

double largest_group(const std::vector<double>& t, const std::vector<int>& starts) {
  double worst = 0;
  for (std::size_t g = 0; g < starts.size(); ++g) {
    const int end = g + 1 < starts.size() ? starts[g + 1] : static_cast<int>(t.size());
    double sum = 0;
    for (int i = starts[g]; i < end; ++i) sum += t[i];
    worst = std::max(worst, sum);
  }
  return worst;
}

// Every way of cutting n layers into `parts` non-empty contiguous groups.
double brute_force(const std::vector<double>& t, int parts) {
  double best = 1e300;
  std::vector<int> starts = {0};
  std::function<void(int)> rec = [&](int from) {
    if (static_cast<int>(starts.size()) == parts) {
      best = std::min(best, largest_group(t, starts));
      return;
    }
    const int remaining = parts - static_cast<int>(starts.size());
    for (int s = from + 1; s <= static_cast<int>(t.size()) - remaining; ++s) {
      starts.push_back(s);
      rec(s);
      starts.pop_back();
    }
  };
  rec(0);
  return best;
}

TEST(PlanPartition, MatchesBruteForceOnSmallCases) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> time(0.1, 10);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + trial % 10;
    const int parts = 1 + (trial / 10) % std::min(n, 5);
    std::vector<double> t(n);
    for (auto& x : t) x = time(rng);
    if (trial % 7 == 0) t.back() *= 8;  // one heavy layer (a loss head)
    const auto starts = partition_min_max(t, parts);
    ASSERT_EQ(static_cast<int>(starts.size()), parts);
    EXPECT_EQ(starts[0], 0);
    for (int g = 1; g < parts; ++g) EXPECT_LT(starts[g - 1], starts[g]) << "empty group";
    EXPECT_NEAR(largest_group(t, starts), brute_force(t, parts), 1e-9) << "n=" << n << " parts=" << parts;
  }
}

std::vector<Layer> layers_of(std::vector<double> ms, std::vector<double> mb = {}) {
  std::vector<Layer> v;
  for (std::size_t i = 0; i < ms.size(); ++i)
    v.push_back({"l" + std::to_string(i), ms[i] / 1e3, mb.empty() ? 0 : mb[i] * 1e6, static_cast<int>(i) + 2});
  return v;
}

TEST(PlanPipeline, UniformLayersGiveTheTextbookBubble) {
  // 8 equal layers of 1 ms on 4 stages, 1F1B with 8 micro-batches: step (M + P - 1) t = 11 x 2 ms.
  auto r = plan_pipeline(layers_of(std::vector<double>(8, 1.0)), 4, 8, Schedule::k1f1b, 1);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_NEAR(r->optimal.step_time_s, 22e-3, 1e-12);
  EXPECT_NEAR(r->optimal.bubble_fraction, 3.0 / 11, 1e-12);  // (P-1) / (M+P-1)
  EXPECT_NEAR(r->gain, 0, 1e-12);
}

TEST(PlanPipeline, BalancesByTimeNotByCount) {
  // An embedding-heavy first layer and a loss-heavy last one, the usual shape.
  const std::vector<double> ms = {6, 2, 2, 2, 2, 2, 2, 7};
  auto r = plan_pipeline(layers_of(ms, {10, 10, 10, 10, 10, 10, 10, 10}), 4, 16, Schedule::k1f1b, 1);
  ASSERT_TRUE(r) << r.error().message;
  // By count: {6,2} {2,2} {2,2} {2,7} -> slowest 9 ms. The only partition with 7 ms: {6} {2,2,2} {2,2,2} {7}.
  EXPECT_NEAR(r->by_count.max_stage_time_s, 9e-3, 1e-12);
  EXPECT_NEAR(r->optimal.max_stage_time_s, 7e-3, 1e-12);
  EXPECT_EQ(r->optimal.stages[1].first_layer, 1);
  EXPECT_EQ(r->optimal.stages[1].layer_count, 3);
  // Step: every stage once (25 ms), then 15 more micro-batches at the slowest stage's pace.
  EXPECT_NEAR(r->optimal.step_time_s, 25e-3 + 15 * 7e-3, 1e-12);
  EXPECT_NEAR(r->by_count.step_time_s, 25e-3 + 15 * 9e-3, 1e-12);
  EXPECT_NEAR(r->gain, 160.0 / 130 - 1, 1e-12);
  // 1F1B memory: stage i holds P - i micro-batches; stage 1 has 3 layers of 10 MB.
  EXPECT_TRUE(r->has_memory);
  EXPECT_DOUBLE_EQ(r->optimal.stages[0].in_flight, 4);
  EXPECT_DOUBLE_EQ(r->optimal.stages[1].in_flight, 3);
  EXPECT_NEAR(r->optimal.stages[1].memory_bytes, 3 * 3 * 10e6, 1e-3);
  EXPECT_DOUBLE_EQ(r->optimal.stages[3].in_flight, 1);
}

TEST(PlanPipeline, GpipeHoldsEveryMicroBatch) {
  auto r = plan_pipeline(layers_of({1, 1, 1, 1}, {5, 5, 5, 5}), 2, 6, Schedule::kGpipe, 1);
  ASSERT_TRUE(r);
  EXPECT_DOUBLE_EQ(r->optimal.stages[1].in_flight, 6);
  EXPECT_NEAR(r->optimal.stages[0].memory_bytes, 6 * 2 * 5e6, 1e-3);
}

TEST(PlanPipeline, InterleavingShrinksTheBubble) {
  const std::vector<double> ms(16, 1.0);
  auto plain = plan_pipeline(layers_of(ms), 4, 8, Schedule::k1f1b, 1);
  auto inter = plan_pipeline(layers_of(ms), 4, 8, Schedule::kInterleaved, 2);
  ASSERT_TRUE(plain && inter) << inter.error().message;
  // Chunks of 2 layers, round robin: device 0 has layers 0-1 and 8-9.
  ASSERT_EQ(inter->optimal.chunk_bounds[0], (std::vector<int>{0, 8}));
  EXPECT_NEAR(inter->optimal.max_stage_time_s, 4e-3, 1e-12);
  // M t + (P - 1) t / V = 8 x 4 + 3 x 2 = 38 ms against 8 x 4 + 3 x 4 = 44 ms.
  EXPECT_NEAR(inter->optimal.step_time_s, 38e-3, 1e-12);
  EXPECT_NEAR(plain->optimal.step_time_s, 44e-3, 1e-12);
  // Megatron's warm-up: the first device holds P + (P - 1) / V micro-batches' worth.
  EXPECT_DOUBLE_EQ(inter->optimal.stages[0].in_flight, 4 + 3.0 / 2);
}

TEST(PlanPipeline, ImpossibleConfigurations) {
  auto l = layers_of({1, 1, 1});
  EXPECT_TRUE(contains(plan_pipeline(l, 4, 8, Schedule::k1f1b, 1).error().message, "at least 4 layers"));
  EXPECT_TRUE(contains(plan_pipeline(l, 2, 2, Schedule::kInterleaved, 2).error().message, "at least 4 layers"));
  EXPECT_TRUE(contains(plan_pipeline(l, 0, 8, Schedule::k1f1b, 1).error().message, "--stages"));
  EXPECT_TRUE(contains(plan_pipeline(l, 2, 0, Schedule::k1f1b, 1).error().message, "--microbatches"));
  EXPECT_TRUE(contains(plan_pipeline(l, 2, 4, Schedule::k1f1b, 2).error().message, "--chunks"));
  EXPECT_EQ(plan_pipeline(l, 4, 8, Schedule::k1f1b, 1).error().kind, ErrorKind::kUsage);
}

TEST(PlanPipeline, LayerCsv) {
  test::TempDir dir("plan-layers");
  auto ok = read_layers_csv(dir.file("a.csv", "layer,time_ms,memory_mb\nembed,3.5,100\nblock0,2,50\n"));
  ASSERT_TRUE(ok) << ok.error().message;
  EXPECT_EQ((*ok)[0].name, "embed");
  EXPECT_DOUBLE_EQ((*ok)[0].time_s, 3.5e-3);
  EXPECT_DOUBLE_EQ((*ok)[1].memory_bytes, 50e6);
  auto neg = read_layers_csv(dir.file("b.csv", "layer,time_ms\nembed,3.5\nblock0,-2\n"));
  EXPECT_TRUE(contains(neg.error().message, "b.csv:3: column 'time_ms'")) << neg.error().message;
  auto nan = read_layers_csv(dir.file("c.csv", "time_ms,memory_mb\n1,x\n"));
  EXPECT_TRUE(contains(nan.error().message, "c.csv:2: column 'memory_mb'")) << nan.error().message;
  EXPECT_TRUE(contains(read_layers_csv(dir.file("d.csv", "layer,ms\na,1\n")).error().message, "'time_ms'"));
}

}  // namespace
}  // namespace pacer::plan
