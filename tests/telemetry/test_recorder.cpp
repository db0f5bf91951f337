#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <thread>

#include "pacer/telemetry.hpp"
#include "pacer/telemetry/catalog.hpp"
#include "pacer/telemetry_c.h"
#include "test_util.hpp"

namespace pacer::telemetry {
namespace {

using pacer::test::contains;
using pacer::test::TempDir;

std::int64_t count(const std::string& db, const std::string& sql) {
  auto c = Catalog::open(db, CatalogOptions{.read_only = true});
  EXPECT_TRUE(c.has_value());
  auto r = (*c)->query(sql);
  EXPECT_TRUE(r.has_value()) << (r ? "" : r.error().message);
  return r ? std::get<std::int64_t>(r->rows.at(0).at(0)) : -1;
}

TEST(StepJson, ParsesKnownAndExtraFields) {
  auto r = parse_step_json(R"({"step": 7, "loss": 2.5, "tokens": 4096, "data_wait_s": 0.1, "comm_s": 0.2, "rank": 3, "lr": 0.001, "phase": "warmup", "flops": 2.5e13})");
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(r->step, 7);
  EXPECT_DOUBLE_EQ(*r->loss, 2.5);
  EXPECT_DOUBLE_EQ(*r->tokens, 4096);
  EXPECT_DOUBLE_EQ(*r->data_wait_s, 0.1);
  EXPECT_DOUBLE_EQ(*r->comm_s, 0.2);
  EXPECT_EQ(r->rank, 3);
  EXPECT_DOUBLE_EQ(*r->flops, 2.5e13);
  EXPECT_FALSE(contains(r->extra_json, "flops"));
  EXPECT_FALSE(r->step_time_s.has_value());
  EXPECT_TRUE(contains(r->extra_json, "\"lr\":0.001"));
  EXPECT_TRUE(contains(r->extra_json, "\"phase\":\"warmup\""));
}

TEST(StepJson, MalformedRecordsSayWhy) {
  const std::pair<const char*, const char*> cases[] = {
      {"{\"step\": 1, \"loss\": ", "not valid JSON"},
      {"[1, 2]", "not a JSON object"},
      {"{\"loss\": 1}", "\"step\" missing"},
      {"{\"step\": 1.5}", "\"step\" missing or not an integer"},
      {"{\"step\": 1, \"loss\": \"low\"}", "\"loss\" is not a number"},
      {"{\"step\": 1, \"rank\": -2}", "\"rank\""},
      {"{\"step\": 1, \"data_wait_s\": -1}", "negative"},
      {"{\"step\": 1, \"flops\": -1}", "\"flops\" must not be negative"},
      {"{\"step\": 1, \"node\": 5}", "\"node\""},
      {"\xff\xfe garbage", "not valid JSON"},
  };
  for (const auto& [line, why] : cases) {
    auto r = parse_step_json(line);
    ASSERT_FALSE(r.has_value()) << line;
    EXPECT_TRUE(contains(r.error().message, why)) << line;
  }
}

TEST(StepFileReader, TailsCompleteLinesAndCountsMalformed) {
  TempDir dir("steps-");
  const std::string path = dir.path() + "/steps.jsonl";
  StepFileReader reader(path);
  EXPECT_TRUE(reader.poll().empty());  // not created yet
  {
    std::ofstream out(path);
    out << "{\"step\": 1}\nnot json\n\n{\"step\": 2, \"loss\": 1.0}\n{\"step\": 3";
  }
  auto first = reader.poll();
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(first[1].step, 2);
  EXPECT_EQ(reader.malformed(), 1u);
  ASSERT_EQ(reader.errors().size(), 1u);
  EXPECT_EQ(reader.errors()[0], path + ":2: not valid JSON");
  {
    std::ofstream out(path, std::ios::app);
    out << ", \"loss\": 0.5}\n{\"step\": 4}";
  }
  auto second = reader.poll();
  ASSERT_EQ(second.size(), 1u);  // the line completed across two writes
  EXPECT_EQ(second[0].step, 3);
  auto last = reader.poll(/*final=*/true);
  ASSERT_EQ(last.size(), 1u);
  EXPECT_EQ(last[0].step, 4);
  EXPECT_EQ(reader.malformed(), 1u);
}

TEST(Recorder, WritesStepsWithRankAndNode) {
  TempDir dir("rec-");
  const std::string db = dir.path() + "/r.db";
  {
    auto rec = std::move(Recorder::open(RecorderOptions{.db = db, .rank = 5, .node = "gpu017"}).value());
    for (int i = 0; i < 100; ++i) {
      StepRecord s;
      s.step = i;
      s.loss = 1.0 / (i + 1);
      s.data_wait_s = 0.01;
      EXPECT_TRUE(rec->step(s));
    }
    EXPECT_TRUE(rec->event("checkpoint.saved", "{\"step\": 99}"));
    ASSERT_TRUE(rec->flush());
    EXPECT_EQ(rec->written(), 101u);
    EXPECT_EQ(rec->dropped(), 0u);
  }
  EXPECT_EQ(count(db, "SELECT count(*) FROM steps s JOIN nodes n USING(node_id) WHERE rank=5 AND hostname='gpu017'"), 100);
  EXPECT_EQ(count(db, "SELECT count(*) FROM events WHERE kind='checkpoint.saved' AND rank=5"), 1);
  EXPECT_EQ(count(db, "SELECT count(*) FROM runs"), 1);
}

TEST(Recorder, NonFiniteFieldsDoNotLoseTheBatch) {
  TempDir dir("rec-");
  const std::string db = dir.path() + "/r.db";
  {
    auto rec = std::move(Recorder::open(RecorderOptions{.db = db, .rank = 0}).value());
    StepRecord bad;
    bad.step = 1;
    bad.t = std::nan("");  // placed at the time it was recorded
    bad.loss = std::numeric_limits<double>::infinity();
    bad.data_wait_s = std::nan("");
    EXPECT_TRUE(rec->step(bad));
    StepRecord good;
    good.step = 2;
    good.loss = 0.5;
    EXPECT_TRUE(rec->step(good));
    ASSERT_TRUE(rec->flush());
    EXPECT_EQ(rec->written(), 2u);
    EXPECT_EQ(rec->dropped(), 0u);
  }
  EXPECT_EQ(count(db, "SELECT count(*) FROM steps"), 2);
  EXPECT_EQ(count(db, "SELECT count(*) FROM steps WHERE step=1 AND loss IS NULL AND data_wait_s IS NULL AND t > 0"), 1);
}

TEST(Recorder, FullQueueDropsAndCountsInsteadOfBlocking) {
  TempDir dir("rec-");
  auto rec = std::move(
      Recorder::open(RecorderOptions{.db = dir.path() + "/r.db", .rank = 0, .queue_capacity = 8, .flush_interval_s = 3600}).value());
  int accepted = 0;
  for (int i = 0; i < 100; ++i) accepted += rec->step(StepRecord{i, 0, -1, "", {}, {}, {}, {}, {}, "", {}}) ? 1 : 0;
  EXPECT_EQ(accepted, 8);
  EXPECT_EQ(rec->dropped(), 92u);
  ASSERT_TRUE(rec->flush());
  EXPECT_EQ(rec->written(), 8u);
}

TEST(Recorder, ManyThreadsLoseNothingWithRoom) {
  TempDir dir("rec-");
  const std::string db = dir.path() + "/r.db";
  auto rec = std::move(Recorder::open(RecorderOptions{.db = db, .rank = 0, .flush_interval_s = 0.01}).value());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) rec->step(StepRecord{t * 1000 + i, 0, t, "", {}, {}, {}, {}, {}, "", {}});
    });
  for (auto& th : threads) th.join();
  ASSERT_TRUE(rec->flush());
  EXPECT_EQ(rec->written() + rec->dropped(), 2000u);
  EXPECT_EQ(rec->dropped(), 0u);
  rec.reset();
  EXPECT_EQ(count(db, "SELECT count(*) FROM steps"), 2000);
  EXPECT_EQ(count(db, "SELECT count(*) FROM ranks"), 4);
}

