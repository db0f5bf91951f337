// The supervisor's parsing (signals, scontrol's EndTime) and its view of committed checkpoints.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdlib>
#include <ctime>
#include <filesystem>

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
  EXPECT_NE(w.note.find("not found"), std::string::npos) << w.note;
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

}  // namespace
}  // namespace pacer::run
