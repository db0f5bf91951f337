// run_vet end to end: selection, child-process isolation, timeouts, crashes,
// injections, storage safety and baselines, with the real probes.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <filesystem>
#include <set>
#include <string>

#include "pacer/core/atomic_file.hpp"
#include "pacer/hw/system.hpp"
#include "pacer/vet/vet.hpp"
#include "test_util.hpp"
#include "vet/probes.hpp"

namespace fs = std::filesystem;
using pacer::ErrorKind;
using pacer::test::TempDir;
using pacer::vet::CheckResult;
using pacer::vet::CheckStatus;
using pacer::vet::VetOptions;

namespace {

const CheckResult* find(const pacer::vet::VetReport& r, const std::string& name, const std::string& target = "") {
  for (const auto& c : r.checks)
    if (c.name == name && (target.empty() || c.target == target)) return &c;
  return nullptr;
}

pacer::vet::Injection inject(const std::string& spec) { return pacer::vet::parse_injection(spec).value(); }

}  // namespace

TEST(Runner, OnlySelectsByNameAndCategory) {
  VetOptions o;
  o.quick = true;
  o.only = {"system.nofile"};
  auto r = pacer::vet::run_vet(o);
  ASSERT_TRUE(r) << r.error().message;
  ASSERT_EQ(r->checks.size(), 1u);
  EXPECT_EQ(r->checks[0].name, "system.nofile");
  EXPECT_TRUE(r->checks[0].value.has_value());

  o.only = {"software"};
  o.skip = {"software.mpi"};
  r = pacer::vet::run_vet(o);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_NE(find(*r, "software.kernel"), nullptr);
  EXPECT_EQ(find(*r, "software.mpi"), nullptr);
  EXPECT_FALSE(r->versions.at("kernel").empty());
}

TEST(Runner, UnknownNamesAreUsageErrors) {
  VetOptions o;
  o.only = {"system.nope"};
  auto r = pacer::vet::run_vet(o);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().kind, ErrorKind::kUsage);
  EXPECT_NE(r.error().message.find("system.nope"), std::string::npos);

  auto inj = pacer::vet::parse_injection("gpu.bogus=hang");
  ASSERT_FALSE(inj);
  EXPECT_NE(inj.error().message.find("gpu.bogus"), std::string::npos);
  EXPECT_FALSE(pacer::vet::parse_injection("system.nofile=sideways"));
  EXPECT_FALSE(pacer::vet::parse_injection("system.nofile"));
}

TEST(Runner, HungCheckTimesOutAndOthersStillRun) {
  TempDir dir("pacer-runner-");
  // The short timeout is the hung check's alone: system.clocksource keeps its own, so that a fork slowed
  // by a busy machine cannot time it out too.
  const std::string prof = dir.file("hang.toml",
                                    "[checks.\"system.nofile\"]\n"
                                    "timeout = \"500ms\"\n");
  VetOptions o;
  o.profile = prof;
  o.quick = true;
  o.only = {"system.nofile", "system.clocksource"};
  o.injections = {inject("system.nofile=hang")};
  auto r = pacer::vet::run_vet(o);
  ASSERT_TRUE(r) << r.error().message;
  const CheckResult* hung = find(*r, "system.nofile");
  ASSERT_NE(hung, nullptr);
  EXPECT_EQ(hung->status, CheckStatus::kError);
  EXPECT_NE(hung->reason.find("timed out after 500 ms"), std::string::npos) << hung->reason;
  const CheckResult* other = find(*r, "system.clocksource");
  ASSERT_NE(other, nullptr);
  EXPECT_NE(other->status, CheckStatus::kError);
  EXPECT_EQ(r->verdict(), "fail");
  EXPECT_EQ(pacer::vet::exit_code(*r), pacer::ExitCode::kCheckFailed);
}

