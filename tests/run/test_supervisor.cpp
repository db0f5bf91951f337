// The supervisor's parsing (signals, scontrol's EndTime) and its view of committed checkpoints.
#include <gtest/gtest.h>
#include <signal.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "pacer/checkpoint.hpp"
#include "pacer/run.hpp"
#include "test_util.hpp"

namespace pacer::run {
namespace {

TEST(Run, ParsesSignalNames) {
  EXPECT_EQ(*parse_signal("USR1"), SIGUSR1);
  EXPECT_EQ(*parse_signal("sigusr2"), SIGUSR2);
  EXPECT_EQ(*parse_signal("SIGTERM"), SIGTERM);
  EXPECT_EQ(*parse_signal("10"), SIGUSR1);
  EXPECT_FALSE(parse_signal("KILL"));
  EXPECT_EQ(parse_signal("STOP").error().kind, ErrorKind::kUsage);
  EXPECT_EQ(signal_name(SIGUSR1), "SIGUSR1");
}

TEST(Run, ParsesScontrolEndTimeAsLocalTime) {
  const std::string text =
      "JobId=42 JobName=train\n   RunTime=00:00:10 TimeLimit=00:01:00 TimeMin=N/A\n"
      "   SubmitTime=2026-11-29T10:00:00 EligibleTime=2026-11-29T10:00:00\n"
      "   StartTime=2026-11-29T10:00:01 EndTime=2026-11-29T10:01:01 Deadline=N/A\n";
  std::tm tm{};
  tm.tm_year = 126;
  tm.tm_mon = 10;
  tm.tm_mday = 29;
  tm.tm_hour = 10;
  tm.tm_min = 1;
  tm.tm_sec = 1;
  tm.tm_isdst = -1;
  EXPECT_EQ(parse_scontrol_end_time(text), static_cast<double>(std::mktime(&tm)));
  EXPECT_FALSE(parse_scontrol_end_time("JobId=42 EndTime=Unknown Deadline=N/A"));
  EXPECT_FALSE(parse_scontrol_end_time("slurm_load_jobs error: Invalid job id specified"));
}

TEST(Run, WalltimeFromEnvironmentOrBare) {
  setenv("SLURM_JOB_END_TIME", "1900000000", 1);
  auto w = learn_walltime("/nonexistent/scontrol");
  EXPECT_EQ(w.source, WalltimeSource::kEnv);
  EXPECT_EQ(w.end_time, 1900000000.0);
  unsetenv("SLURM_JOB_END_TIME");
  unsetenv("SLURM_JOB_ID");
  w = learn_walltime("/nonexistent/scontrol");
  EXPECT_FALSE(w.end_time);
  EXPECT_NE(w.note.find("SLURM_JOB_ID unset"), std::string::npos);
  setenv("SLURM_JOB_ID", "17", 1);
  w = learn_walltime("/nonexistent/scontrol");
  EXPECT_FALSE(w.end_time);
  EXPECT_NE(w.note.find("/nonexistent/scontrol: cannot run: not found"), std::string::npos) << w.note;
  unsetenv("SLURM_JOB_ID");
}

TEST(Run, LatestCommittedStepComesFromTheCheckpointLibrary) {
  test::TempDir dir("run-latest-");
  EXPECT_FALSE(latest_committed_step(dir.path()));
  EXPECT_FALSE(latest_committed_step(""));
  ckpt::Options o;
  o.root = dir.path();
  o.keep_last = 0;
  o.chunk_bytes = 4096;
  o.staging_bytes = 1 << 20;
  auto ck = unwrap(ckpt::Checkpointer::open(o));
  std::vector<float> w(100, 1.0f);
  for (std::uint64_t step : {5, 12}) {
    ckpt::BlobView b;
    b.name = "w";
    b.data = w.data();
    b.size = w.size() * 4;
    b.dtype = "float32";
    b.shape = {100};
    unwrap(unwrap(ck->save(step, {b})).wait());
  }
  EXPECT_EQ(latest_committed_step(dir.path()), 12u);
  // A step directory without its manifest is not committed.
  std::filesystem::create_directory(std::filesystem::path(dir.path()) / ckpt::step_dir_name(20));
  EXPECT_EQ(latest_committed_step(dir.path()), 12u);
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

double unix_now() { return static_cast<double>(std::time(nullptr)); }

// A request file another user could plant at the old, predictable default
// ($TMPDIR/pacer-run-<pid>.ckpt-request) must not reach CMD: the default
// lives in a mode-0700 directory of its own that pacer made.
// The vet before CMD is the caller's callback: a failed verdict keeps CMD from
// starting and names the failed checks; a passing one lets CMD run.
TEST(Run, VetQuickCallbackGatesTheStart) {
  test::TempDir tmp("run-vet-gate-");
  unsetenv("SLURM_JOB_ID");
  const std::string marker = tmp.path() + "/started";
  Options o;
  o.argv = {"touch", marker};
  o.restart_delay_s = 0;
  int calls = 0;
  o.vet_quick = [&]() -> Expected<VetQuickVerdict> {
    ++calls;
    return VetQuickVerdict{false, "failed: gpu.count", {"gpu.count"}};
  };
  auto r = supervise(o);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(r->exit_code, 1);
  EXPECT_NE(r->reason.find("failed: gpu.count"), std::string::npos) << r->reason;
  EXPECT_NE(r->reason.find("CMD not started"), std::string::npos) << r->reason;
  EXPECT_FALSE(std::filesystem::exists(marker));

  o.vet_quick = []() -> Expected<VetQuickVerdict> { return VetQuickVerdict{true, "passed (3 checks)", {}}; };
  r = supervise(o);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->exit_code, 0) << r->reason;
  EXPECT_TRUE(std::filesystem::exists(marker));
}

TEST(Run, RequestFileLivesInAPrivateDirectory) {
  test::TempDir tmp("run-request-");
  test::TempDir out("run-request-out-");
  setenv("TMPDIR", tmp.path().c_str(), 1);
  unsetenv("XDG_RUNTIME_DIR");
  unsetenv("SLURM_TMPDIR");
  unsetenv("SLURM_JOB_ID");
  const std::string planted = tmp.file(fmt::format("pacer-run-{}.ckpt-request", getpid()), "{}\n");
  const std::string report = out.path() + "/report";
  Options o;
  // CMD reports its request file's directory, then whether a request is there
  // before one was made (it must not be), then waits for the real one.
  o.argv = {"sh", "-c",
            "f=\"$PACER_CKPT_REQUEST_FILE\"; d=$(dirname \"$f\"); stat -c '%a %u' \"$d\" > \"$0\"; echo \"$f\" >> \"$0\"; "
            "test -e \"$f\" && { echo early >> \"$0\"; exit 7; }; "
            "for i in $(seq 300); do test -e \"$f\" && { echo asked >> \"$0\"; exit 0; }; sleep 0.05; done; exit 9",
            report};
  // The request comes about 3 s in: far enough that a slow start (the
  // sanitized build on a loaded machine) is not already inside the window,
  // which asks at once.
  o.end_time = unix_now() + 8;
  o.before_s = 5;
  o.grace_s = 10;
  o.restart_delay_s = 0;
  auto r = supervise(o);
  unsetenv("TMPDIR");
  ASSERT_TRUE(r) << r.error().message;
  const std::string text = slurp(report);
  EXPECT_EQ(r->exit_code, 0) << r->reason << "\n" << text;
  std::istringstream lines(text);
  std::string mode, uid, path, seen;
  lines >> mode >> uid >> path >> seen;
  EXPECT_EQ(mode, "700");
  EXPECT_EQ(uid, std::to_string(geteuid()));
  EXPECT_NE(path, planted);
  EXPECT_TRUE(path.starts_with(tmp.path() + "/pacer-run-")) << path;
  EXPECT_EQ(seen, "asked");
  // Nothing of the run is left; the planted file is not pacer's to remove.
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(path).parent_path()));
  EXPECT_TRUE(std::filesystem::exists(planted));
}

