// Retention and prune keep valid steps: the newest step that verifies is never
// removed, damaged steps are reported and left (or removed on request), the
// step save() just committed stays, steps being read stay, and a damaged step
// is moved aside when training saves that step again.
//
// Suites: RetentionValid, RetentionHigherSteps, RetentionResave, RetentionReaders, RetentionKilledPrune.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/blob_data.hpp"
#include "checkpoint/crash_data.hpp"
#include "pacer/checkpoint.hpp"
#include "test_util.hpp"

namespace {

namespace fs = std::filesystem;
using pacer::test::flip_byte;
namespace ckpt = pacer::ckpt;
using pacer::test::contains;
using pacer::test::TempDir;

constexpr std::uint64_t kChunk = 64 << 10;

// Bytes that depend on the step, so a read shows which step it came from.
std::vector<unsigned char> data_of(std::uint64_t step, std::size_t n) {
  std::vector<unsigned char> v(n);
  pacer::test::crash::fill(step, 0, v.data(), v.size());
  return v;
}

struct Ck {
  std::unique_ptr<ckpt::Checkpointer> ck;
  std::shared_ptr<std::vector<std::string>> warnings = std::make_shared<std::vector<std::string>>();
  bool warned(const std::string& needle) const {
    for (const auto& w : *warnings)
      if (w.find(needle) != std::string::npos) return true;
    return false;
  }
  std::string all_warnings() const {
    std::string s;
    for (const auto& w : *warnings) s += "\n  " + w;
    return s;
  }
};

Ck open_ck(const std::string& root, int keep_last, int keep_every = 0) {
  ckpt::Options o;
  o.root = root;
  o.keep_last = keep_last;
  o.keep_every = keep_every;
  o.chunk_bytes = kChunk;
  o.staging_bytes = 4 * kChunk;
  o.pin_staging = false;
  Ck c;
  auto w = c.warnings;
  o.warn = [w](const std::string& s) { w->push_back(s); };
  auto ck = ckpt::Checkpointer::open(std::move(o));
  if (!ck) ADD_FAILURE() << ck.error().message;
  else c.ck = std::move(*ck);
  return c;
}

ckpt::BlobView view(const std::vector<unsigned char>& d) {
  ckpt::BlobView b;
  b.name = "w";
  b.data = d.data();
  b.size = d.size();
  return b;
}

pacer::Status save(ckpt::Checkpointer& ck, std::uint64_t step, std::size_t bytes = 200 << 10) {
  const auto d = data_of(step, bytes);
  auto h = ck.save(step, {view(d)}, {{"step", step}});
  if (!h) return h.error();
  return h->wait();
}

std::string step_path(const std::string& root, std::uint64_t step) { return root + "/" + ckpt::step_dir_name(step); }
std::string data_file(const std::string& root, std::uint64_t step) { return step_path(root, step) + "/rank-00000.bin"; }

// Steps under root, newest first, with their blob checked against data_of.
std::vector<std::uint64_t> steps_in(const std::string& root) {
  std::vector<std::uint64_t> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec))
    if (auto s = ckpt::parse_step_dir_name(e.path().filename().string())) out.push_back(*s);
  std::sort(out.rbegin(), out.rend());
  return out;
}

std::vector<std::string> damaged_dirs(const std::string& root) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec))
    if (e.path().filename().string().rfind(".damaged-", 0) == 0) out.push_back(e.path().string());
  return out;
}

// The step opens, verifies and holds data_of(step).
::testing::AssertionResult loadable(const std::string& root, std::uint64_t step, std::size_t bytes = 200 << 10) {
  auto r = ckpt::Reader::open(step_path(root, step));
  if (!r) return ::testing::AssertionFailure() << r.error().message;
  if (pacer::Status st = r->verify_all(); !st) return ::testing::AssertionFailure() << st.error().message;
  std::vector<unsigned char> got(bytes);
  if (pacer::Status st = r->read("w", got.data(), got.size()); !st) return ::testing::AssertionFailure() << st.error().message;
  if (got != data_of(step, bytes)) return ::testing::AssertionFailure() << "step " << step << " holds other bytes";
  return ::testing::AssertionSuccess();
}