TEST(Runner, ProfileTimeoutAppliesToItsCheck) {
  TempDir dir("pacer-runner-");
  const std::string prof = dir.file("slow.toml",
                                    "[checks.\"system.load\"]\n"
                                    "timeout = \"200ms\"\n"
                                    "window = \"5s\"\n");
  VetOptions o;
  o.profile = prof;
  o.only = {"system.load"};
  auto r = pacer::vet::run_vet(o);
  ASSERT_TRUE(r) << r.error().message;
  ASSERT_EQ(r->checks.size(), 1u);
  EXPECT_EQ(r->checks[0].status, CheckStatus::kError);
  EXPECT_NE(r->checks[0].reason.find("timed out after 200 ms"), std::string::npos) << r->checks[0].reason;
}

TEST(Runner, CrashingProbeIsAnErrorNotACrash) {
  VetOptions o;
  o.only = {"system.thp"};
  o.only = {"system.thp_enabled", "system.thp_defrag"};
  o.injections = {inject("system.thp_enabled=crash")};
  auto r = pacer::vet::run_vet(o);
  ASSERT_TRUE(r) << r.error().message;
  ASSERT_EQ(r->checks.size(), 2u);  // both checks of the crashed probe are reported
  for (const auto& c : r->checks) {
    EXPECT_EQ(c.status, CheckStatus::kError);
    EXPECT_NE(c.reason.find("crashed"), std::string::npos) << c.reason;
  }
}

TEST(Runner, InjectedValueIsJudgedByTheProfile) {
  VetOptions o;
  o.only = {"system.nofile"};
  o.injections = {inject("system.nofile=100")};
  auto r = pacer::vet::run_vet(o);
  ASSERT_TRUE(r) << r.error().message;
  ASSERT_EQ(r->checks.size(), 1u);
  EXPECT_EQ(r->checks[0].status, CheckStatus::kFail);
  EXPECT_DOUBLE_EQ(*r->checks[0].value, 100);
  EXPECT_EQ(r->injections.size(), 1u);
  EXPECT_EQ(pacer::vet::to_json(*r)["injections"][0]["check"], "system.nofile");
}

TEST(Runner, MissingStoragePathFailsWhileOthersRun) {
  TempDir good("pacer-runner-");
  VetOptions o;
  o.quick = true;
  o.only = {"storage.free", "storage.metadata"};
  o.storage_paths = {good.path(), good.path() + "/does/not/exist"};
  auto r = pacer::vet::run_vet(o);
  ASSERT_TRUE(r) << r.error().message;
  const CheckResult* ok = find(*r, "storage.metadata", fs::canonical(good.path()).string());
  ASSERT_NE(ok, nullptr);
  EXPECT_EQ(ok->status, CheckStatus::kPass) << ok->reason;
  int missing = 0;
  for (const auto& c : r->checks) {
    if (c.target.find("does/not/exist") == std::string::npos) continue;
    ++missing;
    EXPECT_EQ(c.status, CheckStatus::kFail);
    EXPECT_NE(c.reason.find("does not exist"), std::string::npos) << c.reason;
  }
  EXPECT_EQ(missing, 2);
  EXPECT_EQ(good.entries(), std::set<std::string>{}) << "scratch files left behind";
}

TEST(Runner, NearlyFullFilesystemFailsBeforeWriting) {
  TempDir dir("pacer-runner-");
  // A reserve larger than any disk: the probe must refuse to write at all.
  const std::string prof = dir.file("full.toml", "[storage]\nreserve = \"1000000TiB\"\n");
  TempDir target("pacer-runner-");
  VetOptions o;
  o.profile = prof;
  o.only = {"storage.write", "storage.read"};
  o.storage_paths = {target.path()};
  auto r = pacer::vet::run_vet(o);
  ASSERT_TRUE(r) << r.error().message;
  ASSERT_EQ(r->checks.size(), 2u);
  for (const auto& c : r->checks) {
    EXPECT_EQ(c.status, CheckStatus::kFail);
    EXPECT_NE(c.reason.find("not tested"), std::string::npos) << c.reason;
  }
  EXPECT_EQ(target.entries(), std::set<std::string>{});
}

