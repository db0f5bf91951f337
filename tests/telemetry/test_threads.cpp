// The per-thread sampler: on a fake /proc (exact figures, tid reuse, threads that vanish) and on this process's own threads.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "test_util.hpp"
#include "pacer/telemetry/catalog.hpp"
#include "pacer/telemetry/monitor.hpp"
#include "pacer/telemetry/sampler.hpp"

namespace pacer::telemetry {
namespace {

using pacer::test::TempDir;

// /proc/PID/task/TID/stat with the fields the sampler reads.
void task(const TempDir& root, int pid, int tid, const std::string& comm, long utime, long stime, long starttime = 1000) {
  root.file(fmt::format("proc/{}/task/{}/stat", pid, tid),
            fmt::format("{} ({}) S 1 {} {} 0 -1 4194560 100 0 0 0 {} {} 0 0 20 0 3 0 {} 1000000 10 18446744073709551615\n",
                        tid, comm, pid, pid, utime, stime, starttime));
}

long ticks() { return hw::clock_ticks_per_second(); }

TEST(ThreadSampler, TheBusiestThreadAndItsShareOfACore) {
  TempDir root("threads-");
  root.file("proc/100/cmdline", std::string("/usr/bin/python3\0train.py\0", 26));
  task(root, 100, 100, "python3", 0, 0);
  task(root, 100, 101, "pt_data_worker", 0, 0);
  task(root, 200, 200, "sh", 0, 0);
  ThreadSampler s(root.path());
  EXPECT_FALSE(s.sample({100, 200}, 10.0).has_value());  // nothing to compare with yet
  // Over 2 s: the main thread 1.8 s of CPU (0.9 of a core), the worker 1.0 s, sh 1.2 s.
  task(root, 100, 100, "python3", ticks() * 3 / 2, ticks() * 3 / 10);
  task(root, 100, 101, "pt_data_worker", ticks(), 0);
  task(root, 200, 200, "sh", ticks() * 6 / 5, 0);
  auto r = s.sample({100, 200}, 12.0);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->pid, 100);
  EXPECT_EQ(r->tid, 100);
  EXPECT_EQ(r->comm, "python3");
  EXPECT_TRUE(r->main);
  EXPECT_TRUE(r->python);  // argv[0]: no exe link in a fake tree
  EXPECT_NEAR(r->busy, 0.9, 1e-9);
  EXPECT_EQ(r->threads, 3u);
  EXPECT_EQ(r->busy_threads, 2u);  // 0.9 and 0.5 of a core in its process; sh's 0.6 is another process's
  const auto j = to_json(*r);
  EXPECT_EQ(j["comm"], "python3");
  EXPECT_EQ(j["main"], true);
  Sample smp;
  smp.busiest_thread = *r;
  EXPECT_EQ(render_prometheus(smp, "n1"),
            "# HELP pacer_process_busiest_thread_ratio Share of one core used by the monitored tree's busiest thread over the "
            "last interval\n# TYPE pacer_process_busiest_thread_ratio gauge\n"
            "pacer_process_busiest_thread_ratio{node=\"n1\",comm=\"python3\",main=\"true\"} 0.9\n");

  // Next interval the worker is busiest: not the main thread.
  task(root, 100, 101, "pt_data_worker", ticks() * 3, 0);
  r = s.sample({100, 200}, 14.0);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->tid, 101);
  EXPECT_FALSE(r->main);
  EXPECT_TRUE(r->python);
  EXPECT_NEAR(r->busy, 1.0, 1e-9);
}

TEST(ThreadSampler, AReusedTidStartsOverAndAVanishedThreadIsSkipped) {
  TempDir root("threads-");
  root.file("proc/100/cmdline", std::string("./trainer\0", 10));
  task(root, 100, 100, "trainer", 0, 0);
  task(root, 100, 150, "old", 0, 0, 500);
  ThreadSampler s(root.path());
  (void)s.sample({100}, 1.0);
  // tid 150 ended and a new thread got its number (a later start time) and
  // already ran 5 s worth of ticks: no difference against the old thread.
  task(root, 100, 150, "new", ticks() * 5, 0, 900);
  task(root, 100, 100, "trainer", ticks() / 10, 0);
  auto r = s.sample({100}, 2.0);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->tid, 100);
  EXPECT_FALSE(r->python);
  EXPECT_EQ(r->threads, 1u);
  EXPECT_NEAR(r->busy, 0.1, 1e-9);
  // From the next pass the new thread counts.
  task(root, 100, 150, "new", ticks() * 5 + ticks() / 2, 0, 900);
  r = s.sample({100}, 3.0);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->comm, "new");
  EXPECT_NEAR(r->busy, 0.5, 1e-9);
  // A thread listed but gone before its stat is read, and a process gone whole.
  std::filesystem::remove(root.path() + "/proc/100/task/150/stat");
  r = s.sample({100, 4242}, 4.0);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->tid, 100);
  EXPECT_EQ(r->threads, 1u);
  // A clock that did not advance gives no share.
  EXPECT_FALSE(s.sample({100}, 4.0).has_value());
}

