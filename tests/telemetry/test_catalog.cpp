#include "pacer/telemetry/catalog.hpp"

#include <gtest/gtest.h>
#include <fmt/format.h>
#include <sqlite3.h>

#include <filesystem>
#include <limits>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "pacer/telemetry/monitor.hpp"
#include "pacer/telemetry/questions.hpp"
#include "test_util.hpp"

namespace pacer::telemetry {
namespace {

using pacer::test::contains;
using pacer::test::TempDir;

std::int64_t scalar(Catalog& c, const std::string& sql) {
  auto r = c.query(sql);
  EXPECT_TRUE(r.has_value()) << (r ? "" : r.error().message);
  if (!r || r->rows.empty()) return -1;
  const Value& v = r->rows[0][0];
  if (const auto* i = std::get_if<std::int64_t>(&v)) return *i;
  if (const auto* d = std::get_if<double>(&v)) return static_cast<std::int64_t>(*d);
  return -1;
}

// A sample with one host and one GPU reading at time t.
Sample sample_at(double t, double temp_c, double util) {
  Sample s;
  s.t = t;
  s.readings.push_back({find_metric("cpu.busy"), -1, "", 0.5, {}});
  s.readings.push_back({find_metric("gpu.temperature_c"), 0, "", temp_c, {}});
  s.readings.push_back({find_metric("gpu.util"), 0, "", util, {}});
  return s;
}

struct Fixture {
  TempDir dir{"catalog-"};
  std::unique_ptr<Catalog> cat;
  std::int64_t run = 0, node = 0;
  explicit Fixture(const std::string& host = "n1", const std::string& job = "77") {
    cat = std::move(Catalog::open(dir.path() + "/c.db").value());
    node = cat->node_id(NodeInfo{host, 4, 1 << 30, "6.1"}).value();
    EXPECT_TRUE(cat->add_gpus(node, {GpuRecord{0, "GPU-aaa", "H200", 141ull << 30}}));
    run = cat->begin_run(RunInfo{job, "train.py", host, 1000, 1}).value();
  }
};

TEST(Catalog, SchemaVersionAndTables) {
  Fixture f;
  EXPECT_EQ(scalar(*f.cat, "PRAGMA user_version"), kCatalogSchemaVersion);
  auto r = f.cat->query("SELECT value FROM meta WHERE key='schema'");
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(std::get<std::string>(r->rows.at(0).at(0)), "pacer.catalog/1");
  for (const char* t : {"runs", "nodes", "ranks", "gpus", "metrics", "samples", "steps", "events"})
    EXPECT_EQ(scalar(*f.cat, fmt::format("SELECT count(*) FROM sqlite_master WHERE name='{}'", t)), 1) << t;
  EXPECT_EQ(std::get<std::string>(f.cat->query("PRAGMA journal_mode")->rows[0][0]), "wal");
}

// Ranks of one job open the same new catalog at the same moment (the
// reference training run's two ranks did): every one gets the catalog, none
// "database is locked" or "not a pacer catalog".
TEST(Catalog, ManyOpenersOfOneNewCatalogAllSucceed) {
  TempDir dir("pacer-catalog-race-");
  for (int round = 0; round < 20; ++round) {
    const std::string path = dir.path() + fmt::format("/race-{}.db", round);
    std::vector<std::thread> ts;
    std::vector<std::string> errors(4);
    for (int t = 0; t < 4; ++t)
      ts.emplace_back([&, t] {
        auto c = Catalog::open(path);
        if (!c) errors[t] = c.error().message;
      });
    for (auto& th : ts) th.join();
    for (const auto& e : errors) EXPECT_EQ(e, "") << "round " << round;
    auto c = Catalog::open(path);
    ASSERT_TRUE(c) << c.error().message;
    EXPECT_EQ((*c)->schema_version(), kCatalogSchemaVersion);
  }
}

TEST(Catalog, NewerSchemaIsRefusedByName) {
  TempDir dir("catalog-");
  const std::string path = dir.path() + "/new.db";
  { auto c = Catalog::open(path); ASSERT_TRUE(c.has_value()); }
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  sqlite3_exec(db, "PRAGMA user_version=7", nullptr, nullptr, nullptr);
  sqlite3_close(db);
  for (bool ro : {false, true}) {
    auto c = Catalog::open(path, CatalogOptions{.read_only = ro});
    ASSERT_FALSE(c.has_value());
    EXPECT_EQ(c.error().kind, ErrorKind::kConfig);
    EXPECT_TRUE(contains(c.error().message, path));
    EXPECT_TRUE(contains(c.error().message, "schema version 7 is newer"));
  }
}

TEST(Catalog, ForeignFilesAreRefused) {
  TempDir dir("catalog-");
  const std::string text = dir.file("notes.txt", "this is not a database, just text long enough to be read.....\n");
  auto c = Catalog::open(text);
  ASSERT_FALSE(c.has_value());
  EXPECT_TRUE(contains(c.error().message, text));
  const std::string other = dir.path() + "/other.db";
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(other.c_str(), &db), SQLITE_OK);
  sqlite3_exec(db, "CREATE TABLE x(a)", nullptr, nullptr, nullptr);
  sqlite3_close(db);
  auto o = Catalog::open(other);
  ASSERT_FALSE(o.has_value());
  EXPECT_TRUE(contains(o.error().message, "not a pacer catalog"));
  auto missing = Catalog::open(dir.path() + "/none.db", CatalogOptions{.read_only = true});
  ASSERT_FALSE(missing.has_value());
  EXPECT_TRUE(contains(missing.error().message, "no such catalog"));
}

TEST(Catalog, SamplesStepsAndDerivedStepTime) {
  Fixture f;
  ASSERT_TRUE(f.cat->write_sample(f.run, f.node, sample_at(1001, 60, 0.9)));
  std::vector<StepRecord> steps;
  for (int i = 0; i < 3; ++i) {
    StepRecord s;
    s.step = i;
    s.t = 1000.0 + 0.5 * i;
    s.rank = 3;
    s.node = "n1";
    s.loss = 2.0 - 0.1 * i;
    steps.push_back(s);
  }
  steps[2].step_time_s = 9.0;  // given beats derived
  ASSERT_TRUE(f.cat->write_steps(f.run, steps));
  auto r = f.cat->query("SELECT step, step_time_s FROM steps ORDER BY step");
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->rows.size(), 3u);
  EXPECT_TRUE(std::holds_alternative<std::monostate>(r->rows[0][1]));  // no previous step
  EXPECT_DOUBLE_EQ(std::get<double>(r->rows[1][1]), 0.5);
  EXPECT_DOUBLE_EQ(std::get<double>(r->rows[2][1]), 9.0);
  EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM ranks WHERE rank=3"), 1);
  EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM samples_named WHERE metric='gpu.util' AND gpu_index=0 AND hostname='n1'"), 1);
  EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM gpus WHERE uuid='GPU-aaa'"), 1);
}