// Steps 1..n written by a checkpointer that keeps everything.
void make_steps(const std::string& root, std::initializer_list<std::uint64_t> steps, std::size_t bytes = 200 << 10) {
  Ck c = open_ck(root, 0);
  ASSERT_TRUE(c.ck);
  for (auto s : steps) ASSERT_TRUE(save(*c.ck, s, bytes));
}

// ---------------------------------------------------------------------------

// The case: the newest step is damaged; `prune --keep-last 1` used to
// remove every valid step and keep only the damaged one.
TEST(RetentionValid, PruneKeepsTheNewestValidStepWhenNewerStepsAreDamaged) {
  TempDir dir("pacer-ret-");
  const std::string root = dir.path() + "/root";
  make_steps(root, {0, 1000, 1500, 2000, 2500});
  flip_byte(data_file(root, 2500), 150 << 10);                 // checksum mismatch
  fs::resize_file(data_file(root, 2000), 100);                 // truncated
  fs::remove(step_path(root, 1500) + "/" + ckpt::kManifestName);  // no manifest

  auto r = ckpt::prune(root, {.keep_last = 1});
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->newest_valid, std::optional<std::uint64_t>(1000));
  EXPECT_EQ(r->removed, std::vector<std::uint64_t>{0});
  EXPECT_EQ(r->kept, std::vector<std::uint64_t>{1000});
  ASSERT_EQ(r->damaged.size(), 3u);
  EXPECT_EQ(r->damaged[0].step, 2500u);
  EXPECT_TRUE(contains(r->damaged[0].problem, "checksum mismatch"));
  EXPECT_EQ(r->damaged[1].step, 2000u);
  EXPECT_TRUE(contains(r->damaged[1].problem, "truncated"));
  EXPECT_EQ(r->damaged[2].step, 1500u);
  EXPECT_TRUE(contains(r->damaged[2].problem, "not a committed checkpoint"));
  EXPECT_TRUE(r->removed_damaged.empty());
  // Damaged steps are the user's to look at: still there.
  EXPECT_EQ(steps_in(root), (std::vector<std::uint64_t>{2500, 2000, 1500, 1000}));
  EXPECT_TRUE(loadable(root, 1000));
  {
    Ck c = open_ck(root, 0);
    ASSERT_TRUE(c.ck);
    EXPECT_EQ(c.ck->latest(), std::optional<std::uint64_t>(1000));
  }

  // keep_last counts valid steps: with two to keep, the damaged ones do not
  // take the places.
  make_steps(root, {10, 20});
  r = ckpt::prune(root, {.keep_last = 2});
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->kept, (std::vector<std::uint64_t>{1000, 20}));
  EXPECT_EQ(r->removed, std::vector<std::uint64_t>{10});

  // Only on request do damaged steps go; the newest valid one still stays.
  r = ckpt::prune(root, {.keep_last = 1, .remove_damaged = true});
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->removed_damaged.size(), 3u);
  EXPECT_EQ(r->removed, std::vector<std::uint64_t>{20});
  EXPECT_EQ(steps_in(root), std::vector<std::uint64_t>{1000});
  EXPECT_TRUE(loadable(root, 1000));
}

TEST(RetentionValid, NothingVerifiesMeansNothingIsRemoved) {
  TempDir dir("pacer-ret-");
  const std::string root = dir.path() + "/root";
  make_steps(root, {1, 2, 3});
  for (std::uint64_t s : {1, 2, 3}) flip_byte(data_file(root, s), 10);
  auto r = ckpt::prune(root, {.keep_last = 1});
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_FALSE(r->newest_valid);
  EXPECT_TRUE(r->removed.empty());
  EXPECT_EQ(r->damaged.size(), 3u);
  EXPECT_EQ(steps_in(root), (std::vector<std::uint64_t>{3, 2, 1}));
}