TEST(Run, RequestFileInADirectoryOthersCanWriteIsRefused) {
  test::TempDir tmp("run-request-");
  const std::string open_dir = tmp.path() + "/open";
  std::filesystem::create_directory(open_dir);
  ::chmod(open_dir.c_str(), 0777);  // writable by all, not sticky
  Options o;
  o.argv = {"true"};
  o.request_file = open_dir + "/req";
  auto r = supervise(o);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().kind, ErrorKind::kUsage);
  EXPECT_TRUE(test::contains(r.error().message, "writable by other users"));
  // Sticky (as /tmp is), or private: accepted.
  ::chmod(open_dir.c_str(), 01777);
  r = supervise(o);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->exit_code, 0);
  // Something at the request path that cannot be removed (another user's
  // file in a sticky directory; here a directory): CMD would see a request
  // nobody made, so it is not started.
  std::filesystem::create_directory(o.request_file);
  o.argv = {"sh", "-c", "exit 9"};
  r = supervise(o);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->exit_code, static_cast<int>(ExitCode::kRuntime));
  EXPECT_EQ(r->attempts, 0);
  EXPECT_TRUE(test::contains(r->reason, "cannot be removed")) << r->reason;
}

// In a child process: a private mount namespace (a user namespace too when
// not root) with a 1 MiB tmpfs at `dir`. false where the system allows neither.
bool mount_small_tmpfs(const std::string& dir) {
  const uid_t uid = geteuid();
  const gid_t gid = getegid();
  if (uid == 0) {
    if (unshare(CLONE_NEWNS) != 0) return false;
  } else {
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) return false;
    std::ofstream("/proc/self/setgroups") << "deny";
    std::ofstream("/proc/self/uid_map") << fmt::format("0 {} 1", uid);
    std::ofstream("/proc/self/gid_map") << fmt::format("0 {} 1", gid);
  }
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return false;
  return mount("pacer-test", dir.c_str(), "tmpfs", 0, "size=1m") == 0;
}