// steps.flops came within version 1: a catalog written before it is merged
// with NULL there and gains the column when opened for writing.
TEST(Catalog, CatalogWithoutTheFlopsColumn) {
  std::string path;
  TempDir out("flops-");
  {
    Fixture f;
    ASSERT_TRUE(f.cat->write_steps(f.run, {StepRecord{1, 1001, 0, "n1", 1.0, 2.0, 512, {}, {}, "", 3e12}}));
    EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM steps WHERE flops = 3e12"), 1);
    path = out.path() + "/old.db";
    const std::string written = f.cat->path();
    f.cat.reset();  // closing moves the WAL into the file
    std::filesystem::copy_file(written, path);
  }
  sqlite3* raw = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &raw), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(raw, "ALTER TABLE steps DROP COLUMN flops", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(raw);
  auto merged = merge_catalogs(out.path() + "/merged.db", {path});
  ASSERT_TRUE(merged.has_value()) << merged.error().message;
  auto m = std::move(Catalog::open(out.path() + "/merged.db", CatalogOptions{.read_only = true}).value());
  EXPECT_EQ(scalar(*m, "SELECT count(*) FROM steps WHERE flops IS NULL AND tokens = 512"), 1);
  auto ro = std::move(Catalog::open(path, CatalogOptions{.read_only = true}).value());
  EXPECT_EQ(ro->query("PRAGMA table_info(steps)")->rows.size(), 11u);  // readers change nothing
  auto rw = std::move(Catalog::open(path).value());
  EXPECT_EQ(scalar(*rw, "SELECT count(*) FROM pragma_table_info('steps') WHERE name = 'flops'"), 1);
  ASSERT_TRUE(rw->write_steps(1, {StepRecord{2, 1002, 0, "n1", 1.0, {}, {}, {}, {}, "", 4e12}}));
  EXPECT_EQ(scalar(*rw, "SELECT count(*) FROM steps WHERE flops = 4e12"), 1);
}