TEST(RetentionValid, DryRunReportsAndChangesNothing) {
  TempDir dir("pacer-ret-");
  const std::string root = dir.path() + "/root";
  make_steps(root, {1, 2, 3, 4});
  flip_byte(data_file(root, 4), 5);
  fs::create_directory(root + "/.damaged-step-000000000002-20261201T000000Z-1");
  auto snapshot = [&] {
    std::map<std::string, std::uintmax_t> m;
    for (const auto& e : fs::recursive_directory_iterator(root))
      m[e.path().string()] = e.is_regular_file() ? e.file_size() : 0;
    return m;
  };
  const auto before = snapshot();
  auto r = ckpt::prune(root, {.keep_last = 1, .remove_damaged = true, .dry_run = true});
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->newest_valid, std::optional<std::uint64_t>(3));
  EXPECT_EQ(r->removed, (std::vector<std::uint64_t>{2, 1}));
  EXPECT_EQ(r->removed_damaged.size(), 2u);  // step 4 in place and the moved-aside step 2
  EXPECT_EQ(snapshot(), before);
}

// Automatic retention after a save: a damaged step above the new one does not
// count, is not removed, and is warned about once.
TEST(RetentionValid, AutomaticRetentionKeepsValidStepsAndLeavesDamagedOnes) {
  TempDir dir("pacer-ret-");
  const std::string root = dir.path() + "/root";
  make_steps(root, {1000, 1500});
  flip_byte(data_file(root, 1500), 100);
  Ck c = open_ck(root, 2);
  ASSERT_TRUE(c.ck);
  ASSERT_TRUE(save(*c.ck, 1001));
  ASSERT_TRUE(save(*c.ck, 1002));
  EXPECT_EQ(steps_in(root), (std::vector<std::uint64_t>{1500, 1002, 1001})) << c.all_warnings();
  EXPECT_TRUE(c.warned("step 1500")) << c.all_warnings();
  EXPECT_TRUE(c.warned("damaged")) << c.all_warnings();
  ASSERT_TRUE(save(*c.ck, 1003));
  EXPECT_EQ(steps_in(root), (std::vector<std::uint64_t>{1500, 1003, 1002}));
  EXPECT_EQ(c.ck->latest(), std::optional<std::uint64_t>(1003));
  EXPECT_TRUE(loadable(root, 1002));
}

// ---------------------------------------------------------------------------

// A restarted step counter (or a new phase) under a root that holds higher
// steps: the save just committed must survive its own retention.
TEST(RetentionHigherSteps, SaveBelowHigherStepsKeepsTheNewStepAndWarns) {
  TempDir dir("pacer-ret-");
  const std::string root = dir.path() + "/root";
  make_steps(root, {100, 200, 300});
  Ck c = open_ck(root, 3);
  ASSERT_TRUE(c.ck);
  ASSERT_TRUE(save(*c.ck, 10));
  EXPECT_TRUE(loadable(root, 10));
  EXPECT_EQ(c.ck->latest(), std::optional<std::uint64_t>(300));  // by step number
  EXPECT_TRUE(c.warned("step 300")) << c.all_warnings();
  const std::size_t warnings = c.warnings->size();
  ASSERT_TRUE(save(*c.ck, 11));
  EXPECT_TRUE(loadable(root, 11));
  EXPECT_EQ(c.warnings->size(), warnings) << "warned again about the same higher step:" << c.all_warnings();
  EXPECT_EQ(steps_in(root), (std::vector<std::uint64_t>{300, 200, 100, 11}));
  auto r = c.ck->open_reader(11);
  ASSERT_TRUE(r) << r.error().message;
}

// ---------------------------------------------------------------------------