TEST(Runner, StorageThroughputWritesBoundedAmountAndCleansUp) {
  TempDir dir("pacer-runner-");
  const std::string prof = dir.file("small.toml", "[storage]\nsize = \"8MiB\"\nblock = \"1MiB\"\nreserve = \"0\"\n");
  TempDir target("pacer-runner-");
  VetOptions o;
  o.profile = prof;
  o.only = {"storage.write", "storage.read"};
  o.storage_paths = {target.path()};
  auto r = pacer::vet::run_vet(o);
  ASSERT_TRUE(r) << r.error().message;
  const CheckResult* w = find(*r, "storage.write");
  const CheckResult* rd = find(*r, "storage.read");
  ASSERT_NE(w, nullptr);
  ASSERT_NE(rd, nullptr);
  EXPECT_EQ(w->status, CheckStatus::kPass) << w->reason;
  EXPECT_EQ(rd->status, CheckStatus::kPass) << rd->reason;
  EXPECT_GT(*w->value, 0);
  EXPECT_NE(w->reason.find("8 MiB"), std::string::npos) << w->reason;
  EXPECT_EQ(target.entries(), std::set<std::string>{});
}

TEST(Runner, HungStorageProbeLeavesNoScratch) {
  TempDir target("pacer-runner-");
  VetOptions o;
  o.only = {"storage.metadata"};
  o.storage_paths = {target.path()};
  o.timeout_s = 0.3;
  o.injections = {inject("storage.metadata=hang")};
  auto r = pacer::vet::run_vet(o);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->checks.at(0).status, CheckStatus::kError);
  EXPECT_EQ(target.entries(), std::set<std::string>{});
}

namespace {
// A pid that no process has: a child that has exited and been reaped.
pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  ::waitpid(pid, nullptr, 0);
  return pid;
}
}  // namespace

TEST(Runner, StaleScratchOfDeadRunsOnThisHostIsRemoved) {
  TempDir target("pacer-runner-");
  const std::string host = pacer::hw::hostname();
  const pid_t dead = dead_pid();
  auto plant = [&](const std::string& name) {
    fs::create_directories(fs::path(target.path()) / name / "sub");
    target.file(name + "/sub/sequential.dat", "left by a killed run");
  };
  const std::string stale = pacer::vet::scratch_prefix("storage.throughput", dead, host) + ".abc123";
  const std::string alive = pacer::vet::scratch_prefix("storage.throughput", ::getpid(), host) + ".abc123";
  const std::string elsewhere = pacer::vet::scratch_prefix("storage.throughput", dead, host + "-other") + ".abc123";
  const std::string old_name = fmt::format(".pacer-vet-storage.throughput-{}.abc123", dead);
  for (const auto& n : {stale, alive, elsewhere, old_name}) plant(n);
  target.file(pacer::vet::scratch_prefix("storage.free", dead, host) + ".file00", "not a directory");

  const auto removed = pacer::vet::remove_stale_scratch(target.path(), host);
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(fs::path(removed[0]).filename().string(), stale);
  EXPECT_EQ(target.entries().count(stale), 0u);
  for (const auto& n : {alive, elsewhere, old_name}) EXPECT_EQ(target.entries().count(n), 1u) << n;
}

