#include "pacer/score.hpp"

#include <gtest/gtest.h>
#include <sqlite3.h>

#include <cmath>

#include <fmt/ranges.h>

#include "pacer/report.hpp"
#include "score/synthetic.hpp"
#include "test_util.hpp"

namespace pacer::score {
namespace {

using pacer::test::contains;
using pacer::test::TempDir;

const Score& find(const ScoreReport& r, const std::string& name) {
  for (const auto& s : r.scores)
    if (s.name == name) return s;
  throw std::runtime_error("no score " + name);
}

// The score of a fresh synthetic catalog of `workload`.
ScoreReport score_synthetic(const std::string& workload) {
  TempDir dir("score-");
  if (!test::write_synthetic_catalog(dir.path() + "/c.db", workload)) throw std::runtime_error("cannot write " + workload);
  return score_catalog(dir.path() + "/c.db", {}).value();
}

class Workload : public ::testing::TestWithParam<std::string> {};

TEST_P(Workload, VerdictMatchesTheWorkload) {
  TempDir dir("score-");
  const std::string db = dir.path() + "/c.db";
  ASSERT_TRUE(test::write_synthetic_catalog(db, GetParam()));
  auto r = score_catalog(db, {});
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(r->verdict.kind, test::expected_verdict(GetParam())) << r->verdict.sentence << "\n" << to_text(*r);
  const std::string lead = r->verdict.kind == "host-bound" ? "host-bound (one thread):" : r->verdict.kind + ":";
  EXPECT_EQ(r->verdict.sentence.rfind(lead, 0), 0u) << r->verdict.sentence;
  for (const auto& s : r->scores) {
    if (s.value) {
      EXPECT_GE(*s.value, 0.0) << s.name;
      EXPECT_LE(*s.value, 1.0) << s.name;
      EXPECT_FALSE(s.evidence.empty()) << s.name;
    } else {
      EXPECT_FALSE(s.why_not.empty()) << s.name;
    }
  }
  const auto j = to_json(*r);
  EXPECT_EQ(j["schema"], "pacer.score/1");
  EXPECT_EQ(j["scores"].size(), 6u);
}

INSTANTIATE_TEST_SUITE_P(Synthetic, Workload, ::testing::ValuesIn(test::synthetic_workloads()),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

TEST(Score, InputBoundNamesTheShareAndTheWorstRank) {
  TempDir dir("score-");
  ASSERT_TRUE(test::write_synthetic_catalog(dir.path() + "/c.db", "input"));
  auto r = score_catalog(dir.path() + "/c.db", {}).value();
  EXPECT_NEAR(*find(r, "input").value, 0.58 * (7 + 1.2) / 8, 0.01);
  EXPECT_TRUE(contains(r.verdict.sentence, fmt::format("GPUs idle {:.0f}% of step time while waiting for data",
                                                       100 * *find(r, "input").value)));
  EXPECT_TRUE(contains(r.verdict.sentence, "rank 5"));
  // The scores cover the steps' span, not the sampler's whole run.
  EXPECT_TRUE(r.facts.window_from_steps);
  EXPECT_NEAR(*find(r, "compute").value, 0.28, 0.03);
}

TEST(Score, WithoutASamplerOnlyTheStepsAreJudged) {
  TempDir dir("score-");
  ASSERT_TRUE(test::write_synthetic_catalog(dir.path() + "/c.db", "steps-only"));
  auto r = score_catalog(dir.path() + "/c.db", {}).value();
  for (const char* n : {"compute", "memory", "host_cpu", "io"}) EXPECT_FALSE(find(r, n).value.has_value()) << n;
  EXPECT_TRUE(find(r, "input").value.has_value());
  EXPECT_TRUE(find(r, "communication").value.has_value());
  EXPECT_EQ(r.not_judged.size(), 4u);
  // 0.5 on seven ranks, 0.6 on rank 5: 0.5125 over all.
  EXPECT_TRUE(contains(r.verdict.sentence, "ranks stall 51%"));
}

TEST(Score, WithoutGpusTheHostIsJudged) {
  TempDir dir("score-");
  ASSERT_TRUE(test::write_synthetic_catalog(dir.path() + "/c.db", "cpu"));
  auto r = score_catalog(dir.path() + "/c.db", {}).value();
  EXPECT_EQ(r.facts.gpus, 0);
  // The command computes on 95% of the CPUs; the node is 98% busy.
  EXPECT_NEAR(*find(r, "host_cpu").value, 0.98, 0.01);
  EXPECT_TRUE(contains(find(r, "compute").why_not, "no GPU samples"));
  EXPECT_TRUE(contains(r.verdict.sentence, "no GPU was recorded"));
}

TEST(Score, ANodeSaturatedByOthersSlowsACommandThatComputesButNotAnIdleOne) {
  TempDir dir("score-");
  ASSERT_TRUE(test::write_synthetic_catalog(dir.path() + "/c.db", "cpu-contended"));
  auto r = score_catalog(dir.path() + "/c.db", {}).value();
  EXPECT_NEAR(*find(r, "host_cpu").value, 1.0, 1e-9);
  EXPECT_TRUE(contains(r.verdict.sentence, "15% of them by the command's processes (other processes compete)"));
  RunFacts idle = r.facts;
  idle.process_cores = kCpuActiveCores / 2;  // the node is still saturated, by others only
  EXPECT_EQ(judge(idle).verdict.kind, "idle");
}

TEST(Score, NvlinkAgainstTheModelsCapacityAndNetworkOnlyWhenGiven) {
  TempDir dir("score-");
  ASSERT_TRUE(test::write_synthetic_catalog(dir.path() + "/c.db", "comm"));
  auto r = score_catalog(dir.path() + "/c.db", {}).value();
  EXPECT_NEAR(r.facts.nvlink_capacity_bytes_per_s, 450e9, 1);
  EXPECT_NEAR(*find(r, "communication").value, 320.0 / 450, 0.01);
  EXPECT_TRUE(contains(fmt::format("{}", fmt::join(r.not_judged, "|")), "--nic-gbps"));
  // 1 GB/s of InfiniBand plus 2 MB/s of Ethernet against 10 Gb/s (1.25 GB/s).
  ScoreOptions with_nic;
  with_nic.nic_capacity_bytes_per_s = 1.25e9;
  auto n = score_catalog(dir.path() + "/c.db", with_nic).value();
  bool found = false;
  for (const auto& e : find(n, "communication").evidence)
    if (e.what == "network utilization") {
      found = true;
      EXPECT_NEAR(e.value, 1.002e9 / 1.25e9, 0.001);
    }
  EXPECT_TRUE(found);
}

TEST(Score, RulesAtTheThresholds) {
  RunFacts f;
  f.gpus = 8;
  auto metric = [](double mean) {
    RunFacts::GpuMetric m;
    m.mean = m.min = mean;
    m.min_gpu = "n:0";
    m.gpus = 8;
    m.samples = 80;
    return m;
  };
  f.sm_util = metric(kGpuBusy);
  f.tensor_util = metric(0.3);
  f.dram_bw_util = metric(kMemoryBound);
  EXPECT_EQ(judge(f).verdict.kind, "memory-bound");
  f.tensor_util->mean = 0.6;  // a pipe busier than DRAM: compute
  EXPECT_EQ(judge(f).verdict.kind, "compute-bound");
  f.sm_util->mean = kGpuBusy - 0.01;
  EXPECT_EQ(judge(f).verdict.kind, "unsaturated");
  f.gpu_util = metric(0.95);  // few SMs active, yet a kernel runs nearly all the time
  EXPECT_EQ(judge(f).verdict.kind, "compute-bound");
  EXPECT_TRUE(contains(judge(f).verdict.sentence, "a kernel running 95%"));
  f.gpu_util.reset();
  f.steps = 10;
  f.step_time_s = f.data_wait_step_time_s = f.comm_step_time_s = 10;
  f.data_wait_s = 10 * kInputBoundShare;
  f.comm_s = 10 * kInputBoundShare - 0.1;
  EXPECT_EQ(judge(f).verdict.kind, "input-bound");
  f.comm_s = 3.0;  // more time in communication than waiting for data
  EXPECT_EQ(judge(f).verdict.kind, "communication-bound");
}

TEST(Score, OneSaturatedThreadWithIdleGpusIsHostBoundAndNamesTheThread) {
  auto r = score_synthetic("host-thread");
  ASSERT_TRUE(r.facts.busiest_thread.has_value());
  EXPECT_EQ(r.facts.busiest_thread->comm, "python3");
  EXPECT_TRUE(r.facts.busiest_thread->main);
  EXPECT_TRUE(r.facts.busiest_thread->python);
  EXPECT_EQ(r.facts.busiest_thread->intervals, 60);
  const double idle = 1 - r.facts.gpu_util->mean, thread = r.facts.busiest_thread->busy;
  EXPECT_EQ(r.verdict.sentence,
            fmt::format("host-bound (one thread): GPUs idle {:.0f}% of the time while thread `python3` (main) on gpu00{} is busy {:.0f}% "
                        "of a core: single-threaded host work (data preparation, Python overhead or kernel launches) limits the GPU",
                        100 * idle, r.facts.busiest_thread->node.back() - '0', 100 * thread));
  bool evidence = false;
  for (const auto& e : find(r, "host_cpu").evidence) evidence |= contains(e.what, "busiest thread `python3` (main)");
  EXPECT_TRUE(evidence);
  const auto j = to_json(r);
  EXPECT_EQ(j["busiest_thread"]["comm"], "python3");
  EXPECT_EQ(j["busiest_thread"]["python"], true);
}

TEST(Score, SmallKernelsFromASaturatedThreadAreLaunchBound) {
  auto r = score_synthetic("launch");
  EXPECT_TRUE(contains(r.verdict.sentence, "kernels too small to fill the GPU")) << r.verdict.sentence;
  EXPECT_TRUE(contains(r.verdict.sentence, "SMs were active only 4%")) << r.verdict.sentence;
  // The same GPUs with a thread that rests (it waits on the GPU): the old verdict.
  RunFacts f = r.facts;
  f.busiest_thread->busy = 0.4;
  EXPECT_EQ(judge(f).verdict.kind, "compute-bound");
}

TEST(Score, OneThreadWithoutGpusAndManyBusyThreads) {
  auto r = score_synthetic("cpu-thread");
  EXPECT_EQ(r.verdict.kind, "host-bound");
  EXPECT_TRUE(contains(r.verdict.sentence, "no GPU was recorded and thread `python3` (main)")) << r.verdict.sentence;
  EXPECT_TRUE(contains(r.verdict.sentence, "cores idle")) << r.verdict.sentence;
  // A node of one CPU: that thread is the whole host.
  RunFacts one = r.facts;
  one.cpus = 1;
  one.process_cores = 1;
  one.cpu_busy = 1;
  EXPECT_EQ(judge(one).verdict.kind, "host-cpu-bound");
  EXPECT_NE(score_synthetic("cpu-threads").verdict.kind, "host-bound");
}

TEST(Score, StepsWithoutAnySamplerAreUnknownNotIdle) {
  auto r = score_synthetic("steps-quiet");
  EXPECT_EQ(r.verdict.kind, "unknown");
  EXPECT_TRUE(contains(r.verdict.sentence, "no sampler data for this run, only 800 training steps")) << r.verdict.sentence;
  EXPECT_TRUE(contains(r.verdict.sentence, "pacer monitor"));
}

TEST(Score, ThreadRulesAtTheThresholds) {
  RunFacts f;
  f.gpus = 8;
  f.cpus = 64;
  f.samples = 100;
  RunFacts::GpuMetric m;
  m.mean = m.min = 0.2;
  m.gpus = 8;
  f.gpu_util = m;
  f.busiest_thread = RunFacts::Thread{"n", 10, 10, "python3", true, true, kThreadBound, 1.0, 60};
  EXPECT_EQ(judge(f).verdict.kind, "host-bound");
  f.busiest_thread->busy = kThreadBound - 0.01;
  EXPECT_EQ(judge(f).verdict.kind, "unsaturated");
  f.busiest_thread->busy = 1.0;
  f.busiest_thread->busy_threads = kOtherThreadsBusy;  // the work is spread over threads
  EXPECT_NE(judge(f).verdict.kind, "host-bound");
  f.busiest_thread->busy_threads = 1;
  f.gpu_util->mean = kGpuBusy;  // GPUs busy enough: their own verdict
  EXPECT_EQ(judge(f).verdict.kind, "compute-bound");
  // GPM: a kernel runs 40% of the time on 20% of the SMs: launch-bound at a ratio of 2.
  f.gpu_util->mean = 0.4;
  f.sm_util = m;
  f.sm_util->mean = 0.4 / kLaunchRatio;
  EXPECT_EQ(judge(f).verdict.kind, "launch-bound");
  f.sm_util->mean = 0.4 / kLaunchRatio + 0.01;
  EXPECT_EQ(judge(f).verdict.kind, "host-bound");
  f.sm_util->mean = 0.05;
  f.gpu_util->mean = kLaunchBusyUtil;  // a kernel always runs: not waiting on launches
  EXPECT_EQ(judge(f).verdict.kind, "compute-bound");
}

TEST(Score, MissingRunAndEmptyCatalogAreUsageErrors) {
  TempDir dir("score-");
  ASSERT_TRUE(test::write_synthetic_catalog(dir.path() + "/c.db", "idle"));
  ScoreOptions run99;
  run99.run_id = 99;
  auto r = score_catalog(dir.path() + "/c.db", run99);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().kind, ErrorKind::kUsage);
  EXPECT_TRUE(contains(r.error().message, dir.path() + "/c.db: no run 99 in the catalog; its runs: 1 (")) << r.error().message;
  EXPECT_FALSE(score_catalog(dir.path() + "/missing.db", {}).has_value());
}

TEST(Report, DataHoldsEveryTimelineAndThePageEmbedsIt) {
  TempDir dir("report-");
  const std::string db = dir.path() + "/c.db";
  ASSERT_TRUE(test::write_synthetic_catalog(db, "gemm"));
  auto d = report::report_data(db, {}).value();
  EXPECT_EQ(d["schema"], "pacer.report.data/1");
  EXPECT_EQ(d["series"]["gpm.sm_util"].size(), 8u);        // 2 nodes x 4 GPUs
  EXPECT_EQ(d["steps"]["step_time_s"].size(), 8u);         // 8 ranks
  EXPECT_EQ(d["heatmap"]["nodes"].size(), 2u);
  EXPECT_EQ(d["score"]["verdict"]["kind"], "compute-bound");
  int vet = 0, throttle = 0;
  for (const auto& e : d["events"]) vet += e["kind"] == "vet.result", throttle += e["kind"] == "gpu.throttle";
  EXPECT_EQ(vet, 1);
  EXPECT_EQ(throttle, 1);
  // A small bucket budget averages the 60 samples of each GPU into fewer points.
  report::ReportOptions few;
  few.max_points = 10;
  auto small = report::report_data(db, few).value();
  EXPECT_LE(small["series"]["gpm.sm_util"]["gpu001:0"]["t"].size(), 11u);
  d["run"]["command"] = "</script><script>alert(1)</script>";
  const std::string html = report::render_html(d);
  EXPECT_EQ(html.find("</script><script>alert"), std::string::npos);
  EXPECT_EQ(html.find("/*PACER_"), std::string::npos);
  EXPECT_TRUE(contains(html, "uPlot"));
}

TEST(Report, TrainingCurvesInWholeStepBucketsAndMarks) {
  TempDir dir("report-");
  const std::string db = dir.path() + "/c.db";
  ASSERT_TRUE(test::write_synthetic_catalog(db, "gemm"));
  report::ReportOptions o;
  o.max_points = 30;  // 100 steps: buckets of 4
  auto d = report::report_data(db, o).value();
  const auto& rank0 = d["training"]["ranks"]["rank 0 (gpu001)"];
  EXPECT_EQ(d["training"]["step_bucket"], 4);
  ASSERT_EQ(rank0["step"].size(), 25u);
  EXPECT_EQ(rank0["step"][1], 4);
  // The mean loss of steps 0-3 (4 exp(-step/60) + 1.5, as written).
  double mean = 0;
  for (int s = 0; s < 4; ++s) mean += (4.0 * std::exp(-s / 60.0) + 1.5) / 4;
  EXPECT_NEAR(rank0["loss"][0].get<double>(), mean, 1e-5);
  EXPECT_TRUE(d["training"]["rate"].is_null());  // no flops and no plan
  EXPECT_FALSE(rank0.contains("rate"));
  ASSERT_EQ(d["marks"].size(), 1u);  // the vet result
  EXPECT_EQ(d["marks"][0]["class"], "vet");
  // A catalog from before steps.flops: the report reads it unchanged.
  {
    sqlite3* raw = nullptr;
    ASSERT_EQ(sqlite3_open(db.c_str(), &raw), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(raw, "ALTER TABLE steps DROP COLUMN flops", nullptr, nullptr, nullptr), SQLITE_OK);
    sqlite3_close(raw);
  }
  auto old = report::report_data(db, o);
  ASSERT_TRUE(old.has_value()) << old.error().message;
  EXPECT_EQ((*old)["training"]["ranks"], d["training"]["ranks"]);
}

}  // namespace
}  // namespace pacer::score