// This process with 120 idle threads and one that spins: the spinner is
// found by name, and a pass over 120+ threads is cheap (its cost printed).
TEST(ThreadSampler, FindsTheSpinningThreadAmongManyOfThisProcess) {
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::atomic<bool> spin{true};
  std::vector<std::thread> idle;
  for (int i = 0; i < 120; ++i)
    idle.emplace_back([&] {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stop; });
    });
  std::thread spinner([&] {
    pthread_setname_np(pthread_self(), "pacer-spin");
    volatile unsigned long x = 0;
    while (spin.load(std::memory_order_relaxed)) x = x + 1;
  });
  ThreadSampler s;
  const int pid = static_cast<int>(::getpid());
  const auto now = [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
  (void)s.sample({pid}, now());
  std::optional<ThreadRecord> r;
  // A loaded 2-core machine may hold the spinner back; a few intervals
  // give it time on a core.
  for (int i = 0; i < 20 && !(r && r->comm == "pacer-spin" && r->busy > 0.05); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    r = s.sample({pid}, now());
  }
  rusage before{}, after{};
  ::getrusage(RUSAGE_THREAD, &before);
  const int passes = 20;
  for (int i = 0; i < passes; ++i) (void)s.sample({pid}, now());
  ::getrusage(RUSAGE_THREAD, &after);
  const auto us = [](const rusage& u) {
    return 1e6 * (u.ru_utime.tv_sec + u.ru_stime.tv_sec) + static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
  };
  spin = false;
  spinner.join();
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  cv.notify_all();
  for (auto& t : idle) t.join();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->comm, "pacer-spin");
  EXPECT_FALSE(r->main);
  EXPECT_FALSE(r->python);
  EXPECT_EQ(r->pid, pid);
  EXPECT_GE(r->threads, 122u);
  EXPECT_GT(r->busy, 0.05);  // the idle threads use nothing
  std::printf("[ cost     ] %.0f us of CPU per pass over %u threads\n", (us(after) - us(before)) / passes, r->threads);
}

TEST(ThreadSampler, TheSamplerReadsThreadsOnceASecond) {
  TempDir root("threads-");
  root.file("proc/stat", "cpu  1 0 1 1 0 0 0 0 0 0\n");
  root.file("proc/100/stat", "100 (python3) S 1 100 100 0 -1 4194560 100 0 0 0 5 5 0 0 20 0 3 0 1000 1000000 10 1\n");
  task(root, 100, 100, "python3", 0, 0);
  Sampler sampler(SamplerOptions{.root = root.path(), .pid = 100, .gpus = false, .per_core = false});
  EXPECT_FALSE(sampler.sample(100.0).busiest_thread.has_value());  // the first read: no interval yet
  task(root, 100, 100, "python3", ticks() / 2, 0);
  EXPECT_FALSE(sampler.sample(100.5).busiest_thread.has_value());  // not due
  auto s = sampler.sample(101.0);
  ASSERT_TRUE(s.busiest_thread.has_value());
  EXPECT_NEAR(s.busiest_thread->busy, 0.5, 1e-9);  // half a core over the second since the first read
  SamplerOptions off{.root = root.path(), .pid = 100, .gpus = false, .per_core = false};
  off.threads = false;
  Sampler without(off);
  (void)without.sample(100.0);
  EXPECT_FALSE(without.sample(101.0).busiest_thread.has_value());
}

TEST(ThreadSampler, TheCatalogKeepsTheRecordAndAnOlderCatalogGetsTheTable) {
  TempDir dir("threads-");
  const std::string db = dir.path() + "/c.db";
  {
    auto cat = Catalog::open(db).value();
    auto run = cat->begin_run(RunInfo{"", "python3 train.py", "h", 1.0, 1.0}).value();
    auto node = cat->node_id(NodeInfo{"h", 2, 0, ""}).value();
    Sample s;
    s.t = 2.0;
    s.busiest_thread = ThreadRecord{7, 9, "python3", false, true, 0.97, 4, 1};
    ASSERT_TRUE(cat->write_sample(run, node, s));
    auto q = cat->query("SELECT pid, tid, comm, main, python, busy, threads, busy_threads FROM threads").value();
    ASSERT_EQ(q.rows.size(), 1u);
    EXPECT_EQ(std::get<std::string>(q.rows[0][2]), "python3");
    EXPECT_EQ(std::get<std::int64_t>(q.rows[0][4]), 1);
    EXPECT_DOUBLE_EQ(std::get<double>(q.rows[0][5]), 0.97);
    // A catalog of version 1 made before the table existed.
    ASSERT_TRUE(cat->query("DROP TABLE threads").has_value());
  }
  auto reopened = Catalog::open(db).value();
  EXPECT_TRUE(reopened->query("SELECT count(*) FROM threads").has_value());
  // Merged with the rest of the run.
  const std::string merged = dir.path() + "/m.db";
  {
    auto run = reopened->query("SELECT run_id FROM runs").value();
    Sample s;
    s.t = 3.0;
    s.busiest_thread = ThreadRecord{7, 7, "python3", true, true, 0.5, 4, 1};
    ASSERT_TRUE(reopened->write_sample(std::get<std::int64_t>(run.rows[0][0]), 1, s));
  }
  reopened.reset();
  ASSERT_TRUE(merge_catalogs(merged, {db}).has_value());
  auto m = Catalog::open(merged, CatalogOptions{.read_only = true}).value();
  auto q = m->query("SELECT count(*), max(main) FROM threads").value();
  EXPECT_EQ(std::get<std::int64_t>(q.rows[0][0]), 1);
  EXPECT_EQ(std::get<std::int64_t>(q.rows[0][1]), 1);
}

}  // namespace
}  // namespace pacer::telemetry