// A load falls back past damaged step 2; training reaches step 2 again. The
// save must not fail with "already committed" (a crash loop under pacer run).
TEST(RetentionResave, DamagedStepIsMovedAsideAndSavedAgain) {
  TempDir dir("pacer-ret-");
  const std::string root = dir.path() + "/root";
  make_steps(root, {1, 2, 3});
  flip_byte(data_file(root, 2), 1000);                          // checksum
  fs::remove(step_path(root, 3) + "/" + ckpt::kManifestName);  // no manifest
  Ck c = open_ck(root, 0);
  ASSERT_TRUE(c.ck);
  EXPECT_EQ(c.ck->latest(), std::optional<std::uint64_t>(1));
  const auto bytes = data_of(102, 50 << 10);
  for (std::uint64_t s : {2, 3}) {
    SCOPED_TRACE(s);
    auto h = c.ck->save(s, {view(bytes)});
    ASSERT_TRUE(h) << h.error().message;
    ASSERT_TRUE(h->wait());
    EXPECT_TRUE(c.warned(fmt::format("step {} in {} is damaged", s, root))) << c.all_warnings();
    EXPECT_TRUE(c.warned("moved it aside")) << c.all_warnings();
  }
  EXPECT_EQ(c.ck->latest(), std::optional<std::uint64_t>(3));
  auto r = c.ck->open_reader(2);
  ASSERT_TRUE(r) << r.error().message;
  std::vector<unsigned char> got(bytes.size());
  ASSERT_TRUE(r->read("w", got.data(), got.size()));
  EXPECT_EQ(got, bytes);
  // The damaged copies are kept aside, listed as damaged, never as checkpoints.
  EXPECT_EQ(damaged_dirs(root).size(), 2u);
  int listed = 0;
  for (const auto& e : ckpt::list(root, false))
    if (e.damaged) {
      ++listed;
      EXPECT_FALSE(e.committed);
      EXPECT_GT(e.bytes, 0u);
    }
  EXPECT_EQ(listed, 2);
  // A valid step stays refused.
  auto again = c.ck->save(2, {view(bytes)});
  ASSERT_FALSE(again);
  EXPECT_TRUE(contains(again.error().message, "step 2 is already committed"));
  // prune --remove-damaged removes them.
  auto p = ckpt::prune(root, {.keep_last = 5, .remove_damaged = true});
  ASSERT_TRUE(p) << p.error().message;
  EXPECT_EQ(p->removed_damaged.size(), 2u);
  EXPECT_TRUE(damaged_dirs(root).empty());
  EXPECT_EQ(steps_in(root), (std::vector<std::uint64_t>{3, 2, 1}));
}

// ---------------------------------------------------------------------------

// A writer saving with keep_last 1 while another thread keeps loading the
// latest step: every load finds a step and reads it whole, and the steps
// retention had to skip while they were read go at a later retention.
TEST(RetentionReaders, LoadsDuringRetentionNeverFail) {
  TempDir dir("pacer-ret-");
  const std::string root = dir.path() + "/root";
  Ck w = open_ck(root, 1);
  ASSERT_TRUE(w.ck);
  constexpr std::size_t kBytes = 300 << 10;
  ASSERT_TRUE(save(*w.ck, 1, kBytes));
  std::atomic<bool> stop{false};
  std::atomic<int> loads{0}, failures{0};
  std::string first_failure;
  std::thread reader([&] {
    Ck r = open_ck(root, 0);
    if (!r.ck) return;
    while (!stop) {
      auto rd = r.ck->open_reader();
      std::string err;
      if (!rd) {
        err = rd.error().message;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the writer commits and trims meanwhile
        std::vector<unsigned char> got(kBytes);
        if (pacer::Status st = rd->read("w", got.data(), got.size()); !st) err = st.error().message;
        else if (got != data_of(rd->manifest().step, kBytes)) err = "wrong bytes";
      }
      if (!err.empty() && failures++ == 0) first_failure = err;
      ++loads;
    }
  });
  for (std::uint64_t s = 2; s <= 80; ++s) ASSERT_TRUE(save(*w.ck, s, kBytes));
  stop = true;
  reader.join();
  EXPECT_EQ(failures.load(), 0) << loads << " loads; the first failure: " << first_failure;
  EXPECT_GT(loads.load(), 5);
  ASSERT_TRUE(save(*w.ck, 81, kBytes));
  EXPECT_EQ(steps_in(root), std::vector<std::uint64_t>{81}) << "steps skipped while read are removed later";
}

// A Reader held open pins its step against prune in another process.
TEST(RetentionReaders, PruneInAnotherProcessSkipsAStepBeingRead) {
  TempDir dir("pacer-ret-");
  const std::string root = dir.path() + "/root";
  make_steps(root, {1, 2, 3});
  auto held = ckpt::Reader::open(step_path(root, 1));
  ASSERT_TRUE(held) << held.error().message;
  ckpt::Reader copy = *held;  // copies share the lock
  held = pacer::Error{pacer::ErrorKind::kUsage, "dropped"};
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto r = ckpt::prune(root, {.keep_last = 1});
    std::_Exit(r && r->removed == std::vector<std::uint64_t>{2} && r->busy == std::vector<std::uint64_t>{1} ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child's prune did not skip step 1 (status " << status << ")";
  EXPECT_EQ(steps_in(root), (std::vector<std::uint64_t>{3, 1}));
  std::vector<unsigned char> got(200 << 10);
  ASSERT_TRUE(copy.read("w", got.data(), got.size()));
  EXPECT_EQ(got, data_of(1, got.size()));
  copy = ckpt::Reader::open(step_path(root, 3)).value();  // lets go of step 1
  auto r = ckpt::prune(root, {.keep_last = 1});
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->removed, std::vector<std::uint64_t>{1});
}

