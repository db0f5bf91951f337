#include "pacer/goodput.hpp"

#include <gtest/gtest.h>

#include "pacer/core/stats.hpp"
#include "pacer/telemetry/catalog.hpp"
#include "test_util.hpp"

namespace pacer::goodput {
namespace {

using pacer::test::TempDir;
using telemetry::Catalog;
using telemetry::EventRecord;
using telemetry::StepRecord;

telemetry::StepRecord step(int rank, std::int64_t n, double end, double time) {
  StepRecord s;
  s.rank = rank;
  s.node = rank == 0 ? "node-a" : "node-b";
  s.step = n;
  s.t = end;
  s.step_time_s = time;
  s.data_wait_s = 0.25;
  s.comm_s = 0.25;
  return s;
}

// A run of 20 s with every kind of time in it, at hand-picked times (see the
// comments), so that each bucket has one exact value.
std::string write_run(const std::string& path, bool with_end = true) {
  auto cat = Catalog::open(path).value();
  const std::int64_t run = cat->begin_run({"", "train", "node-a", 1000, 0}).value();
  const std::int64_t node = cat->node_id({"node-a", 1, 0, ""}).value();
  const std::int64_t node_b = cat->node_id({"node-b", 1, 0, ""}).value();
  std::vector<StepRecord> steps = {
      // Attempt 0: the first step starts at 1002 (2 s of start-up). Each step is
      // 1 s: 0.25 data wait, 0.25 comm, 0.4 planned, 0.1 beyond the plan.
      step(0, 0, 1003, 1), step(0, 1, 1004, 1),
      // Step 1 was saved: step 2 starts 0.5 s after step 1's end.
      step(0, 2, 1005.5, 1), step(0, 3, 1006.5, 1),
      // Attempt 1 resumes from step 1: steps 2 and 3 again, then 4, where rank 1
      // (on node-b) takes 0.5 s longer than rank 0.
      step(0, 2, 1011, 1), step(0, 3, 1012, 1), step(0, 4, 1013, 1), step(1, 4, 1013.5, 1.5)};
  EXPECT_TRUE(cat->write_steps(run, steps));
  auto event = [&](double t, const char* kind, const char* detail, std::int64_t on = -1) {
    EventRecord e;
    e.t = t;
    e.kind = kind;
    e.detail = detail;
    EXPECT_TRUE(cat->write_event(run, on < 0 ? node : on, e));
  };
  event(1001, "run.started", "attempt 0 (pid 1), resuming from none");
  event(1004.4, "checkpoint.saved", R"({"step": 1, "save_s": 0.5})");
  // The attempt dies 1 s after its last step; the next one starts its first step at 1010.
  event(1007.5, "run.exited", "CMD exited with status 137 (attempt 0); latest committed: step 1");
  event(1009, "run.started", "attempt 1 (pid 2), resuming from step 1");
  event(1000.5, "vet.gpu", "gemm 30% below the fleet median", node_b);
  // 6.5 s idle after the last step.
  if (with_end) EXPECT_TRUE(cat->end_run(run, 1020, 0, 0));
  return path;
}

double seconds(const Ledger& l, const std::string& name) {
  const Bucket* b = l.bucket(name);
  if (!b) throw std::runtime_error("no bucket " + name);
  return b->seconds;
}

TEST(Goodput, EveryBucketHasItsExactTime) {
  TempDir dir("goodput-");
  const std::string db = write_run(dir.path() + "/c.db");
  Options o;
  o.planned_step_s = 0.4;
  auto l = ledger_of(db, o);
  ASSERT_TRUE(l.has_value()) << l.error().message;
  EXPECT_DOUBLE_EQ(l->whole_s(), 20);
  EXPECT_EQ(l->attempts, 2);
  EXPECT_EQ(l->steps, 7);  // 0..3, then 2..4
  EXPECT_EQ(l->ranks, 2);
  EXPECT_EQ(l->gpus, 2);
  EXPECT_EQ(l->gpus_from, "ranks (no GPU samples)");
  EXPECT_NEAR(seconds(*l, "startup"), 2, 1e-9);
  EXPECT_NEAR(seconds(*l, "productive"), 5 * 0.4, 1e-9);
  EXPECT_NEAR(seconds(*l, "input_wait"), 5 * 0.25, 1e-9);
  EXPECT_NEAR(seconds(*l, "exposed_comm"), 5 * 0.25, 1e-9);
  EXPECT_NEAR(seconds(*l, "other"), 5 * 0.1, 1e-9);
  EXPECT_NEAR(seconds(*l, "stragglers"), 0.5, 1e-9);
  EXPECT_NEAR(seconds(*l, "checkpoint_stall"), 0.5, 1e-9);
  EXPECT_NEAR(seconds(*l, "restart_lost_work"), 1 + 2, 1e-9);  // in flight until the exit, then steps 2 and 3 again
  EXPECT_NEAR(seconds(*l, "restart_gap"), 2.5, 1e-9);
  EXPECT_NEAR(seconds(*l, "idle_end"), 6.5, 1e-9);
  EXPECT_NEAR(l->sum_s(), 20, 1e-9);
  EXPECT_TRUE(balanced(*l));
  EXPECT_EQ(l->checkpoint.redone_steps, 2);
  EXPECT_EQ(l->checkpoint.checkpoints, 1);
  EXPECT_NEAR(l->checkpoint.save_cost_s, 0.5, 1e-9);
  EXPECT_EQ(l->checkpoint.failures, 1);
  EXPECT_NEAR(l->checkpoint.mtbf_s, 20, 1e-9);
  EXPECT_DOUBLE_EQ(l->checkpoint.optimal_interval_s, optimal_interval(0.5, 20));
  ASSERT_TRUE(l->straggler.has_value());
  EXPECT_EQ(l->straggler->rank, 1);
  EXPECT_EQ(l->straggler->node, "node-b");
  ASSERT_EQ(l->straggler->vet_findings.size(), 1u);
  EXPECT_EQ(l->straggler->vet_findings[0], "vet.gpu: gemm 30% below the fleet median");
  EXPECT_EQ(l->recovery.bucket, "idle_end");
  EXPECT_NEAR(l->recovery.share, 6.5 / 20, 1e-9);
  const auto j = to_json(*l);
  EXPECT_EQ(j["schema"], "pacer.goodput/1");
  EXPECT_EQ(j["buckets"].size(), 10u);
  EXPECT_NEAR(j["goodput"].get<double>(), 0.1, 1e-9);
  const std::string text = to_text(*l);
  const std::string last = text.substr(text.find_last_of('\n', text.size() - 2) + 1);
  EXPECT_EQ(last.rfind("OK: largest loss idle_end (32.5%)", 0), 0u) << text;
}

TEST(Goodput, WithoutAPlanTheFastestComputeIsTheRate) {
  TempDir dir("goodput-");
  auto l = ledger_of(write_run(dir.path() + "/c.db"), {});
  ASSERT_TRUE(l.has_value()) << l.error().message;
  // Every step's compute (step time less wait and comm) is 0.5 s.
  EXPECT_NEAR(l->planned_step_s, 0.5, 1e-9);
  EXPECT_NEAR(seconds(*l, "productive"), 5 * 0.5, 1e-9);
  EXPECT_NEAR(seconds(*l, "other"), 0, 1e-9);
  EXPECT_NE(l->planned_from.find("10th percentile"), std::string::npos);
}

TEST(Goodput, ARunWithoutAnEndEndsAtItsLastRecord) {
  TempDir dir("goodput-");
  auto l = ledger_of(write_run(dir.path() + "/c.db", false), {});
  ASSERT_TRUE(l.has_value()) << l.error().message;
  EXPECT_TRUE(l->ended_from_data);
  EXPECT_DOUBLE_EQ(l->ended, 1013.5);
  EXPECT_NEAR(seconds(*l, "idle_end"), 0, 1e-9);
  EXPECT_TRUE(balanced(*l));
}

TEST(Goodput, BadInputIsAUsageError) {
  TempDir dir("goodput-");
  auto missing = ledger_of(dir.path() + "/none.db", {});
  ASSERT_FALSE(missing.has_value());
  EXPECT_EQ(missing.error().kind, ErrorKind::kUsage);
  EXPECT_NE(missing.error().message.find("none.db"), std::string::npos);

  const std::string empty = dir.path() + "/empty.db";
  {
    auto cat = Catalog::open(empty).value();
    ASSERT_TRUE(cat->begin_run({"", "true", "node-a", 1000, 0}).has_value());
  }
  auto no_steps = ledger_of(empty, {});
  ASSERT_FALSE(no_steps.has_value());
  EXPECT_EQ(no_steps.error().kind, ErrorKind::kUsage);
  EXPECT_NE(no_steps.error().message.find("no step records"), std::string::npos);

  Options o;
  o.run_id = 42;
  auto no_run = ledger_of(write_run(dir.path() + "/c.db"), o);
  ASSERT_FALSE(no_run.has_value());
  EXPECT_NE(no_run.error().message.find("no run 42"), std::string::npos);

  EXPECT_EQ(read_planned_step(dir.path() + "/plan.json").error().kind, ErrorKind::kUsage);
}

TEST(Goodput, CommittedStepIsReadFromTheSupervisorsMessage) {
  TempDir dir("goodput-");
  const std::string db = dir.path() + "/c.db";
  {
    auto cat = Catalog::open(db).value();
    const std::int64_t run = cat->begin_run({"", "train", "node-a", 1000, 0}).value();
    const std::int64_t node = cat->node_id({"node-a", 1, 0, ""}).value();
    ASSERT_TRUE(cat->write_steps(run, {step(0, 7, 1001, 1), step(0, 8, 1003, 1)}));
    EventRecord e;
    e.t = 1001.5;
    e.kind = "run.committed";
    e.detail = "CMD committed step 7 in /scratch/ckpt";
    ASSERT_TRUE(cat->write_event(run, node, e));
    ASSERT_TRUE(cat->end_run(run, 1003, 0, 0));
  }
  auto l = ledger_of(db, {});
  ASSERT_TRUE(l.has_value()) << l.error().message;
  EXPECT_NEAR(seconds(*l, "checkpoint_stall"), 1, 1e-9);
  EXPECT_TRUE(balanced(*l));
}

}  // namespace
}  // namespace pacer::goodput
