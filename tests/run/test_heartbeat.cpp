// Heartbeats and the hang decision: the training side's slot, the supervisor's reading, the timeouts.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>

#include "pacer/run.hpp"
#include "run/run_internal.hpp"
#include "test_util.hpp"

namespace pacer::run {
namespace {

SlotReading beat(int local_rank, std::uint64_t count, int pid = 1000, int rank = -1) {
  SlotReading r;
  r.local_rank = local_rank;
  r.rank = rank < 0 ? local_rank : rank;
  r.pid = pid + local_rank;
  r.count = count;
  r.step = count;
  return r;
}

TEST(Heartbeat, NoHangBeforeTheTimeoutThenTheStalledRankIsNamed) {
  HangWatch w(std::optional<double>(10.0));
  EXPECT_FALSE(w.observe({beat(0, 1), beat(1, 1)}, 100));
  EXPECT_FALSE(w.observe({beat(0, 2), beat(1, 2)}, 101));
  // Rank 1 stops at count 2 (its step 2); rank 0 keeps going.
  for (double t = 102; t < 111; t += 1) EXPECT_FALSE(w.observe({beat(0, static_cast<std::uint64_t>(t)), beat(1, 2)}, t));
  auto h = w.observe({beat(0, 200), beat(1, 2)}, 111);
  ASSERT_TRUE(h);
  EXPECT_EQ(h->first.local_rank, 1);
  EXPECT_EQ(h->first.step, 2u);
  EXPECT_DOUBLE_EQ(h->idle_s, 10);
  EXPECT_FALSE(h->all_stalled);
  EXPECT_EQ(h->ranks.size(), 2u);
}

TEST(Heartbeat, AllRanksStalledNamesTheOneThatStoppedFirst) {
  HangWatch w(std::optional<double>(5.0));
  (void)w.observe({beat(0, 1), beat(1, 1)}, 0);
  (void)w.observe({beat(0, 2), beat(1, 1)}, 1);  // rank 1 stopped at t=0, rank 0 at t=1
  EXPECT_FALSE(w.observe({beat(0, 2), beat(1, 1)}, 4.9));
  auto h = w.observe({beat(0, 2), beat(1, 1)}, 6.5);
  ASSERT_TRUE(h);
  EXPECT_EQ(h->first.local_rank, 1);
  EXPECT_TRUE(h->all_stalled);
}

TEST(Heartbeat, WatchStartsAtTheFirstHeartbeatAndEndsWithTheProcess) {
  HangWatch w(std::optional<double>(1.0));
  EXPECT_FALSE(w.observe({}, 0));
  EXPECT_FALSE(w.observe({}, 100));  // nobody heartbeated yet: no hang, however long
  EXPECT_FALSE(w.observe({beat(0, 1)}, 100));
  auto ended = beat(0, 1);
  ended.alive = false;
  EXPECT_FALSE(w.observe({ended}, 200));  // its process ended: no longer watched
  // A new process in the slot (a restarted worker) starts its own clock.
  EXPECT_FALSE(w.observe({beat(0, 1, 5000)}, 300));
  EXPECT_TRUE(w.observe({beat(0, 1, 5000)}, 301.5));
}

TEST(Heartbeat, CorruptSlotsAreIgnoredAndZeroTurnsItOff) {
  HangWatch w(std::optional<double>(1.0));
  auto bad = beat(0, 1);
  bad.problem = "corrupt";
  EXPECT_FALSE(w.observe({bad}, 0));
  EXPECT_FALSE(w.observe({bad}, 50));
  HangWatch off(std::optional<double>(0.0));
  EXPECT_FALSE(off.timeout());
  EXPECT_FALSE(off.observe({beat(0, 1)}, 0));
  EXPECT_FALSE(off.observe({beat(0, 1)}, 1e6));
}

TEST(Heartbeat, DerivedTimeoutIsFiveTimesP99WithAFloor) {
  EXPECT_FALSE(derived_hang_timeout(std::vector<double>(kAutoHangAfter - 1, 1.0)));
  EXPECT_EQ(*derived_hang_timeout(std::vector<double>(kAutoHangAfter, 1.0)), kAutoHangFloorS);
  std::vector<double> v(100, 10.0);
  v[7] = 60;  // the p99 of 100 samples is the 99th smallest
  v[8] = 61;
  EXPECT_DOUBLE_EQ(*derived_hang_timeout(v), 5 * 60.0);
  // The auto watch applies it once enough intervals were seen.
  HangWatch w(std::nullopt);
  for (int i = 0; i <= kAutoHangAfter; ++i) EXPECT_FALSE(w.observe({beat(0, static_cast<std::uint64_t>(i + 1))}, i * 30.0));
  ASSERT_TRUE(w.timeout());
  EXPECT_DOUBLE_EQ(*w.timeout(), 150);
  const double last = kAutoHangAfter * 30.0;
  EXPECT_FALSE(w.observe({beat(0, kAutoHangAfter + 1)}, last + 149));
  EXPECT_TRUE(w.observe({beat(0, kAutoHangAfter + 1)}, last + 150));
}

TEST(Heartbeat, BoardSeesTheTrainingSideAndFlagsCorruptSlots) {
  test::TempDir dir("heartbeat");
  const std::string path = dir.path() + "/heartbeat";
  auto board = HeartbeatBoard::create(path);
  ASSERT_TRUE(board) << board.error().message;
  EXPECT_FALSE(HeartbeatBoard::create(path));  // never takes over an existing file
  EXPECT_TRUE(board->read().empty());
  // The training side in a child: heartbeat() keeps its state per process.
  const pid_t child = fork();
  if (child == 0) {
    setenv(kHeartbeatFileEnv, path.c_str(), 1);
    setenv("LOCAL_RANK", "3", 1);
    setenv("RANK", "11", 1);
    unsetenv("SLURM_LOCALID");
    unsetenv("SLURM_PROCID");
    bool ok = true;
    for (std::uint64_t s = 0; s < 5; ++s) ok = ok && heartbeat(s).ok();
    ok = ok && heartbeat().ok();
    _exit(ok ? 0 : 1);
  }
  // Ended but not reaped yet (a launcher busy waiting for another rank): a
  // zombie is no running rank.
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT), 0);
  auto zombie = board->read();
  ASSERT_EQ(zombie.size(), 1u);
  EXPECT_FALSE(zombie[0].alive);
  int st = 0;
  ASSERT_EQ(waitpid(child, &st, 0), child);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  auto r = board->read();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].local_rank, 3);
  EXPECT_EQ(r[0].rank, 11);
  EXPECT_EQ(r[0].pid, child);
  EXPECT_EQ(r[0].count, 6u);
  EXPECT_FALSE(r[0].step);  // the last call gave none
  EXPECT_FALSE(r[0].alive);  // reaped
  EXPECT_TRUE(r[0].problem.empty());
  // A slot whose local rank field disagrees with its index is corrupt.
  board->data()[64 + 3 * 64 + 8] = 7;
  r = board->read();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_NE(r[0].problem.find("slot 3 is corrupt"), std::string::npos) << r[0].problem;
}

TEST(Heartbeat, NothingHappensWithoutASupervisor) {
  // The test binary runs without $PACER_HEARTBEAT_FILE (it is no rank of pacer run).
  if (std::getenv(kHeartbeatFileEnv)) GTEST_SKIP() << "running under pacer run";
  EXPECT_TRUE(heartbeat(1).ok());
  EXPECT_TRUE(heartbeat().ok());
}

}  // namespace
}  // namespace pacer::run
