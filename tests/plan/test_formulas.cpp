// pacer plan: formulas against hand-computed cases, and bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "pacer/checkpoint.hpp"
#include "pacer/plan.hpp"
#include "test_util.hpp"

namespace pacer::plan {
namespace {

using test::contains;

TEST(PlanAmdahl, SpeedupAndLimits) {
  auto r = amdahl(0.05, std::nullopt, 16);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_NEAR(r->speedup, 1 / (0.05 + 0.95 / 16), 1e-12);  // 9.1429
  EXPECT_NEAR(r->efficiency, r->speedup / 16, 1e-12);
  EXPECT_NEAR(r->max_speedup, 20, 1e-12);
  EXPECT_NEAR(r->n_for_half_efficiency, 21, 1e-12);
  EXPECT_NEAR(amdahl_speedup(r->serial_fraction, r->n_for_half_efficiency) / 21, 0.5, 1e-12);
}

TEST(PlanAmdahl, KarpFlattFromMeasuredSpeedup) {
  // Speedup 8 on 16 workers: (1/8 - 1/16) / (1 - 1/16) = 1/15.
  auto r = amdahl(std::nullopt, 8.0, 16);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_NEAR(r->serial_fraction, 1.0 / 15, 1e-12);
  EXPECT_NEAR(r->speedup, 8, 1e-9);  // the fraction reproduces the measurement
  EXPECT_TRUE(std::isinf(amdahl(0.0, std::nullopt, 8)->max_speedup));
}

TEST(PlanAmdahl, BadInput) {
  EXPECT_TRUE(contains(amdahl(0.1, 2.0, 4).error().message, "either"));
  EXPECT_TRUE(contains(amdahl(std::nullopt, std::nullopt, 4).error().message, "either"));
  EXPECT_TRUE(contains(amdahl(1.5, std::nullopt, 4).error().message, "--serial-fraction"));
  EXPECT_TRUE(contains(amdahl(std::nullopt, 9.0, 8).error().message, "superlinear"));
  EXPECT_TRUE(contains(amdahl(std::nullopt, -1.0, 8).error().message, "--speedup"));
  EXPECT_TRUE(contains(amdahl(0.1, std::nullopt, 0).error().message, "--gpus"));
  EXPECT_EQ(amdahl(0.1, std::nullopt, 0).error().kind, ErrorKind::kUsage);
}

TEST(PlanCsv, HeaderCommentsAndLineNumbers) {
  auto t = parse_csv("# measured on node017\r\ngpus, Throughput\r\n\r\n8, 100\r\n16,190\n", "x.csv");
  ASSERT_TRUE(t) << t.error().message;
  EXPECT_EQ(t->header, (std::vector<std::string>{"gpus", "throughput"}));
  ASSERT_EQ(t->rows.size(), 2u);
  EXPECT_EQ(t->rows[0].line, 4);
  EXPECT_EQ(t->rows[1].line, 5);
  EXPECT_DOUBLE_EQ(*t->number(t->rows[1], 1), 190);
}

TEST(PlanCsv, MalformedNamesFileAndLine) {
  auto t = parse_csv("gpus,throughput\n8,100\n16\n", "pts.csv");
  ASSERT_FALSE(t);
  EXPECT_TRUE(contains(t.error().message, "pts.csv:3:")) << t.error().message;
  EXPECT_EQ(t.error().kind, ErrorKind::kConfig);
  auto u = parse_csv("gpus,throughput\n8,fast\n", "pts.csv");
  ASSERT_TRUE(u);
  auto n = u->number(u->rows[0], 1);
  ASSERT_FALSE(n);
  EXPECT_TRUE(contains(n.error().message, "pts.csv:2: column 'throughput': 'fast'")) << n.error().message;
  EXPECT_FALSE(parse_csv("# only a comment\n", "e.csv"));
  EXPECT_TRUE(contains(parse_csv("gpus\n", "e.csv").error().message, "no data rows"));
  EXPECT_TRUE(contains(parse_csv("a,\"b\"\n1,2\n", "q.csv").error().message, "q.csv:1:"));
  EXPECT_TRUE(contains(read_csv("/nonexistent/x.csv").error().message, "/nonexistent/x.csv"));
}

std::vector<ScalingPoint> amdahl_points(double f, std::vector<double> gpus, double base_throughput) {
  std::vector<ScalingPoint> pts;
  for (double n : gpus) {
    ScalingPoint p;
    p.gpus = n;
    p.throughput = base_throughput * amdahl_speedup(f, n / gpus.front());
    pts.push_back(p);
  }
  return pts;
}

TEST(PlanScaling, RecoversTheSerialFractionOfExactData) {
  auto r = analyse_scaling(amdahl_points(0.02, {8, 16, 32, 64}, 1000), ScalingMode::kStrong, {128, 1024});
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_NEAR(r->serial_fraction, 0.02, 1e-12);
  EXPECT_NEAR(r->serial_fraction_stderr, 0, 1e-9);
  EXPECT_NEAR(r->points[1].efficiency, amdahl_speedup(0.02, 2) / 2, 1e-12);
  EXPECT_NEAR(r->points[3].karp_flatt, 0.02, 1e-12);
  ASSERT_EQ(r->predictions.size(), 2u);
  EXPECT_NEAR(r->predictions[0].efficiency, amdahl_speedup(0.02, 16) / 16, 1e-12);
  EXPECT_FALSE(r->predictions[0].extrapolated_far);   // 2x the largest count
  EXPECT_TRUE(r->predictions[1].extrapolated_far);    // 16x
  bool warned = false;
  for (const auto& w : r->warnings) warned |= contains(w, "1024 GPUs");
  EXPECT_TRUE(warned);
}

TEST(PlanScaling, NoisyDataGivesAnUncertaintyThatBracketsThePrediction) {
  auto pts = amdahl_points(0.03, {1, 2, 4, 8, 16}, 10);
  pts[2].throughput *= 1.02;
  pts[4].throughput *= 0.97;
  auto r = analyse_scaling(pts, ScalingMode::kStrong, {64});
  ASSERT_TRUE(r);
  EXPECT_GT(r->serial_fraction_stderr, 0);
  EXPECT_LT(r->predictions[0].efficiency_low, r->predictions[0].efficiency);
  EXPECT_GT(r->predictions[0].efficiency_high, r->predictions[0].efficiency);
}

TEST(PlanScaling, WeakScalingByStepTime) {
  // Gustafson with f = 0.1: efficiency at k is 1 - 0.1 (1 - 1/k); step time grows as 1 / efficiency.
  std::vector<ScalingPoint> pts;
  for (double n : {4.0, 8.0, 16.0}) {
    ScalingPoint p;
    p.gpus = n;
    p.step_time_s = 2.0 / (1 - 0.1 * (1 - 4 / n));
    pts.push_back(p);
  }
  auto r = analyse_scaling(pts, ScalingMode::kWeak, {});
  ASSERT_TRUE(r);
  EXPECT_NEAR(r->serial_fraction, 0.1, 1e-12);
  EXPECT_NEAR(r->points[2].efficiency, 1 - 0.1 * 0.75, 1e-12);
  EXPECT_EQ(r->predictions.size(), 3u);  // 2x, 4x, 8x the largest by default
  EXPECT_DOUBLE_EQ(r->predictions[0].gpus, 32);
}

TEST(PlanScaling, TwoPointsHaveNoUncertainty) {
  auto r = analyse_scaling(amdahl_points(0.05, {8, 16}, 1), ScalingMode::kStrong, {});
  ASSERT_TRUE(r);
  EXPECT_TRUE(std::isnan(r->serial_fraction_stderr));
  EXPECT_TRUE(std::isnan(r->predictions[0].efficiency_low));
  EXPECT_FALSE(analyse_scaling(amdahl_points(0.05, {8}, 1), ScalingMode::kStrong, {}));
  EXPECT_FALSE(analyse_scaling(amdahl_points(0.05, {8, 16}, 1), ScalingMode::kStrong, {-4}));
}

TEST(PlanScaling, CsvErrorsNameTheLine) {
  test::TempDir dir("plan-scaling");
  auto bad_gpus = read_scaling_csv(dir.file("a.csv", "gpus,throughput\n8,100\n12.5,150\n"));
  EXPECT_TRUE(contains(bad_gpus.error().message, "a.csv:3: column 'gpus'")) << bad_gpus.error().message;
  auto zero = read_scaling_csv(dir.file("b.csv", "gpus,step_time_s\n8,1.0\n16,0\n"));
  EXPECT_TRUE(contains(zero.error().message, "b.csv:3: column 'step_time_s'")) << zero.error().message;
  EXPECT_TRUE(contains(read_scaling_csv(dir.file("c.csv", "nodes,throughput\n1,2\n")).error().message, "'gpus'"));
  EXPECT_TRUE(contains(read_scaling_csv(dir.file("d.csv", "gpus,throughput,step_time_s\n1,2,3\n")).error().message,
                       "exactly one"));
  auto ok = read_scaling_csv(dir.file("e.csv", "gpus,step_time_s\n8,1.0\n16,0.55\n"));
  ASSERT_TRUE(ok) << ok.error().message;
  EXPECT_DOUBLE_EQ((*ok)[1].step_time_s, 0.55);
}

TEST(PlanCkpt, YoungDalyAndTheOddsOfFailure) {
  CkptInput in;
  in.save_cost_s = 60;
  in.restart_cost_s = 600;
  in.mtbf_s = job_mtbf_s(1000 * 86400.0, 1000);  // nodes failing once in 1000 days: the job once a day
  EXPECT_DOUBLE_EQ(in.mtbf_s, 86400);
  in.campaign_s = 30 * 86400.0;
  in.current_interval_s = 3 * 3600.0;
  auto r = plan_ckpt(in);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_NEAR(r->young_interval_s, std::sqrt(2 * 60 * 86400.0), 1e-9);  // 3220 s
  EXPECT_DOUBLE_EQ(r->daly_interval_s, ckpt::optimal_interval(60, 86400));
  const double t = r->daly_interval_s;
  EXPECT_NEAR(r->lost_fraction, 60 / t + (t / 2 + 600) / 86400, 1e-12);
  EXPECT_NEAR(r->lost_fraction_current, 60 / 10800.0 + (5400 + 600) / 86400.0, 1e-12);
  EXPECT_GT(r->lost_fraction_current, r->lost_fraction);
  EXPECT_NEAR(r->expected_failures, 30, 1e-12);
  EXPECT_NEAR(r->p_any_failure, 1 - std::exp(-30.0), 1e-12);
}

TEST(PlanCkpt, BadInput) {
  CkptInput in;
  in.save_cost_s = 0;
  in.mtbf_s = 3600;
  EXPECT_TRUE(contains(plan_ckpt(in).error().message, "--save-cost"));
  in.save_cost_s = 10;
  in.mtbf_s = -1;
  EXPECT_TRUE(contains(plan_ckpt(in).error().message, "--mtbf"));
  in.mtbf_s = 3600;
  in.restart_cost_s = -5;
  EXPECT_TRUE(contains(plan_ckpt(in).error().message, "--restart-cost"));
}

std::string vet_report(const std::string& checks) {
  return R"({"schema": "pacer.vet/1", "host": "n1", "checks": [)" + checks + "]}";
}

TEST(PlanCalibration, TakesFiguresByCheckNameAndTheSlowestTarget) {
  test::TempDir dir("plan-vet");
  const std::string path = dir.file("vet.json", vet_report(R"(
    {"name": "gpu.gemm_bf16", "target": "gpu0", "value": 700.5, "unit": "TFLOP/s", "status": "pass"},
    {"name": "gpu.gemm_bf16", "target": "gpu1", "value": 650, "unit": "TFLOP/s", "status": "pass"},
    {"name": "gpu.hbm_bandwidth", "target": "gpu0", "value": null, "unit": "GB/s", "status": "skip"},
    {"name": "memory.bandwidth", "target": "", "value": 95.1, "unit": "GB/s", "status": "pass"},
    {"name": "storage.write", "target": "/tmp", "value": 1500, "unit": "MB/s", "status": "pass"},
    {"name": "storage.write", "target": "/scratch", "value": 900, "unit": "MB/s", "status": "error"},
    {"name": "system.thp_enabled", "target": "", "value": "madvise", "unit": "", "status": "pass"})"));
  auto c = read_vet_report(path);
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_DOUBLE_EQ(*figure(*c, "gpu.gemm_bf16"), 650);
  EXPECT_FALSE(figure(*c, "gpu.hbm_bandwidth"));
  EXPECT_DOUBLE_EQ(*figure(*c, "memory.bandwidth"), 95.1);
  EXPECT_DOUBLE_EQ(*figure(*c, "storage.write"), 1500);  // the errored target is not a measurement
}

TEST(PlanCalibration, RefusesOtherSchemasAndUnits) {
  test::TempDir dir("plan-vet");
  EXPECT_TRUE(contains(read_vet_report(dir.file("a.json", R"({"schema": "pacer.ckpt.ls/1"})")).error().message, "schema"));
  EXPECT_TRUE(contains(read_vet_report(dir.file("b.json", "{not json")).error().message, "b.json"));
  auto unit = read_vet_report(dir.file("c.json", vet_report(R"({"name": "gpu.gemm_bf16", "value": 7e14, "unit": "FLOP/s", "status": "pass"})")));
  EXPECT_TRUE(contains(unit.error().message, "gpu.gemm_bf16")) << unit.error().message;
  EXPECT_EQ(unit.error().kind, ErrorKind::kConfig);
}

}  // namespace
}  // namespace pacer::plan