// CMD fills the disk the log is on, exactly: every block, and the log's last
// block to its end. The lines that record how it ended must still be written.
TEST(Run, ExitCodeIsLoggedWhenCmdFillsTheDisk) {
  test::TempDir dir("run-full-");
  const std::string log = dir.path() + "/run.jsonl";
  constexpr int kSkip = 77;
  const pid_t child = fork();
  if (child == 0) {
    if (!mount_small_tmpfs(dir.path())) _exit(kSkip);
    Options o;
    o.log_path = log;
    o.argv = {"sh", "-c",
              "cat /dev/zero > \"$(dirname \"$0\")/fill\" 2>/dev/null; "
              "s=$(stat -c %s \"$0\"); p=$(( (4096 - s % 4096) % 4096 )); "
              "if [ $p -gt 0 ]; then head -c $((p - 1)) /dev/zero | tr '\\0' ' ' >> \"$0\"; echo >> \"$0\"; fi; exit 3",
              log};
    o.max_restarts = 0;
    auto r = supervise(o);
    const std::string text = slurp(log);
    std::fprintf(stderr, "%s", text.c_str());
    // The run's record: the exit of CMD and the decision after it, whole lines.
    const bool ok = r && r->exit_code == 3 && text.find("\"event\":\"exited\"") != std::string::npos &&
                    text.find("\"exit_code\":3") != std::string::npos &&
                    text.find("\"event\":\"give-up\"") != std::string::npos && text.ends_with("}\n");
    _exit(ok ? 0 : 1);
  }
  int st = 0;
  waitpid(child, &st, 0);
  ASSERT_TRUE(WIFEXITED(st));
  if (WEXITSTATUS(st) == kSkip) GTEST_SKIP() << "no tmpfs in a private mount namespace here";
  EXPECT_EQ(WEXITSTATUS(st), 0) << "the log lost how the run ended (its text is above)";
}

}  // namespace
}  // namespace pacer::run