// pacer run --monitor: one run begun by the supervisor, joined by the
// monitor of every attempt, whose sampler costs add up.
TEST(Catalog, ContinueRunJoinsAnExistingRunOnly) {
  TempDir dir("catalog-");
  auto cat = std::move(Catalog::open(dir.path() + "/c.db").value());
  const auto run = cat->begin_run(RunInfo{"", "pacer run -- x", "n1", 1, 0}).value();
  ASSERT_TRUE(cat->continue_run(run, 0.25));
  ASSERT_TRUE(cat->continue_run(run, 5));  // the first interval stays
  EXPECT_EQ(scalar(*cat, fmt::format("SELECT interval_s * 100 FROM runs WHERE run_id={}", run)), 25);
  const auto missing = cat->continue_run(run + 1, 1);
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error().kind, ErrorKind::kUsage);
  EXPECT_TRUE(contains(missing.error().message, fmt::format("no run {}", run + 1)));
  ASSERT_TRUE(cat->end_run(run, 10, 3, 0.5));
  ASSERT_TRUE(cat->end_run(run, 20, 0, 0.25));
  EXPECT_EQ(scalar(*cat, fmt::format("SELECT sampler_cpu_s * 100 FROM runs WHERE run_id={}", run)), 75);
  EXPECT_EQ(scalar(*cat, fmt::format("SELECT exit_code FROM runs WHERE run_id={}", run)), 0);
  EXPECT_EQ(scalar(*cat, "SELECT count(*) FROM runs"), 1);
}

TEST(Catalog, FullDiskStopsWritingButNotTheCaller) {
  TempDir dir("catalog-");
  auto cat = std::move(Catalog::open(dir.path() + "/full.db", CatalogOptions{.max_pages = 40}).value());
  const auto node = cat->node_id(NodeInfo{"n1", 1, 1, ""}).value();
  const auto run = cat->begin_run(RunInfo{"", "x", "n1", 1, 1}).value();
  int failures = 0;
  for (int i = 0; i < 400; ++i) {
    Sample s = sample_at(i, 50, 0.5);
    for (int k = 0; k < 20; ++k) s.readings.push_back({find_metric("cpu.busy"), -1, fmt::format("cpu{}", k), 0.1, {}});
    if (!cat->write_sample(run, node, s)) ++failures;
  }
  EXPECT_EQ(failures, 1);  // reported once, then silently dropped
  EXPECT_TRUE(cat->writes_stopped());
  EXPECT_GT(cat->dropped_records(), 0u);
  EXPECT_TRUE(contains(cat->stop_reason(), "full"));
  // The run row says why the data ends.
  auto r = cat->query("SELECT catalog_status FROM runs");
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(contains(std::get<std::string>(r->rows.at(0).at(0)), "writes stopped"));
  EXPECT_GT(scalar(*cat, "SELECT count(*) FROM samples"), 0);
}

TEST(Catalog, NonFiniteValueIsSkippedAndTheRestOfThePassKept) {
  Fixture f;
  // A GPM figure over a too-short window comes back as NaN; SQLite would bind
  // it as NULL and the NOT NULL column would fail the whole pass.
  Sample s = sample_at(1001, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity());
  s.events.push_back({1001, "gpu.throttle", "hw_slowdown", 0, -1});
  ASSERT_TRUE(f.cat->write_sample(f.run, f.node, s));
  EXPECT_EQ(f.cat->nonfinite_values(), 2u);
  EXPECT_EQ(f.cat->dropped_records(), 0u);
  EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM samples_named WHERE metric='cpu.busy'"), 1);
  EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM samples"), 1);
  EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM events WHERE kind='gpu.throttle'"), 1);
  ASSERT_TRUE(f.cat->write_sample(f.run, f.node, sample_at(1002, 60, 0.9)));
  EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM samples"), 4);
}

TEST(Catalog, NonFiniteStepFieldsBecomeNullAndStepsWithoutTimeAreSkipped) {
  Fixture f;
  std::vector<StepRecord> steps(3);
  for (int i = 0; i < 3; ++i) {
    steps[i].step = i;
    steps[i].t = 1000.0 + i;
    steps[i].rank = 0;
    steps[i].loss = 1.0;
  }
  steps[1].loss = std::numeric_limits<double>::quiet_NaN();  // a diverged loss
  steps[2].t = std::numeric_limits<double>::quiet_NaN();
  ASSERT_TRUE(f.cat->write_steps(f.run, steps));
  EXPECT_EQ(f.cat->nonfinite_values(), 2u);
  EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM steps"), 2);
  EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM steps WHERE step=1 AND loss IS NULL"), 1);
}