// ---------------------------------------------------------------------------

// A prune SIGKILLed at every moment of its run (increasing delays until it
// finishes by itself) always leaves the newest valid step loadable, and
// never removes the damaged newer step unless asked.
TEST(RetentionKilledPrune, KilledAtAnyPointKeepsTheNewestValidStep) {
  TempDir dir("pacer-ret-");
  const std::string tmpl = dir.path() + "/template";
  constexpr std::size_t kBytes = 1 << 20;
  make_steps(tmpl, {1, 2, 3, 4, 5, 6}, kBytes);
  flip_byte(data_file(tmpl, 6), kBytes - 10);  // found only after reading the whole step
  for (bool remove_damaged : {false, true}) {
    SCOPED_TRACE(remove_damaged ? "--remove-damaged" : "damaged left");
    int killed = 0, finished = 0;
    for (int delay_us = 0; delay_us < 2'000'000 && finished < 2; delay_us += 1 + delay_us / 8) {
      const std::string root = dir.path() + "/root";
      fs::remove_all(root);
      fs::copy(tmpl, root, fs::copy_options::recursive);
      const pid_t pid = ::fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        auto r = ckpt::prune(root, {.keep_last = 1, .remove_damaged = remove_damaged});
        std::_Exit(r ? 0 : 3);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      ::kill(pid, SIGKILL);
      int status = 0;
      ASSERT_EQ(::waitpid(pid, &status, 0), pid);
      if (WIFSIGNALED(status)) ++killed;
      else {
        ASSERT_EQ(WEXITSTATUS(status), 0);
        ++finished;
      }
      SCOPED_TRACE(::testing::Message() << "killed after " << delay_us << " us");
      ASSERT_TRUE(loadable(root, 5, kBytes));
      Ck c = open_ck(root, 0);  // finishes a killed deletion
      ASSERT_TRUE(c.ck);
      EXPECT_EQ(c.ck->latest(), std::optional<std::uint64_t>(5));
      if (!remove_damaged) {
        EXPECT_TRUE(fs::exists(step_path(root, 6)));
      }
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(root, ec))
        EXPECT_NE(e.path().filename().string().rfind(".deleting-", 0), 0u) << e.path();
    }
    EXPECT_GT(killed, 3);
    EXPECT_EQ(finished, 2) << "the prune never finished";
    std::printf("[ prune    ] %d prunes killed before they finished\n", killed);
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Leftover .partial-* directories of savers on other hosts (a node that died):
// removed once a step at or after theirs is committed and nothing in them
// changed for the staleness window; never one a live saver may be filling.

namespace {

std::string this_host() {
  char buf[256] = {};
  ::gethostname(buf, sizeof(buf) - 1);
  return buf;
}

// A partial directory holding one file, both last modified `age` ago.
std::string make_partial(const std::string& root, std::uint64_t step, const std::string& host, int pid,
                         std::chrono::seconds age) {
  const std::string p = fmt::format("{}/.partial-{}-{}-{}-0000beef", root, ckpt::step_dir_name(step), host, pid);
  fs::create_directories(p);
  std::ofstream(p + "/rank-00000.bin") << "half a save";
  const auto t = fs::file_time_type::clock::now() - age;
  fs::last_write_time(p + "/rank-00000.bin", t);
  fs::last_write_time(p, t);
  return p;
}

}  // namespace

TEST(RetentionPartials, PruneRemovesOnlyPartialsNoSaverCanStillFill) {
  TempDir dir("pacer-ret-");
  const std::string root = dir.path() + "/root";
  make_steps(root, {4, 5});
  const auto old = std::chrono::hours(2);
  const std::string dead_node = make_partial(root, 3, "node-dead", 4242, old);
  const std::string same_step = make_partial(root, 5, "node-dead", 4243, old);  // lost the race for step 5
  const std::string fresh = make_partial(root, 3, "node-busy", 4242, std::chrono::seconds(5));
  const std::string newer = make_partial(root, 6, "node-dead", 4244, old);  // the next step: maybe still being written
  const std::string live_here = make_partial(root, 3, this_host(), ::getpid(), old);
  const std::string dead_here = make_partial(root, 3, this_host(), 999999999, std::chrono::seconds(0));
  // A file written just now inside an old directory: a saver is still at work.
  const std::string touched = make_partial(root, 3, "node-slow", 4245, old);
  std::ofstream(touched + "/rank-00000.bin", std::ios::app) << "more";
  fs::last_write_time(touched, fs::file_time_type::clock::now() - old);

  auto names = [](const std::vector<ckpt::Entry>& v) {
    std::vector<std::string> out;
    for (const auto& e : v) out.push_back(e.path);
    std::sort(out.begin(), out.end());
    return out;
  };
  std::vector<std::string> stale = {dead_node, same_step, dead_here};
  std::sort(stale.begin(), stale.end());

  auto r = ckpt::prune(root, {.keep_last = 5, .dry_run = true});
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(names(r->removed_partial), stale);
  for (const auto& p : {dead_node, same_step, fresh, newer, live_here, dead_here, touched}) EXPECT_TRUE(fs::exists(p)) << p;
  const auto j = ckpt::to_json(*r, root, true);
  ASSERT_EQ(j["removed_partial"].size(), 3u);
  for (const auto& e : r->removed_partial) {
    EXPECT_TRUE(e.partial);
    EXPECT_EQ(e.step, e.path == same_step ? 5u : 3u);
    EXPECT_TRUE(contains(e.problem, e.path == dead_here ? "is gone" : "nothing in it changed")) << e.problem;
  }

  r = ckpt::prune(root, {.keep_last = 5});
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(names(r->removed_partial), stale);
  for (const auto& p : stale) EXPECT_FALSE(fs::exists(p)) << p;
  for (const auto& p : {fresh, newer, live_here, touched}) EXPECT_TRUE(fs::exists(p)) << p;
  EXPECT_EQ(steps_in(root), (std::vector<std::uint64_t>{5, 4}));
  EXPECT_TRUE(loadable(root, 5));

  // A shorter window makes the fresh one stale too; the live saver's and the
  // next step's stay whatever the window.
  r = ckpt::prune(root, {.keep_last = 5, .stale_partial_s = 1});
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_FALSE(fs::exists(fresh));
  EXPECT_TRUE(fs::exists(newer));
  EXPECT_TRUE(fs::exists(live_here));
}

TEST(RetentionPartials, WithoutACommittedStepOtherHostsPartialsStay) {
  TempDir dir("pacer-ret-");
  const std::string root = dir.path() + "/root";
  fs::create_directories(root);
  const std::string p = make_partial(root, 3, "node-dead", 4242, std::chrono::hours(48));
  auto r = ckpt::prune(root, {.keep_last = 1});
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_TRUE(r->removed_partial.empty());
  EXPECT_TRUE(fs::exists(p));
}

// The Checkpointer applies the same rule when it opens and after each save's
// retention, with a warning naming what it removed.
TEST(RetentionPartials, CheckpointerRemovesStalePartialsOfOtherHosts) {
  TempDir dir("pacer-ret-");
  const std::string root = dir.path() + "/root";
  make_steps(root, {4});
  const std::string at_open = make_partial(root, 3, "node-dead", 4242, std::chrono::hours(2));
  const std::string fresh = make_partial(root, 3, "node-busy", 4242, std::chrono::seconds(5));
  Ck c = open_ck(root, 3);
  ASSERT_TRUE(c.ck);
  EXPECT_FALSE(fs::exists(at_open));
  EXPECT_TRUE(fs::exists(fresh));
  EXPECT_TRUE(c.warned(at_open)) << c.all_warnings();
  const std::string later = make_partial(root, 4, "node-dead", 4243, std::chrono::hours(2));
  ASSERT_TRUE(save(*c.ck, 5));
  EXPECT_FALSE(fs::exists(later));
  EXPECT_TRUE(fs::exists(fresh));
  EXPECT_TRUE(c.warned(later)) << c.all_warnings();
}