TEST(Recorder, RankFromTheEnvironment) {
  ::unsetenv("SLURM_PROCID");
  ::unsetenv("OMPI_COMM_WORLD_RANK");
  ::unsetenv("PMI_RANK");
  ::setenv("RANK", "12", 1);
  EXPECT_EQ(rank_from_env(), 12);
  ::setenv("SLURM_PROCID", "3", 1);
  EXPECT_EQ(rank_from_env(), 3);  // Slurm's comes first
  ::setenv("SLURM_PROCID", "x", 1);
  EXPECT_EQ(rank_from_env(), 12);  // not a number: the next one
  ::unsetenv("SLURM_PROCID");
  ::unsetenv("RANK");
  EXPECT_EQ(rank_from_env(), 0);
}

TEST(CApi, StepsThroughTheCInterface) {
  TempDir dir("capi-");
  const std::string db = dir.path() + "/c.db";
  EXPECT_EQ(pacer_telemetry_step(nullptr), -1);  // nothing open
  ASSERT_EQ(pacer_telemetry_open(db.c_str()), 0) << pacer_telemetry_error();
  for (int i = 0; i < 10; ++i) {
    pacer_step s = pacer_step_init(i);
    s.loss = 3.0;
    s.rank = 2;
    if (i == 0) s.flops = 1e12;
    EXPECT_EQ(pacer_telemetry_step(&s), 0);
  }
  EXPECT_EQ(pacer_telemetry_flush(), 0);
  EXPECT_EQ(pacer_telemetry_dropped(), 0u);
  pacer_telemetry_close();
  EXPECT_EQ(count(db, "SELECT count(*) FROM steps WHERE rank=2 AND loss=3.0 AND tokens IS NULL"), 10);
  EXPECT_EQ(count(db, "SELECT count(*) FROM steps WHERE flops = 1e12 AND step = 0"), 1);
  EXPECT_EQ(count(db, "SELECT count(*) FROM steps WHERE flops IS NULL"), 9);
  EXPECT_EQ(pacer_telemetry_open((dir.path() + "/no/such/dir/x.db").c_str()), -1);
  EXPECT_TRUE(contains(pacer_telemetry_error(), "no/such/dir"));
}

}  // namespace
}  // namespace pacer::telemetry