TEST(Catalog, FailedBatchIsCountedAndLaterBatchesAreWritten) {
  Fixture f;
  // Any failure other than a full disk: this batch is lost, the next is not.
  ASSERT_EQ(sqlite3_exec(f.cat->handle(),
                         "CREATE TEMP TRIGGER refuse BEFORE INSERT ON samples WHEN NEW.value = 666 "
                         "BEGIN SELECT RAISE(ABORT, 'refused'); END",
                         nullptr, nullptr, nullptr),
            SQLITE_OK);
  const auto failed = f.cat->write_sample(f.run, f.node, sample_at(1001, 666, 0.5));
  ASSERT_FALSE(failed);
  EXPECT_TRUE(contains(failed.error().message, "refused"));
  EXPECT_FALSE(f.cat->writes_stopped());
  EXPECT_EQ(f.cat->dropped_records(), 3u);
  EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM samples"), 0);  // the transaction rolled back whole
  ASSERT_TRUE(f.cat->write_sample(f.run, f.node, sample_at(1002, 60, 0.5)));
  // The failed batch had inserted the metric rows; the next one must not
  // reuse their rolled-back ids.
  EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM samples_named WHERE hostname='n1'"), 3);
  EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM samples_named WHERE metric='gpu.temperature_c' AND gpu_index=0"), 1);
}

TEST(Catalog, MergeMapsIdsAndJoinsAJobsRuns) {
  Fixture a("n1", "77"), b("n2", "77");
  ASSERT_TRUE(a.cat->write_sample(a.run, a.node, sample_at(1001, 60, 0.9)));
  ASSERT_TRUE(b.cat->write_sample(b.run, b.node, sample_at(1001, 90, 0.1)));
  ASSERT_TRUE(b.cat->write_sample(b.run, b.node, sample_at(1002, 91, 0.1)));
  ASSERT_TRUE(b.cat->write_event(b.run, b.node, EventRecord{1001.5, "gpu.throttle", "hw_thermal", 0, -1}));
  ASSERT_TRUE(a.cat->write_steps(a.run, {StepRecord{1, 1001, 0, "n1", 1.0, {}, {}, {}, {}, "", {}}}));
  ASSERT_TRUE(b.cat->write_steps(b.run, {StepRecord{1, 1001, 1, "n2", 1.5, {}, {}, {}, {}, "", {}}}));
  TempDir out("merge-");
  const std::string merged = out.path() + "/job.db";
  auto r = merge_catalogs(merged, {a.cat->path(), b.cat->path()});
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(r->runs, 1);  // same job id
  EXPECT_EQ(r->nodes, 2);
  EXPECT_EQ(r->samples, 9);
  auto m = std::move(Catalog::open(merged, CatalogOptions{.read_only = true}).value());
  EXPECT_EQ(scalar(*m, "SELECT count(*) FROM gpus"), 2);
  EXPECT_EQ(scalar(*m, "SELECT count(*) FROM samples_named WHERE hostname='n2' AND metric='gpu.temperature_c' AND gpu_index=0"), 2);
  EXPECT_EQ(scalar(*m, "SELECT count(*) FROM events e JOIN gpus g USING(gpu_id) JOIN nodes n ON n.node_id=g.node_id WHERE n.hostname='n2'"), 1);
  EXPECT_EQ(scalar(*m, "SELECT count(DISTINCT rank) FROM ranks"), 2);
  // Merging again into the existing file adds, and a newer input is refused before anything changes.
  Fixture c("n3", "78");
  auto again = merge_catalogs(merged, {c.cat->path()});
  ASSERT_TRUE(again.has_value()) << again.error().message;
  EXPECT_EQ(again->runs, 2);
  EXPECT_EQ(again->nodes, 3);
  auto bad = merge_catalogs(merged, {out.path() + "/missing.db"});
  ASSERT_FALSE(bad.has_value());
  EXPECT_TRUE(contains(bad.error().message, "missing.db"));
}