TEST(Runner, ScratchOfAKilledVetIsRemovedByTheNextRun) {
  TempDir target("pacer-runner-");
  VetOptions killed;
  killed.only = {"storage.write"};
  killed.storage_paths = {target.path()};
  killed.timeout_s = 60;
  killed.injections = {inject("storage.write=hang")};
  const pid_t child = ::fork();
  if (child == 0) {
    // Never back into the test runner, whatever happens here.
    try {
      (void)pacer::vet::run_vet(killed);
    } catch (...) {
    }
    ::_exit(0);
  }
  bool made = false;
  for (int i = 0; i < 200 && !made; ++i) {
    for (const auto& e : target.entries()) made = made || e.starts_with(".pacer-vet-");
    if (!made) ::usleep(50'000);
  }
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ASSERT_TRUE(made) << "the killed vet made no scratch directory";
  ASSERT_EQ(target.entries().size(), 1u);  // what a SIGKILLed vet leaves
  EXPECT_NE(target.entries().begin()->find(fmt::format("-{}@{}.", child, pacer::hw::hostname())), std::string::npos)
      << *target.entries().begin();

  VetOptions o;
  o.only = {"storage.free"};
  o.storage_paths = {target.path()};
  auto r = pacer::vet::run_vet(o);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(target.entries(), std::set<std::string>{});
}

TEST(Runner, BaselineTurnsThresholdsRelative) {
  TempDir dir("pacer-runner-");
  VetOptions o;
  o.only = {"cpu.flops"};
  o.injections = {inject("cpu.flops=100")};
  auto good = pacer::vet::run_vet(o);
  ASSERT_TRUE(good) << good.error().message;
  const std::string base = dir.path() + "/baseline.json";
  ASSERT_TRUE(pacer::write_file_atomic(base, pacer::vet::to_json(*good).dump()));

  o.baseline_path = base;
  o.injections = {inject("cpu.flops=85")};  // 85% of baseline: below the default 90%
  auto slow = pacer::vet::run_vet(o);
  ASSERT_TRUE(slow) << slow.error().message;
  const CheckResult* c = find(*slow, "cpu.flops");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->status, CheckStatus::kFail) << c->reason;
  ASSERT_TRUE(c->baseline);
  EXPECT_DOUBLE_EQ(*c->baseline, 100);

  o.injections = {inject("cpu.flops=93")};  // between fail and warn ratios
  auto meh = pacer::vet::run_vet(o);
  ASSERT_TRUE(meh);
  EXPECT_EQ(find(*meh, "cpu.flops")->status, CheckStatus::kWarn);

  o.baseline_path = dir.file("bad.json", "{\"checks\": 3}");
  auto bad = pacer::vet::run_vet(o);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().kind, ErrorKind::kConfig);
}

TEST(Runner, QuickRunOfEveryCheckFinishesWithAVerdict) {
  TempDir target("pacer-runner-");
  VetOptions o;
  o.quick = true;
  o.storage_paths = {target.path()};
  auto r = pacer::vet::run_vet(o);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_GT(r->checks.size(), 25u);
  for (const auto& c : r->checks) {
    EXPECT_NE(c.status, CheckStatus::kError) << c.name << ": " << c.reason;
    if (c.category == "gpu" && c.status == CheckStatus::kSkip) {
      EXPECT_FALSE(c.reason.empty());
    }
  }
  EXPECT_EQ(target.entries(), std::set<std::string>{});
}

// The forked child that GPU work runs in: early data reaches the parent
// while the child still runs (how an NCCL unique id leaves the process that
// must keep living), an exception stays in the child, and a deadline kills it.
TEST(RunForked, EarlyDataReachesTheParentBeforeTheChildEnds) {
  std::vector<std::string> seen;
  const auto f = pacer::vet::run_forked(
      [] {
        pacer::vet::fork_emit("id\n");
        ::usleep(300'000);
        return std::string("result");
      },
      10, [&](const std::string& so_far) { seen.push_back(so_far); });
  EXPECT_TRUE(f.error.empty()) << f.error;
  EXPECT_EQ(f.data, "id\nresult");
  ASSERT_GE(seen.size(), 2u);
  EXPECT_EQ(seen.front(), "id\n");  // the 300 ms pause separates the two writes
  EXPECT_EQ(seen.back(), "id\nresult");
}

TEST(RunForked, ExceptionsAndDeadlinesAreErrors) {
  const auto threw = pacer::vet::run_forked([]() -> std::string { throw std::runtime_error("no NCCL here"); }, 10);
  EXPECT_EQ(threw.error, "threw: no NCCL here");
  const auto hung = pacer::vet::run_forked(
      [] {
        ::sleep(30);
        return std::string("late");
      },
      0.3);
  EXPECT_EQ(hung.error.rfind("timed out after", 0), 0u) << hung.error;
  EXPECT_LT(hung.duration_s, 5);
}