// Merging must never count a run twice: the same file twice, the output as
// an input, a file merged again later, or a merged catalog merged onward.
TEST(Catalog, MergeTakesEveryRunOnce) {
  Fixture a("n1", "77"), b("n2", "77");
  ASSERT_TRUE(a.cat->write_sample(a.run, a.node, sample_at(1001, 60, 0.9)));
  ASSERT_TRUE(a.cat->write_steps(a.run, {StepRecord{1, 1001, 0, "n1", 1.0, {}, {}, {}, {}, "", {}}}));
  ASSERT_TRUE(a.cat->write_event(a.run, a.node, EventRecord{1001.5, "gpu.throttle", "hw_thermal", 0, -1}));
  ASSERT_TRUE(b.cat->write_sample(b.run, b.node, sample_at(1001, 90, 0.1)));
  TempDir out("merge-");
  const std::string merged = out.path() + "/job.db";
  const std::string alias = out.path() + "/alias.db";
  std::filesystem::create_symlink(a.cat->path(), alias);
  const auto counts = [&](const std::string& db) {
    auto m = std::move(Catalog::open(db, CatalogOptions{.read_only = true}).value());
    return std::make_tuple(scalar(*m, "SELECT count(*) FROM samples"), scalar(*m, "SELECT count(*) FROM steps"),
                           scalar(*m, "SELECT count(*) FROM events"), scalar(*m, "SELECT count(*) FROM runs"));
  };

  auto r = merge_catalogs(merged, {a.cat->path(), b.cat->path(), a.cat->path(), alias});
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(r->inputs, 2u);
  EXPECT_EQ(r->samples, 6);
  EXPECT_EQ(r->steps, 1);
  ASSERT_EQ(r->skipped.size(), 2u);
  EXPECT_TRUE(contains(r->skipped[0], "same file as " + a.cat->path())) << r->skipped[0];
  EXPECT_TRUE(contains(r->skipped[1], alias)) << r->skipped[1];
  EXPECT_EQ(counts(merged), std::make_tuple(6, 1, 1, 1));

  // Merged again into the existing output: nothing new, each run a note.
  r = merge_catalogs(merged, {a.cat->path(), b.cat->path()});
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(r->samples, 6) << "the output's own rows are counted once, the inputs' not again";
  ASSERT_EQ(r->skipped.size(), 2u);
  EXPECT_TRUE(contains(r->skipped[0], "already in " + merged)) << r->skipped[0];
  EXPECT_EQ(counts(merged), std::make_tuple(6, 1, 1, 1));

  // A copy under another name is the same runs.
  const std::string copy = out.path() + "/copy.db";
  ASSERT_EQ(sqlite3_exec(b.cat->handle(), "PRAGMA wal_checkpoint(TRUNCATE)", nullptr, nullptr, nullptr), SQLITE_OK);
  std::filesystem::copy_file(b.cat->path(), copy);
  r = merge_catalogs(merged, {copy});
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(counts(merged), std::make_tuple(6, 1, 1, 1));

  // A merged catalog merged onward carries what it holds.
  const std::string onward = out.path() + "/onward.db";
  ASSERT_TRUE(merge_catalogs(onward, {merged}).has_value());
  r = merge_catalogs(onward, {b.cat->path()});
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->skipped.size(), 1u);
  EXPECT_EQ(counts(onward), std::make_tuple(6, 1, 1, 1));

  // A new run in a file merged before (a requeued job on the same node) is added alone.
  const auto rerun = a.cat->begin_run(RunInfo{"77", "train.py", "n1", 2000, 1}).value();
  ASSERT_TRUE(a.cat->write_sample(rerun, a.node, sample_at(2001, 61, 0.9)));
  r = merge_catalogs(merged, {a.cat->path()});
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(counts(merged), std::make_tuple(9, 1, 1, 1));

  // Into itself: a usage error, and the file stays as it was.
  for (const std::string& self : {merged, out.path() + "/./job.db"}) {
    auto bad = merge_catalogs(merged, {self});
    ASSERT_FALSE(bad.has_value());
    EXPECT_EQ(bad.error().kind, ErrorKind::kUsage);
    EXPECT_TRUE(contains(bad.error().message, "itself")) << bad.error().message;
  }
  EXPECT_EQ(counts(merged), std::make_tuple(9, 1, 1, 1));
}

// pacer query opens the catalog read-only: no statement may change any file.
TEST(Catalog, ReadOnlyQueryChangesNoFile) {
  Fixture f;
  ASSERT_TRUE(f.cat->write_sample(f.run, f.node, sample_at(1001, 60, 0.9)));
  const std::string path = f.cat->path();
  auto ro = std::move(Catalog::open(path, CatalogOptions{.read_only = true}).value());
  const std::string copy = f.dir.path() + "/copy.db";
  const std::string other = f.dir.path() + "/other.db";
  for (const std::string& sql : {"VACUUM INTO '" + copy + "'", std::string("VACUUM"), "ATTACH DATABASE '" + other + "' AS x",
                                 std::string("PRAGMA query_only = 0"), std::string("PRAGMA user_version = 7"),
                                 std::string("PRAGMA journal_mode = DELETE"), std::string("PRAGMA wal_checkpoint"),
                                 std::string("INSERT INTO meta VALUES('k', 'v')"), std::string("DELETE FROM samples"),
                                 std::string("CREATE TEMP TABLE t(x)"), std::string("SELECT 1; DROP TABLE samples")}) {
    SCOPED_TRACE(sql);
    auto r = ro->query(sql);
    ASSERT_FALSE(r.has_value()) << "a read-only query ran it";
    EXPECT_EQ(r.error().kind, ErrorKind::kUsage);
    EXPECT_TRUE(contains(r.error().message, "refused")) << r.error().message;
  }
  EXPECT_FALSE(std::filesystem::exists(copy));
  EXPECT_FALSE(std::filesystem::exists(other));
  EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM samples"), 3);
  EXPECT_EQ(scalar(*f.cat, "PRAGMA user_version"), kCatalogSchemaVersion);
  // Reading still works: SELECT, WITH, the reporting PRAGMAs, the named questions.
  EXPECT_EQ(scalar(*ro, "SELECT count(*) FROM samples_named"), 3);
  EXPECT_EQ(scalar(*ro, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 10) SELECT sum(x) FROM c"), 55);
  EXPECT_EQ(scalar(*ro, "PRAGMA user_version"), kCatalogSchemaVersion);
  EXPECT_TRUE(ro->query("PRAGMA table_info(samples)").has_value());
  for (const auto& q : questions()) {
    auto sql = question_sql(q.name, {});
    ASSERT_TRUE(sql.has_value());
    auto r = ro->query(*sql);
    EXPECT_TRUE(r.has_value()) << q.name << ": " << r.error().message;
  }
}

TEST(Catalog, QueryStopsAtItsTimeLimitAndResultLimit) {
  Fixture f;
  const std::string endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) ";
  auto ro = std::move(Catalog::open(f.cat->path(), CatalogOptions{.read_only = true, .query_timeout_s = 0.3}).value());
  auto r = ro->query(endless + "SELECT count(*) FROM c");
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().kind, ErrorKind::kRuntime);
  EXPECT_TRUE(contains(r.error().message, "time limit of 0.3 s")) << r.error().message;
  EXPECT_TRUE(contains(r.error().message, f.cat->path())) << r.error().message;
  EXPECT_EQ(scalar(*ro, "SELECT 42"), 42) << "the next query runs";

  auto capped = std::move(Catalog::open(f.cat->path(), CatalogOptions{.read_only = true, .max_result_bytes = 1 << 20}).value());
  r = capped->query(endless + "SELECT x, 'some text' FROM c");
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().kind, ErrorKind::kRuntime);
  EXPECT_TRUE(contains(r.error().message, "larger than its limit")) << r.error().message;
}

TEST(Questions, AnswerOnASyntheticRun) {
  Fixture f;
  // Steps of 1 s, except step 5 (3 s) during which GPU 0 ran hot and idle.
  std::vector<StepRecord> steps;
  double t = 1000;
  for (int i = 0; i < 10; ++i) {
    const double dt = i == 5 ? 3.0 : 1.0;
    t += dt;
    steps.push_back(StepRecord{i, t, 0, "n1", dt, 2.0, 4096, 0.25 * dt, 0.1 * dt, "", {}});
  }
  ASSERT_TRUE(f.cat->write_steps(f.run, steps));
  for (double s = 1000; s <= t; s += 1) {
    const bool during = s > 1005 && s <= 1008;
    ASSERT_TRUE(f.cat->write_sample(f.run, f.node, sample_at(s, during ? 92 : 60, during ? 0.1 : 0.95)));
  }
  ASSERT_TRUE(f.cat->write_event(f.run, f.node, EventRecord{1006, "gpu.throttle", "hw_thermal", 0, -1}));
  ASSERT_TRUE(f.cat->write_event(f.run, f.node, EventRecord{1008.5, "gpu.throttle_end", "hw_thermal", 0, -1}));

  auto slow = f.cat->query(question_sql("slowest-steps", QuestionArgs{.limit = 1}).value());
  ASSERT_TRUE(slow.has_value()) << slow.error().message;
  ASSERT_EQ(slow->rows.size(), 1u);
  const auto col = [&](const QueryResult& r, const std::string& name) {
    for (std::size_t i = 0; i < r.columns.size(); ++i)
      if (r.columns[i] == name) return i;
    ADD_FAILURE() << "no column " << name;
    return std::size_t{0};
  };
  EXPECT_EQ(std::get<std::int64_t>(slow->rows[0][col(*slow, "step")]), 5);
  EXPECT_DOUBLE_EQ(std::get<double>(slow->rows[0][col(*slow, "temp_c_max")]), 92);
  EXPECT_LT(std::get<double>(slow->rows[0][col(*slow, "gpu_util")]), 0.5);

  auto hot = f.cat->query(question_sql("hot-nodes", QuestionArgs{.threshold_c = 85}).value());
  ASSERT_TRUE(hot.has_value()) << hot.error().message;
  ASSERT_EQ(hot->rows.size(), 1u);
  EXPECT_EQ(std::get<std::string>(hot->rows[0][col(*hot, "node")]), "n1");
  EXPECT_EQ(std::get<std::int64_t>(hot->rows[0][col(*hot, "regressed_steps")]), 1);
  auto cool = f.cat->query(question_sql("hot-nodes", QuestionArgs{.threshold_c = 95}).value());
  ASSERT_TRUE(cool.has_value());
  EXPECT_TRUE(cool->rows.empty());

  auto wait = f.cat->query(question_sql("data-wait", {}).value());
  ASSERT_TRUE(wait.has_value()) << wait.error().message;
  ASSERT_EQ(wait->rows.size(), 1u);
  EXPECT_DOUBLE_EQ(std::get<double>(wait->rows[0][col(*wait, "data_wait_share")]), 0.25);
  EXPECT_DOUBLE_EQ(std::get<double>(wait->rows[0][col(*wait, "comm_share")]), 0.1);

  auto thr = f.cat->query(question_sql("throttle", {}).value());
  ASSERT_TRUE(thr.has_value()) << thr.error().message;
  ASSERT_EQ(thr->rows.size(), 1u);
  EXPECT_DOUBLE_EQ(std::get<double>(thr->rows[0][col(*thr, "duration_s")]), 2.5);
  EXPECT_EQ(std::get<std::string>(thr->rows[0][col(*thr, "reasons")]), "hw_thermal");

  auto unknown = question_sql("fastest", {});
  ASSERT_FALSE(unknown.has_value());
  EXPECT_TRUE(contains(unknown.error().message, "slowest-steps"));
}

TEST(Catalog, QueryErrorsAreUsageErrors) {
  Fixture f;
  auto r = f.cat->query("SELEC nonsense");
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().kind, ErrorKind::kUsage);
  EXPECT_TRUE(contains(r.error().message, "SQL error"));
}

TEST(Catalog, CheckRunNamesTheIdAndListsTheRuns) {
  Fixture f;
  EXPECT_TRUE(check_run(*f.cat, f.run));
  auto second = f.cat->begin_run(RunInfo{"78", "eval.py", "n1", 2000, 1}).value();
  auto bad = check_run(*f.cat, 99);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().kind, ErrorKind::kUsage);
  const std::string& m = bad.error().message;
  EXPECT_TRUE(contains(m, f.cat->path() + ": no run 99 in the catalog")) << m;
  // Newest first, each with its start and command.
  EXPECT_TRUE(contains(m, fmt::format("its runs: {} (1970-01-01T00:33:20Z: eval.py), {} (1970-01-01T00:16:40Z: train.py)",
                                      second, f.run)))
      << m;
}

TEST(Catalog, DiscardRunRemovesTheRunAndItsRowsOnly) {
  Fixture f;
  auto other = f.cat->begin_run(RunInfo{"78", "typo", "n1", 2000, 1}).value();
  ASSERT_TRUE(f.cat->write_sample(other, f.node, sample_at(2001, 60, 0.5)));
  ASSERT_TRUE(f.cat->write_steps(other, {StepRecord{1, 2001, 0, "n1", 1.0, 2.0, 10, 0, 0, "", {}}}));
  ASSERT_TRUE(f.cat->write_sample(f.run, f.node, sample_at(1001, 60, 0.5)));
  ASSERT_TRUE(f.cat->discard_run(other));
  EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM runs"), 1);
  EXPECT_EQ(scalar(*f.cat, "SELECT run_id FROM runs"), f.run);
  EXPECT_EQ(scalar(*f.cat, fmt::format("SELECT count(*) FROM samples WHERE run_id={}", other)), 0);
  EXPECT_EQ(scalar(*f.cat, "SELECT count(*) FROM steps"), 0);
  EXPECT_EQ(scalar(*f.cat, fmt::format("SELECT count(*) FROM samples WHERE run_id={}", f.run)), 3);
}

TEST(Questions, RunLimitsEveryQuestionAndEachShowsTheRun) {
  Fixture f;
  auto second = f.cat->begin_run(RunInfo{"78", "again.py", "n1", 2000, 1}).value();
  for (auto run : {f.run, second}) {
    const double base = run == f.run ? 1000 : 2000;
    std::vector<StepRecord> steps;
    for (int i = 0; i < 4; ++i) steps.push_back(StepRecord{i, base + i + 1, 0, "n1", i == 2 ? 3.0 : 1.0, 2.0, 10, 0.2, 0.1, "", {}});
    ASSERT_TRUE(f.cat->write_steps(run, steps));
    for (double t = base; t <= base + 5; t += 1) ASSERT_TRUE(f.cat->write_sample(run, f.node, sample_at(t, 92, 0.5)));
    ASSERT_TRUE(f.cat->write_event(run, f.node, EventRecord{base + 1, "gpu.throttle", "hw_thermal", 0, -1}));
  }
  for (const auto& q : questions()) {
    for (std::optional<std::int64_t> only : {std::optional<std::int64_t>{}, std::optional<std::int64_t>{second}}) {
      auto r = f.cat->query(question_sql(q.name, QuestionArgs{.run_id = only}).value());
      ASSERT_TRUE(r.has_value()) << q.name << ": " << r.error().message;
      ASSERT_FALSE(r->rows.empty()) << q.name;
      ASSERT_EQ(r->columns.at(0), "run_id") << q.name;
      std::set<std::int64_t> runs;
      for (const auto& row : r->rows) runs.insert(std::get<std::int64_t>(row[0]));
      const std::set<std::int64_t> expected = only ? std::set<std::int64_t>{second} : std::set<std::int64_t>{f.run, second};
      EXPECT_EQ(runs, expected) << q.name;
    }
  }
}

TEST(StepGauges, NewestStepOfEachRankWithItsWritersNode) {
  Fixture f;
  StepGauges g;
  ASSERT_TRUE(g.update(*f.cat, f.run));
  EXPECT_EQ(g.render("here"), "") << "no steps, no training families";
  ASSERT_TRUE(f.cat->write_steps(f.run, {StepRecord{1, 1001, 0, "n1", 2.0, 3.5, 4096, 0.5, 0.1, "", {}},
                                         StepRecord{2, 1003, 0, "n1", 2.0, 3.25, 8192, 0.25, 0.1, "", {}},
                                         StepRecord{2, 1003, 1, "n2", 4.0, std::nullopt, 1000, std::nullopt, 0.1, "", {}}}));
  // Another run's steps are not this run's.
  auto other = f.cat->begin_run(RunInfo{"78", "x", "n1", 900, 1}).value();
  ASSERT_TRUE(f.cat->write_steps(other, {StepRecord{9, 2000, 0, "n1", 1.0, 9.0, 1, 0, 0, "", {}}}));
  ASSERT_TRUE(g.update(*f.cat, f.run));
  // A late write of an older step of rank 0 does not replace the newest.
  ASSERT_TRUE(f.cat->write_steps(f.run, {StepRecord{0, 999, 0, "n1", 2.0, 7.0, 1, 0, 0, "", {}}}));
  ASSERT_TRUE(g.update(*f.cat, f.run));
  const std::string text = g.render("here");
  EXPECT_EQ(text,
            "# HELP pacer_step_time_seconds Duration of the newest training step of each rank\n"
            "# TYPE pacer_step_time_seconds gauge\n"
            "pacer_step_time_seconds{rank=\"0\",node=\"n1\"} 2\n"
            "pacer_step_time_seconds{rank=\"1\",node=\"n2\"} 4\n"
            "# HELP pacer_loss Loss of the newest training step of each rank\n"
            "# TYPE pacer_loss gauge\n"
            "pacer_loss{rank=\"0\",node=\"n1\"} 3.25\n"
            "# HELP pacer_tokens_per_second Tokens per second of the newest training step of each rank (tokens / step time)\n"
            "# TYPE pacer_tokens_per_second gauge\n"
            "pacer_tokens_per_second{rank=\"0\",node=\"n1\"} 4096\n"
            "pacer_tokens_per_second{rank=\"1\",node=\"n2\"} 250\n"
            "# HELP pacer_data_wait_ratio Share of the newest training step of each rank spent waiting for data (0-1)\n"
            "# TYPE pacer_data_wait_ratio gauge\n"
            "pacer_data_wait_ratio{rank=\"0\",node=\"n1\"} 0.125\n");
  // A step whose node the catalog lacks (NULL node_id) is labelled with the exporter's host.
  ASSERT_TRUE(f.cat->write_steps(f.run, {StepRecord{3, 1010, 1, "n2", 1.0, 1.0, 1, 0, 0, "", {}}}));
  ASSERT_TRUE(f.cat->query(fmt::format("UPDATE steps SET node_id=NULL WHERE run_id={} AND step=3", f.run)).has_value());
  ASSERT_TRUE(g.update(*f.cat, f.run));
  EXPECT_TRUE(contains(g.render("here"), "pacer_loss{rank=\"1\",node=\"here\"} 1\n")) << g.render("here");
}

}  // namespace
}  // namespace pacer::telemetry
