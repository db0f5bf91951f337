// Reliability of checkpoints: crash consistency under SIGKILL, detection of
// corrupt data and manifests, full and read-only disks, several savers on one
// root, and saves issued while earlier ones are still being written.
//
// Suites: CrashConsistency, ReliabilityCorruption, DiskFull, ReliabilityTiers,
// ReliabilityReadOnly, ConcurrentSavers, ReliabilityOverlap.
#include <fcntl.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/blob_data.hpp"
#include "checkpoint/crash_data.hpp"
#include "pacer/checkpoint.hpp"
#include "test_util.hpp"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using pacer::test::flip_byte;
namespace ckpt = pacer::ckpt;
namespace crash = pacer::test::crash;
using pacer::test::contains;
using pacer::test::TempDir;

// ---------------------------------------------------------------------------
// Helpers.

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Deterministic bytes for the tests' own blobs.
std::vector<unsigned char> pattern(std::uint64_t seed, std::size_t n) {
  std::vector<unsigned char> v(n);
  crash::fill(seed, 7, v.data(), v.size());
  return v;
}

ckpt::BlobView view(const std::string& name, const std::vector<unsigned char>& data) {
  ckpt::BlobView v;
  v.name = name;
  v.data = data.data();
  v.size = data.size();
  return v;
}

// The whole logical blob `name`, or the read's error message.
std::pair<std::vector<unsigned char>, std::string> read_blob(ckpt::Reader& r, const std::string& name) {
  std::uint64_t size = 0;
  bool found = false;
  for (const auto& l : r.logical_blobs())
    if (l.name == name) {
      size = l.size;
      found = true;
    }
  if (!found) return {{}, "no blob named " + name};
  std::vector<unsigned char> out(size);
  pacer::Status st = r.read(name, out.data(), size);
  if (!st) return {{}, st.error().message};
  return {std::move(out), ""};
}

// The reader holds crash-writer step `step`: manifest step, meta, every blob's
// name, dtype, shape and bytes; and, when given, the writer pid in the meta.
::testing::AssertionResult holds_crash_step(ckpt::Reader& r, std::uint64_t step, std::optional<long> pid = std::nullopt) {
  const ckpt::Manifest& m = r.manifest();
  if (m.step != step) return ::testing::AssertionFailure() << r.dir() << ": manifest step " << m.step << ", want " << step;
  if (!m.meta.is_object() || !m.meta.contains("step") || m.meta["step"] != step)
    return ::testing::AssertionFailure() << r.dir() << ": meta " << m.meta.dump() << " does not say step " << step;
  if (pid && (!m.meta.contains("pid") || m.meta["pid"] != *pid))
    return ::testing::AssertionFailure() << r.dir() << ": meta " << m.meta.dump() << ", want pid " << *pid;
  const auto logical = r.logical_blobs();
  if (logical.size() != static_cast<std::size_t>(crash::kBlobs))
    return ::testing::AssertionFailure() << r.dir() << ": " << logical.size() << " blobs, want " << crash::kBlobs;
  for (int i = 0; i < crash::kBlobs; ++i) {
    const std::string name = crash::blob_name(i);
    const ckpt::Reader::Logical* l = nullptr;
    for (const auto& x : logical)
      if (x.name == name) l = &x;
    if (!l) return ::testing::AssertionFailure() << r.dir() << ": no blob '" << name << "'";
    if (l->size != crash::blob_size(step, i) || l->dtype != crash::blob_dtype(i) || l->shape != crash::blob_shape(step, i))
      return ::testing::AssertionFailure() << r.dir() << ": blob '" << name << "' has size " << l->size << " dtype " << l->dtype
                                           << ", want size " << crash::blob_size(step, i) << " dtype " << crash::blob_dtype(i);
    auto [bytes, err] = read_blob(r, name);
    if (!err.empty()) return ::testing::AssertionFailure() << r.dir() << ": reading '" << name << "': " << err;
    const std::uint64_t bad = crash::first_mismatch(step, i, bytes.data(), bytes.size());
    if (bad != bytes.size())
      return ::testing::AssertionFailure() << r.dir() << ": blob '" << name << "' differs from step " << step << "'s data at byte " << bad;
  }
  return ::testing::AssertionSuccess();
}

bool is_partial(const std::string& name) { return name.rfind(".partial-", 0) == 0; }

std::vector<std::string> names_in(const std::string& dir, bool (*keep)(const std::string&)) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (keep(e.path().filename().string())) out.push_back(e.path().filename().string());
  return out;
}

std::vector<std::string> partials_in(const std::string& dir) { return names_in(dir, is_partial); }

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// Every step directory under `tier` is committed and verifies: a crash may
// leave partial directories, never a step name that does not hold a
// checkpoint.
::testing::AssertionResult no_invalid_commits(const std::string& tier) {
  std::string bad;
  for (const auto& e : ckpt::list(tier, true)) {
    if (!ckpt::parse_step_dir_name(fs::path(e.path).filename().string())) continue;
    if (!e.committed || !e.verified) bad += "\n  " + e.path + ": " + e.problem;
  }
  if (bad.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "committed-but-invalid entries under " << tier << ":" << bad;
}

std::map<std::uint64_t, std::string> step_dirs(const std::string& tier) {
  std::map<std::uint64_t, std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(tier, ec))
    if (auto s = ckpt::parse_step_dir_name(e.path().filename().string())) out[*s] = e.path().string();
  return out;
}

// Opens a checkpointer and collects its warnings.
struct Opened {
  std::unique_ptr<ckpt::Checkpointer> ck;
  std::shared_ptr<std::vector<std::string>> warnings = std::make_shared<std::vector<std::string>>();
};

Opened open_ck(ckpt::Options o) {
  Opened r;
  auto w = r.warnings;
  o.warn = [w](const std::string& s) { w->push_back(s); };
  auto ck = ckpt::Checkpointer::open(std::move(o));
  if (!ck) ADD_FAILURE() << "Checkpointer::open: " << ck.error().message;
  else r.ck = std::move(*ck);
  return r;
}

ckpt::Options small_options(const std::string& root) {
  ckpt::Options o;
  o.root = root;
  o.keep_last = 0;
  o.chunk_bytes = 64 << 10;
  o.staging_bytes = 256 << 10;
  o.pin_staging = false;
  return o;
}

// save() then wait(): the first error of the two, or OK.
pacer::Status save_and_wait(ckpt::Checkpointer& ck, std::uint64_t step, const std::vector<ckpt::BlobView>& blobs,
                            const nlohmann::json& meta = nlohmann::json::object()) {
  auto h = ck.save(step, blobs, meta);
  if (!h) return h.error();
  return h->wait();
}

// ---------------------------------------------------------------------------
// The crash writer as a child process.

struct WriterLog {
  std::vector<std::uint64_t> committed;
  std::vector<std::uint64_t> skipped;
  std::string bad;  // a line that is neither
};

WriterLog parse_log(const std::string& path) {
  WriterLog log;
  std::istringstream in(slurp(path));
  std::string line;
  while (std::getline(in, line)) {
    unsigned long long v = 0;
    char tail = 0;
    if (std::sscanf(line.c_str(), "committed %llu%c", &v, &tail) == 1) log.committed.push_back(v);
    else if (std::sscanf(line.c_str(), "skipped %llu%c", &v, &tail) == 1) log.skipped.push_back(v);
    else if (log.bad.empty()) log.bad = line.empty() ? "(empty line)" : line;
  }
  return log;
}

pid_t spawn_writer(const std::vector<std::string>& args, const std::string& out, const std::string& err) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<std::string> all = {PACER_CRASH_WRITER};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, PACER_CRASH_WRITER, &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    ADD_FAILURE() << "posix_spawn " << PACER_CRASH_WRITER << ": " << std::strerror(rc);
    return -1;
  }
  return pid;
}

// SIGKILLs the child and reaps it; the wait status.
int kill_and_reap(pid_t pid) {
  ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

::testing::AssertionResult killed_by_us(int status, const std::string& err_path) {
  if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "the writer ended by itself (status " << status << "), stderr:\n" << slurp(err_path);
}

// ---------------------------------------------------------------------------
// Crash consistency.
//
// Trials in groups of 8: slots 0-3 each use a fresh root; slots 4-7 share one
// root, so a writer starts where a killed one left partial directories (and
// resumes from the newest step). Odd groups add a fast tier. Each trial's
// state is checked on a copy of its tiers, so that the checkpointer opened by
// the check does not clean what the next writer must cope with.

TEST(CrashConsistency, KilledWriterLeavesNewestCommittedStepIntact) {
  const char* slow_env = std::getenv("PACER_SLOW_TESTS");
  const int trials = slow_env && std::string(slow_env) == "1" ? 200 : 25;
  TempDir work("pacer-crash-");
  const auto t0 = std::chrono::steady_clock::now();

  struct Group {
    std::string dir, root, fast;
    int keep_last = 3;
    std::optional<std::uint64_t> latest;  // as checked after the previous trial
    std::map<std::uint64_t, long> pid_of;  // step -> writer that committed it
  } g;
  int between_commit_and_print = 0, started_on_leftovers = 0, none_committed = 0, max_steps = 0, deleting_leftovers = 0;

  for (int trial = 0; trial < trials; ++trial) {
    const std::uint64_t seed = 0x5EED0000ull + static_cast<std::uint64_t>(trial);
    std::mt19937_64 rng(seed);
    const int slot = trial % 8;
    const bool use_fast = (trial / 8) % 2 == 1;
    if (slot <= 4) {
      if (!g.dir.empty()) fs::remove_all(g.dir);
      g = Group{};
      g.dir = work.path() + "/t" + std::to_string(trial);
      fs::create_directories(g.dir);  // the writers' logs; the tiers are the writer's to create
      g.root = g.dir + "/root";
      if (use_fast) g.fast = g.dir + "/fast";
      g.keep_last = static_cast<int>(rng() % 4);  // 0 keeps all
    }
    // Mostly 20-300 ms; one trial in eight 1-20 ms, to land in start-up and
    // the first save too.
    const int delay_ms = rng() % 8 == 0 ? 1 + static_cast<int>(rng() % 20) : 20 + static_cast<int>(rng() % 281);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " seed 0x" << std::hex << seed << std::dec << " (slot " << slot
                                      << ", fast tier " << use_fast << ", keep_last " << g.keep_last << ", kill after "
                                      << delay_ms << " ms)");
    if (!partials_in(g.root).empty() || (!g.fast.empty() && !partials_in(g.fast).empty())) ++started_on_leftovers;

    std::vector<std::string> args = {g.root, "--keep-last", std::to_string(g.keep_last)};
    if (!g.fast.empty()) args.insert(args.end(), {"--fast", g.fast});
    const std::string out = g.dir + "/writer" + std::to_string(trial) + ".out";
    const std::string err = g.dir + "/writer" + std::to_string(trial) + ".err";
    const pid_t pid = spawn_writer(args, out, err);
    ASSERT_GT(pid, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    const int status = kill_and_reap(pid);
    ASSERT_TRUE(killed_by_us(status, err));

    const WriterLog log = parse_log(out);
    ASSERT_TRUE(log.bad.empty()) << "unexpected writer output line: " << log.bad;
    ASSERT_TRUE(log.skipped.empty()) << "a lone writer skipped step " << log.skipped.front();
    // The writer resumes after the newest step and commits steps in order.
    const std::uint64_t first = g.latest.value_or(0) + 1;
    for (std::size_t k = 0; k < log.committed.size(); ++k)
      ASSERT_EQ(log.committed[k], first + k) << "the writer's committed steps are not " << first << ", " << first + 1 << ", ...";
    for (auto s : log.committed) g.pid_of[s] = pid;
    max_steps = std::max(max_steps, static_cast<int>(log.committed.size()));
    if (log.committed.empty()) ++none_committed;
    // A kill in the middle of pruning leaves a ".deleting-" directory; it is
    // never a checkpoint (list() ignores it), only disk space. Counted, not judged.
    for (const auto& tier : {g.root, g.fast}) {
      if (!tier.empty() && !names_in(tier, [](const std::string& n) { return n.rfind(".deleting-", 0) == 0; }).empty()) {
        ++deleting_leftovers;
        break;
      }
    }

    // This writer cleaned the partial directories of the writers before it
    // (it got as far as a commit, so it finished opening).
    if (!log.committed.empty()) {
      for (const auto& tier : {g.root, g.fast}) {
        if (tier.empty()) continue;
        for (const auto& name : partials_in(tier))
          EXPECT_NE(name.find("-" + std::to_string(pid) + "-"), std::string::npos)
              << tier << "/" << name << ": a dead writer's partial directory survived the next writer's open";
      }
    }

    // No step directory that is not a valid checkpoint, on the raw state.
    EXPECT_TRUE(no_invalid_commits(g.root));
    if (!g.fast.empty()) {
      EXPECT_TRUE(no_invalid_commits(g.fast));
    }

    // Check a copy: open a checkpointer like the writer's, ask for latest().
    const std::string check = g.dir + "/check";
    fs::remove_all(check);
    fs::create_directories(check);
    for (const auto& [from, to] : {std::pair{g.root, check + "/root"}, std::pair{g.fast, check + "/fast"}}) {
      if (from.empty()) continue;
      if (fs::exists(from)) fs::copy(from, to, fs::copy_options::recursive);
      else fs::create_directories(to);  // killed before it created its tiers
    }
    const std::string croot = check + "/root";
    const std::string cfast = g.fast.empty() ? "" : check + "/fast";
    std::optional<std::uint64_t> latest;
    {
      Opened o = open_ck(crash::options(croot, cfast, g.keep_last));
      ASSERT_TRUE(o.ck);
      latest = o.ck->latest();
      EXPECT_TRUE(o.warnings->empty()) << "warnings: " << o.warnings->front();

      // The newest step printed as committed survived; one newer is allowed
      // (killed between its commit and its line), nothing else.
      const std::optional<std::uint64_t> lower = log.committed.empty() ? g.latest : std::optional(log.committed.back());
      const std::uint64_t attempted = lower.value_or(0) + 1;
      if (lower) {
        ASSERT_TRUE(latest.has_value()) << "latest() is empty; last committed step printed: " << *lower;
        ASSERT_TRUE(*latest == *lower || *latest == attempted) << "latest() " << *latest << ", last committed " << *lower;
      } else {
        ASSERT_TRUE(!latest || *latest == attempted) << "latest() " << *latest << " with nothing committed before";
      }
      if (latest && *latest == attempted) {
        ++between_commit_and_print;
        g.pid_of[attempted] = pid;
      }
      if (latest) {
        auto r = o.ck->open_reader(*latest);
        ASSERT_TRUE(r) << r.error().message;
        EXPECT_TRUE(holds_crash_step(*r, *latest, g.pid_of.at(*latest)));
      }
      // Opening cleaned the dead writers' partial directories (and copies of
      // fast-tier steps the dead writer never flushed are finished first).
      pacer::Status flushed = o.ck->flush();
      EXPECT_TRUE(flushed) << flushed.error().message;
      EXPECT_TRUE(partials_in(croot).empty()) << join(partials_in(croot));
      if (!cfast.empty()) {
        EXPECT_TRUE(partials_in(cfast).empty()) << join(partials_in(cfast));
      }
    }
    // Every checkpoint on either tier holds exactly the data of its step, as
    // written by the writer that committed it.
    for (const auto& tier : {croot, cfast}) {
      if (tier.empty()) continue;
      for (const auto& [s, path] : step_dirs(tier)) {
        auto r = ckpt::Reader::open(path);
        ASSERT_TRUE(r) << r.error().message;
        auto it = g.pid_of.find(s);
        ASSERT_TRUE(it != g.pid_of.end()) << path << ": a step no writer reached";
        EXPECT_TRUE(r->verify_all()) << path;
        EXPECT_TRUE(holds_crash_step(*r, s, it->second));
      }
    }
    // Retention: at most one more than keep_last (a kill between a commit
    // and its pruning) on the persistent tier.
    if (g.keep_last > 0) {
      EXPECT_LE(step_dirs(croot).size(), static_cast<std::size_t>(g.keep_last) + 1);
    }
    fs::remove_all(check);
    g.latest = latest;
    if (HasFatalFailure()) return;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ crash    ] %d trials in %.1f s; killed between commit and print: %d; started on leftover partial dirs: %d; "
              "no step printed: %d; most steps in one trial: %d; trials with a .deleting- leftover: %d\n",
              trials, secs, between_commit_and_print, started_on_leftovers, none_committed, max_steps, deleting_leftovers);
}

// Retention renames a doomed step to ".deleting-<step dir>-<pid>" and then
// removes it; a kill in between (the crash test above counts how often that
// happens) leaves a whole checkpoint's worth of data under a name that list()
// and `pacer ckpt ls` never show. The next checkpointer on the root must
// finish the deletion, as it does for a dead saver's partial directories.
TEST(CrashConsistency, KilledPruneLeavesNoHiddenData) {
  TempDir dir("pacer-crash-prune-");
  const std::string root = dir.path() + "/root";
  // A pid that is certainly gone: a child that has exited and been reaped.
  const pid_t dead = ::fork();
  ASSERT_GE(dead, 0);
  if (dead == 0) std::_Exit(0);
  int status = 0;
  ASSERT_EQ(::waitpid(dead, &status, 0), dead);
  {
    Opened o = open_ck(crash::options(root, "", 0));
    ASSERT_TRUE(o.ck);
    auto buffers = crash::make_step(1);
    ASSERT_TRUE(save_and_wait(*o.ck, 1, crash::views(1, buffers), {{"step", 1}}));
  }
  // What a writer killed inside remove_checkpoint_dir leaves behind.
  const std::string doomed = root + "/.deleting-" + ckpt::step_dir_name(1) + "-" + std::to_string(dead);
  fs::rename(root + "/" + ckpt::step_dir_name(1), doomed);
  Opened o = open_ck(crash::options(root, "", 2));
  ASSERT_TRUE(o.ck);
  auto buffers = crash::make_step(2);
  ASSERT_TRUE(save_and_wait(*o.ck, 2, crash::views(2, buffers), {{"step", 2}}));
  EXPECT_EQ(o.ck->latest(), std::optional<std::uint64_t>(2));
  EXPECT_FALSE(fs::exists(doomed)) << doomed << " (" << crash::blob_size(1, 2) << "+ bytes) is never removed and list() does not show it";
}

// ---------------------------------------------------------------------------
// Corruption: steps 1 and 2 of the crash data, then damage to step 2.

class ReliabilityCorruption : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = dir_.path() + "/root";
    ckpt::Options o = crash::options(root_, "", 0);
    Opened w = open_ck(o);
    ASSERT_TRUE(w.ck);
    for (std::uint64_t s = 1; s <= 2; ++s) {
      auto buffers = crash::make_step(s);
      ASSERT_TRUE(save_and_wait(*w.ck, s, crash::views(s, buffers), {{"step", s}}));
    }
    step2_ = root_ + "/" + ckpt::step_dir_name(2);
    auto r = ckpt::Reader::open(step2_);
    ASSERT_TRUE(r) << r.error().message;
    manifest2_ = r->manifest();
    ASSERT_EQ(manifest2_.files.size(), 1u);
    data2_ = step2_ + "/" + manifest2_.files[0].first;
  }

  std::optional<std::uint64_t> latest(std::vector<std::string>* warnings = nullptr) {
    Opened o = open_ck(crash::options(root_, "", 0));
    if (!o.ck) return std::nullopt;
    auto l = o.ck->latest();
    if (warnings) *warnings = *o.warnings;
    return l;
  }

  static void write_bytes(const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  }

  TempDir dir_{"pacer-corrupt-"};
  std::string root_, step2_, data2_;
  ckpt::Manifest manifest2_;
};

TEST_F(ReliabilityCorruption, FlippedDataByteIsDetectedAndLatestFallsBack) {
  const std::string file = fs::path(data2_).filename().string();
  for (const auto& b : manifest2_.blobs) {
    for (std::uint64_t pos : {std::uint64_t{0}, b.size / 2, b.size - 1}) {
      SCOPED_TRACE(::testing::Message() << "blob '" << b.name << "' byte " << pos << " of " << b.size);
      flip_byte(data2_, b.offset + pos);

      auto r = ckpt::Reader::open(step2_);
      ASSERT_TRUE(r) << "the file size did not change, so open succeeds: " << r.error().message;
      pacer::Status st = r->verify_all();
      ASSERT_FALSE(st) << "verify_all missed a flipped byte";
      EXPECT_TRUE(contains(st.error().message, "'" + b.name + "'"));
      EXPECT_TRUE(contains(st.error().message, file));
      // Reading the damaged blob fails; the others still read correctly.
      for (int i = 0; i < crash::kBlobs; ++i) {
        auto [bytes, err] = read_blob(*r, crash::blob_name(i));
        if (crash::blob_name(i) == b.name) {
          EXPECT_TRUE(contains(err, b.name)) << "read of the damaged blob did not fail";
        } else {
          EXPECT_EQ(err, "");
          EXPECT_EQ(crash::first_mismatch(2, i, bytes.data(), bytes.size()), crash::blob_size(2, i));
        }
      }
      std::vector<std::string> warnings;
      EXPECT_EQ(latest(&warnings), std::optional<std::uint64_t>(1));
      ASSERT_FALSE(warnings.empty()) << "skipping a corrupt step warns";
      EXPECT_TRUE(contains(warnings[0], "step 2"));
      EXPECT_TRUE(contains(warnings[0], b.name));
      bool listed = false;
      for (const auto& e : ckpt::list(root_, true)) {
        if (e.step != 2) continue;
        listed = true;
        EXPECT_TRUE(e.committed);
        EXPECT_FALSE(e.verified);
        EXPECT_TRUE(contains(e.problem, b.name));
      }
      EXPECT_TRUE(listed);

      flip_byte(data2_, b.offset + pos);  // repaired
      auto r2 = ckpt::Reader::open(step2_);
      ASSERT_TRUE(r2);
      EXPECT_TRUE(r2->verify_all());
      EXPECT_EQ(latest(), std::optional<std::uint64_t>(2));
    }
  }
}

TEST_F(ReliabilityCorruption, TruncatedOrExtendedDataFileIsDetected) {
  const std::string good = slurp(data2_);
  const std::string file = fs::path(data2_).filename().string();
  const std::vector<std::pair<std::string, std::string>> variants = {
      {"one byte short", good.substr(0, good.size() - 1)},
      {"half", good.substr(0, good.size() / 2)},
      {"empty", ""},
      {"one byte longer", good + "x"},
  };
  for (const auto& [what, bytes] : variants) {
    SCOPED_TRACE(what);
    write_bytes(data2_, bytes);
    auto r = ckpt::Reader::open(step2_);
    ASSERT_FALSE(r) << "Reader::open accepted a data file of the wrong size";
    EXPECT_TRUE(contains(r.error().message, file));
    EXPECT_EQ(latest(), std::optional<std::uint64_t>(1));
    write_bytes(data2_, good);
    EXPECT_EQ(latest(), std::optional<std::uint64_t>(2));
  }
  // A missing data file too.
  fs::remove(data2_);
  auto r = ckpt::Reader::open(step2_);
  ASSERT_FALSE(r);
  EXPECT_TRUE(contains(r.error().message, file));
  EXPECT_EQ(latest(), std::optional<std::uint64_t>(1));
}

TEST_F(ReliabilityCorruption, CorruptManifestIsNotACommit) {
  const std::string mpath = step2_ + "/" + ckpt::kManifestName;
  const std::string good = slurp(mpath);
  ASSERT_FALSE(good.empty());
  // One hex digit of a chunk checksum changed: still valid JSON.
  std::string hex_edit = good;
  {
    const auto chunks = hex_edit.find("\"chunks\"");
    ASSERT_NE(chunks, std::string::npos);
    const auto q = hex_edit.find('"', hex_edit.find('[', chunks)) + 1;
    hex_edit[q] = hex_edit[q] == '0' ? '1' : '0';
  }
  // A blob's size changed by one digit.
  std::string size_edit = good;
  {
    const auto at = size_edit.find("\"size\": ");
    ASSERT_NE(at, std::string::npos);
    char& d = size_edit[at + 8];
    d = d == '9' ? '8' : static_cast<char>(d + 1);
  }
  // The step changed: a manifest claiming a different step.
  std::string step_edit = good;
  {
    const auto at = step_edit.find("\"step\": 2");
    ASSERT_NE(at, std::string::npos);
    step_edit[at + 8] = '3';
  }
  std::string flipped = good;
  flipped[flipped.size() / 2] ^= 0x20;
  const std::vector<std::pair<std::string, std::optional<std::string>>> variants = {
      {"checksum digit edited", hex_edit}, {"blob size edited", size_edit}, {"step edited", step_edit},
      {"one byte flipped", flipped},       {"torn (half)", good.substr(0, good.size() / 2)},
      {"empty", std::string()},            {"missing", std::nullopt},
  };
  for (const auto& [what, text] : variants) {
    SCOPED_TRACE(what);
    if (text) write_bytes(mpath, *text);
    else fs::remove(mpath);
    auto r = ckpt::Reader::open(step2_);
    ASSERT_FALSE(r) << "Reader::open accepted a damaged manifest";
    EXPECT_TRUE(contains(r.error().message, ckpt::kManifestName));
    EXPECT_EQ(latest(), std::optional<std::uint64_t>(1));
    for (const auto& e : ckpt::list(root_, false))
      if (e.step == 2) {
        EXPECT_FALSE(e.committed) << "list() calls a damaged manifest committed";
      }
    write_bytes(mpath, good);
    EXPECT_EQ(latest(), std::optional<std::uint64_t>(2));
  }
}

TEST_F(ReliabilityCorruption, CorruptOnlyCheckpointMeansNoLatest) {
  fs::remove_all(root_ + "/" + ckpt::step_dir_name(1));
  flip_byte(data2_, manifest2_.blobs[2].offset + 12345);
  EXPECT_EQ(latest(), std::nullopt);
  Opened o = open_ck(crash::options(root_, "", 0));
  ASSERT_TRUE(o.ck);
  auto r = o.ck->open_reader();
  ASSERT_FALSE(r) << "open_reader returned a corrupt checkpoint";
  auto r2 = o.ck->open_reader(2);
  ASSERT_FALSE(r2) << "open_reader(2) returned a corrupt checkpoint";
}

// A whole checkpoint under another step's name (a bad copy or restore): a
// valid manifest, valid data, but of step 1 in directory step-3. latest() must
// not answer 1 while step 2 is valid and newer, and asking for step 3 must
// not hand back step 1's data.
TEST_F(ReliabilityCorruption, CheckpointUnderAnotherStepsNameIsNotTrusted) {
  const std::string misnamed = root_ + "/" + ckpt::step_dir_name(3);
  fs::copy(root_ + "/" + ckpt::step_dir_name(1), misnamed, fs::copy_options::recursive);
  const auto l = latest();
  EXPECT_EQ(l, std::optional<std::uint64_t>(2)) << "latest() trusted step-000000000003 whose manifest says step 1";
  Opened o = open_ck(crash::options(root_, "", 0));
  ASSERT_TRUE(o.ck);
  auto r = o.ck->open_reader(3);
  if (r) {
    EXPECT_EQ(r->manifest().step, 3u) << "open_reader(3) returned a checkpoint of step " << r->manifest().step;
  }
  auto newest = o.ck->open_reader();
  ASSERT_TRUE(newest);
  EXPECT_EQ(newest->manifest().step, 2u);
}

// ---------------------------------------------------------------------------
// A tmpfs mount for disk-full and read-only tests.

class TmpfsMount {
 public:
  // Mounts; on failure `error` says why and `permission` whether it was refused.
  TmpfsMount(const std::string& dir, const std::string& size) : dir_(dir) {
    fs::create_directories(dir);
    const std::string opts = "size=" + size;
    if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, opts.c_str()) != 0) {
      const int e = errno;
      permission_ = e == EPERM || e == EACCES;
      error_ = "mount -t tmpfs -o " + opts + " tmpfs " + dir + ": " + std::strerror(e);
      return;
    }
    mounted_ = true;
  }
  ~TmpfsMount() {
    if (!mounted_) return;
    if (::umount2(dir_.c_str(), 0) != 0) ::umount2(dir_.c_str(), MNT_DETACH);
  }
  TmpfsMount(const TmpfsMount&) = delete;
  TmpfsMount& operator=(const TmpfsMount&) = delete;

  bool mounted() const { return mounted_; }
  bool permission_denied() const { return permission_; }
  const std::string& error() const { return error_; }
  const std::string& dir() const { return dir_; }
  std::string remount(bool read_only) const {
    const unsigned long flags = MS_REMOUNT | (read_only ? MS_RDONLY : 0);
    if (::mount(nullptr, dir_.c_str(), nullptr, flags, nullptr) != 0) return std::strerror(errno);
    return "";
  }
  std::uint64_t free_bytes() const {
    struct statvfs s {};
    if (::statvfs(dir_.c_str(), &s) != 0) return 0;
    return static_cast<std::uint64_t>(s.f_bavail) * s.f_frsize;
  }

 private:
  std::string dir_;
  std::string error_;
  bool mounted_ = false;
  bool permission_ = false;
};

// Mounts a tmpfs under the test's temp dir; skips when mounting is refused.
class MountedTest : public ::testing::Test {
 protected:
  void Mount(const std::string& size, const std::string& name = "mnt") {
    auto m = std::make_unique<TmpfsMount>(dir_.path() + "/" + name, size);
    if (!m->mounted()) {
      if (m->permission_denied()) GTEST_SKIP() << "cannot mount a tmpfs here: " << m->error();
      FAIL() << m->error();
    }
    mounts_.push_back(std::move(m));
  }
  TmpfsMount& mnt(std::size_t i = 0) { return *mounts_.at(i); }
  void TearDown() override {
    while (!mounts_.empty()) mounts_.pop_back();  // unmount, newest first
  }

  TempDir dir_{"pacer-mount-"};
  std::vector<std::unique_ptr<TmpfsMount>> mounts_;
};

// ---------------------------------------------------------------------------
// Disk full.

class DiskFull : public MountedTest {};

TEST_F(DiskFull, FailedSaveLeavesNoTraceAndLaterSavesWork) {
  Mount("4m");
  if (IsSkipped() || HasFatalFailure()) return;
  const std::string root = mnt().dir() + "/ckpt";
  Opened o = open_ck(small_options(root));
  ASSERT_TRUE(o.ck);
  const auto small = pattern(1, 100 << 10);
  const auto tiny = pattern(2, 3000);
  ASSERT_TRUE(save_and_wait(*o.ck, 1, {view("w", small), view("t", tiny)}, {{"step", 1}}));
  const std::uint64_t free_before = mnt().free_bytes();

  const auto big = pattern(3, 6 << 20);
  pacer::Status st = save_and_wait(*o.ck, 2, {view("t", tiny), view("big", big)}, {{"step", 2}});
  ASSERT_FALSE(st) << "a 6 MiB save into a 4 MiB file system succeeded";
  EXPECT_TRUE(contains(st.error().message, "No space left on device"));
  // Nothing of the failed save is left: no step, no partial directory, and
  // the space it took is free again.
  EXPECT_EQ(names_in(root, [](const std::string&) { return true; }), std::vector<std::string>{ckpt::step_dir_name(1)});
  EXPECT_GE(mnt().free_bytes() + (64 << 10), free_before);
  EXPECT_EQ(o.ck->latest(), std::optional<std::uint64_t>(1));
  {
    auto r = ckpt::Reader::open(root + "/" + ckpt::step_dir_name(1));
    ASSERT_TRUE(r) << r.error().message;
    EXPECT_TRUE(r->verify_all());
    EXPECT_EQ(read_blob(*r, "w").first, small);
  }
  // The failed step number and the next one save fine.
  const auto small2 = pattern(4, 200 << 10);
  ASSERT_TRUE(save_and_wait(*o.ck, 2, {view("w", small2)}, {{"step", 2}}));
  ASSERT_TRUE(save_and_wait(*o.ck, 3, {view("w", small)}, {{"step", 3}}));
  EXPECT_EQ(o.ck->latest(), std::optional<std::uint64_t>(3));
  auto r2 = o.ck->open_reader(2);
  ASSERT_TRUE(r2) << r2.error().message;
  EXPECT_EQ(read_blob(*r2, "w").first, small2);
  EXPECT_TRUE(no_invalid_commits(root));
}

// Sweep the free space around the size of one save, so that the disk fills
// up in the data, exactly at the manifest, or not at all: every save either
// commits a checkpoint that verifies or fails with ENOSPC and leaves nothing.
TEST_F(DiskFull, EveryFillLevelCommitsOrFailsCleanly) {
  Mount("2m");
  if (IsSkipped() || HasFatalFailure()) return;
  const std::string root = mnt().dir() + "/ckpt";
  const std::string filler = mnt().dir() + "/filler";
  Opened o = open_ck(small_options(root));
  ASSERT_TRUE(o.ck);
  const auto data = pattern(5, (300 << 10) + 123);
  const std::uint64_t data_pages = (data.size() + 4095) / 4096;
  int ok = 0, failed = 0, failed_at_manifest = 0;
  for (int extra = -3; extra <= 4; ++extra) {
    SCOPED_TRACE(::testing::Message() << "free pages left: data pages " << (extra >= 0 ? "+" : "") << extra);
    const std::uint64_t free_now = mnt().free_bytes();
    const std::uint64_t leave = (data_pages + static_cast<std::uint64_t>(static_cast<std::int64_t>(extra))) * 4096;
    ASSERT_GT(free_now, leave);
    {
      std::ofstream f(filler, std::ios::binary | std::ios::trunc);
      const std::string zeros(free_now - leave, '\0');
      f << zeros;
      f.flush();
      ASSERT_TRUE(f.good()) << "cannot write the filler";
    }
    const std::uint64_t step = 10 + static_cast<std::uint64_t>(extra + 3);
    pacer::Status st = save_and_wait(*o.ck, step, {view("w", data)}, {{"step", step}});
    if (st) {
      ++ok;
      auto r = o.ck->open_reader(step);
      ASSERT_TRUE(r) << r.error().message;
      EXPECT_EQ(read_blob(*r, "w").first, data);
      fs::remove_all(root + "/" + ckpt::step_dir_name(step));
    } else {
      ++failed;
      EXPECT_TRUE(contains(st.error().message, "No space left on device"));
      if (st.error().message.find(ckpt::kManifestName) != std::string::npos) ++failed_at_manifest;
    }
    EXPECT_TRUE(names_in(root, [](const std::string&) { return true; }).empty())
        << "left behind: " << join(names_in(root, [](const std::string&) { return true; }));
    fs::remove(filler);
  }
  EXPECT_GT(ok, 0);
  EXPECT_GT(failed, 0);
  std::printf("[ diskfull ] %d saves committed, %d failed with ENOSPC (%d of them writing the manifest)\n", ok, failed,
              failed_at_manifest);
}

// A root whose disk is full: saves fail naming the cause, retention removes
// nothing to make room, a damaged step is still moved aside (a rename needs
// no space) and the newest valid step stays loadable; prune then frees space.
TEST_F(DiskFull, FullRootKeepsTheNewestValidStepLoadable) {
  Mount("4m");
  if (IsSkipped() || HasFatalFailure()) return;
  const std::string root = mnt().dir() + "/ckpt";
  ckpt::Options opt = small_options(root);
  opt.keep_last = 2;
  Opened o = open_ck(opt);
  ASSERT_TRUE(o.ck);
  const auto a = pattern(11, 700 << 10), b = pattern(12, 700 << 10);
  ASSERT_TRUE(save_and_wait(*o.ck, 1, {view("w", a)}, {{"step", 1}}));
  ASSERT_TRUE(save_and_wait(*o.ck, 2, {view("w", b)}, {{"step", 2}}));
  {
    std::ofstream f(mnt().dir() + "/filler", std::ios::binary);
    const std::string zeros(mnt().free_bytes(), '\0');
    f << zeros;
  }
  pacer::Status st = save_and_wait(*o.ck, 3, {view("w", a)}, {{"step", 3}});
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.error().message, "No space left on device")) << st.error().message;
  EXPECT_TRUE(contains(st.error().message, root)) << st.error().message;
  EXPECT_EQ(o.ck->latest(), std::optional<std::uint64_t>(2));
  // Step 2 rots; a load falls back to 1; training saves step 2 again on the full disk.
  {
    const std::string data = root + "/" + ckpt::step_dir_name(2) + "/rank-00000.bin";
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x5a');
  }
  EXPECT_EQ(o.ck->latest(), std::optional<std::uint64_t>(1));
  st = save_and_wait(*o.ck, 2, {view("w", b)}, {{"step", 2}});
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.error().message, "No space left on device")) << st.error().message;
  bool moved = false;
  for (const auto& e : ckpt::list(root, false)) moved = moved || (e.damaged && e.step == 2);
  EXPECT_TRUE(moved) << "the damaged step 2 was not moved aside";
  auto r = o.ck->open_reader();
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->manifest().step, 1u);
  EXPECT_EQ(read_blob(*r, "w").first, a);
  // Removing the damaged copy frees its space; step 1 stays.
  auto p = ckpt::prune(root, {.keep_last = 1, .remove_damaged = true});
  ASSERT_TRUE(p) << p.error().message;
  EXPECT_EQ(p->newest_valid, std::optional<std::uint64_t>(1));
  EXPECT_EQ(p->removed_damaged.size(), 1u);
  EXPECT_TRUE(save_and_wait(*o.ck, 2, {view("w", b)}, {{"step", 2}}));
  EXPECT_EQ(o.ck->latest(), std::optional<std::uint64_t>(2));
}

// With a fast tier, wait() returns once the fast tier holds the step; a full
// persistent tier then fails the flush (wait_persistent) cleanly and the fast
// copy stays the newest checkpoint. Both tiers on one tmpfs, so the copy
// fails for lack of space and nothing else.
TEST_F(DiskFull, FullPersistentTierKeepsTheFastCopy) {
  Mount("10m");
  if (IsSkipped() || HasFatalFailure()) return;
  ckpt::Options opt = small_options(mnt().dir() + "/root");
  opt.fast_tier = mnt().dir() + "/fast";
  opt.keep_last = 3;
  Opened o = open_ck(opt);
  ASSERT_TRUE(o.ck);
  const auto big = pattern(6, 6 << 20);
  auto h = o.ck->save(1, {view("big", big)}, {{"step", 1}});
  ASSERT_TRUE(h) << h.error().message;
  ASSERT_TRUE(h->wait()) << "the fast tier has room for the step";
  pacer::Status st = h->wait_persistent();
  ASSERT_FALSE(st) << "6 MiB fit twice into a 10 MiB file system";
  EXPECT_TRUE(contains(st.error().message, "No space left on device"));
  EXPECT_TRUE(names_in(*opt.fast_tier, is_partial).empty());
  EXPECT_TRUE(names_in(opt.root, [](const std::string&) { return true; }).empty())
      << "left on the persistent tier: " << join(names_in(opt.root, [](const std::string&) { return true; }));
  EXPECT_EQ(o.ck->latest(), std::optional<std::uint64_t>(1));
  auto r = o.ck->open_reader(1);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(read_blob(*r, "big").first, big);
  bool warned = false;
  for (const auto& w : *o.warnings) warned = warned || w.find("step 1") != std::string::npos;
  EXPECT_TRUE(warned) << "a failed flush warns";
  // A small step still reaches both tiers.
  const auto small = pattern(7, 100 << 10);
  auto h2 = o.ck->save(2, {view("w", small)}, {{"step", 2}});
  ASSERT_TRUE(h2);
  ASSERT_TRUE(h2->wait_persistent()) << "flush of a small step";
  auto r2 = ckpt::Reader::open(opt.root + "/" + ckpt::step_dir_name(2));
  ASSERT_TRUE(r2) << r2.error().message;
  EXPECT_EQ(read_blob(*r2, "w").first, small);
}

// ---------------------------------------------------------------------------
// Tiers on different file systems: the usual set-up is a node-local tmpfs
// (/dev/shm) as the fast tier and another file system as the root.

class ReliabilityTiers : public MountedTest {};

TEST_F(ReliabilityTiers, FastTierOnTmpfsFlushesToRootOnAnotherFileSystem) {
  Mount("16m");
  if (IsSkipped() || HasFatalFailure()) return;
  ckpt::Options opt = small_options(dir_.path() + "/root");  // the test's temp file system
  opt.fast_tier = mnt().dir() + "/fast";                      // tmpfs
  Opened o = open_ck(opt);
  ASSERT_TRUE(o.ck);
  const auto data = pattern(8, 1 << 20);
  auto h = o.ck->save(1, {view("w", data)}, {{"step", 1}});
  ASSERT_TRUE(h) << h.error().message;
  ASSERT_TRUE(h->wait());
  pacer::Status st = h->wait_persistent();
  ASSERT_TRUE(st) << "flush from a tmpfs fast tier to a root on another file system: " << st.error().message;
  auto r = ckpt::Reader::open(opt.root + "/" + ckpt::step_dir_name(1));
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(read_blob(*r, "w").first, data);
}

// ---------------------------------------------------------------------------
// Read-only and missing roots.

class ReliabilityReadOnly : public MountedTest {};

TEST_F(ReliabilityReadOnly, OpenOnReadOnlyFileSystemFailsNamingThePath) {
  Mount("1m");
  if (IsSkipped() || HasFatalFailure()) return;
  const std::string existing = mnt().dir() + "/existing";
  fs::create_directories(existing);
  const std::string err = mnt().remount(true);
  if (!err.empty()) GTEST_SKIP() << "cannot remount read-only: " << err;

  const std::string missing = mnt().dir() + "/new/ckpt";
  auto a = ckpt::Checkpointer::open(small_options(missing));
  ASSERT_FALSE(a) << "opened a checkpointer that cannot create its root";
  EXPECT_TRUE(contains(a.error().message, missing));
  EXPECT_FALSE(fs::exists(missing));

  // An existing read-only root opens for loading; saving names the root.
  auto b = ckpt::Checkpointer::open(small_options(existing));
  ASSERT_TRUE(b) << b.error().message;
  EXPECT_EQ((*b)->latest(), std::nullopt);
  const auto data = pattern(3, 5000);
  auto saved = (*b)->save(1, {view("w", data)});
  ASSERT_FALSE(saved) << "saved into a read-only root";
  EXPECT_TRUE(contains(saved.error().message, existing));

  ckpt::Options fast = small_options(dir_.path() + "/root");
  fast.fast_tier = existing;
  auto c = ckpt::Checkpointer::open(fast);
  ASSERT_FALSE(c) << "opened a checkpointer on a read-only fast tier";
  EXPECT_TRUE(contains(c.error().message, existing));
}

TEST_F(ReliabilityReadOnly, SaveAfterRootTurnsReadOnlyFailsAndKeepsOlderSteps) {
  Mount("4m");
  if (IsSkipped() || HasFatalFailure()) return;
  const std::string root = mnt().dir() + "/ckpt";
  Opened o = open_ck(small_options(root));
  ASSERT_TRUE(o.ck);
  const auto data = pattern(9, 100 << 10);
  ASSERT_TRUE(save_and_wait(*o.ck, 1, {view("w", data)}));
  const std::string err = mnt().remount(true);
  if (!err.empty()) GTEST_SKIP() << "cannot remount read-only: " << err;
  pacer::Status st = save_and_wait(*o.ck, 2, {view("w", data)});
  ASSERT_FALSE(st) << "saved onto a read-only file system";
  EXPECT_TRUE(contains(st.error().message, root));
  EXPECT_TRUE(contains(st.error().message, "Read-only file system"));
  EXPECT_EQ(o.ck->latest(), std::optional<std::uint64_t>(1));
  ASSERT_EQ(mnt().remount(false), "");
  ASSERT_TRUE(save_and_wait(*o.ck, 2, {view("w", data)}));
  EXPECT_EQ(o.ck->latest(), std::optional<std::uint64_t>(2));
  EXPECT_TRUE(partials_in(root).empty());
}

TEST(ReliabilityMissingRoot, OpenCreatesMissingDirectories) {
  TempDir dir("pacer-missing-");
  const std::string root = dir.path() + "/a/b/c";
  ASSERT_FALSE(fs::exists(dir.path() + "/a"));
  Opened o = open_ck(small_options(root));
  ASSERT_TRUE(o.ck);
  EXPECT_TRUE(fs::is_directory(root));
  EXPECT_EQ(o.ck->latest(), std::nullopt);
  const auto data = pattern(10, 5000);
  ASSERT_TRUE(save_and_wait(*o.ck, 1, {view("w", data)}));
  EXPECT_EQ(o.ck->latest(), std::optional<std::uint64_t>(1));
}

// ---------------------------------------------------------------------------
// Several savers on one root.

TEST(ConcurrentSavers, SameStepFromTwoCheckpointersCommitsExactlyOnce) {
  TempDir dir("pacer-concurrent-");
  const std::string root = dir.path() + "/root";
  ckpt::Options opt = small_options(root);
  opt.staging_bytes = 64 << 20;  // save() returns before the write: the race is at the commit
  Opened a = open_ck(opt);
  Opened b = open_ck(opt);
  ASSERT_TRUE(a.ck && b.ck);
  int refused_at_save = 0, refused_at_commit = 0;
  for (int round = 0; round < 12; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    const std::uint64_t step = 100 + static_cast<std::uint64_t>(round);
    const auto da = pattern(1000 + step, (2 << 20) + 17);
    const auto db = pattern(2000 + step, (2 << 20) + 17);
    ckpt::Checkpointer* first = round % 2 ? b.ck.get() : a.ck.get();
    ckpt::Checkpointer* second = round % 2 ? a.ck.get() : b.ck.get();
    const auto& dfirst = round % 2 ? db : da;
    const auto& dsecond = round % 2 ? da : db;
    auto h1 = first->save(step, {view("w", dfirst)}, {{"saver", "first"}});
    auto h2 = second->save(step, {view("w", dsecond)}, {{"saver", "second"}});
    ASSERT_TRUE(h1) << "the first save of a step is refused: " << h1.error().message;
    pacer::Status s1 = h1->wait();
    pacer::Status s2 = h2 ? h2->wait() : pacer::Status(h2.error());
    ASSERT_NE(s1.ok(), s2.ok()) << "both or neither committed step " << step << ": '"
                                << (s1 ? "ok" : s1.error().message) << "' and '" << (s2 ? "ok" : s2.error().message) << "'";
    const pacer::Status& loser = s1 ? s2 : s1;
    EXPECT_TRUE(contains(loser.error().message, "already committed"));
    if (!h2) ++refused_at_save;
    else if (!s1 || !s2) ++refused_at_commit;
    // The step holds the winner's bytes and meta, whole.
    auto r = ckpt::Reader::open(root + "/" + ckpt::step_dir_name(step));
    ASSERT_TRUE(r) << r.error().message;
    EXPECT_TRUE(r->verify_all());
    EXPECT_EQ(r->manifest().meta["saver"], s1 ? "first" : "second");
    EXPECT_TRUE(read_blob(*r, "w").first == (s1 ? dfirst : dsecond)) << "the step holds the loser's bytes";
    EXPECT_TRUE(partials_in(root).empty()) << join(partials_in(root));
  }
  EXPECT_TRUE(no_invalid_commits(root));
  std::printf("[ same step] the second saver was refused at save() %d times and at the commit %d times\n", refused_at_save,
              refused_at_commit);
}

TEST(ConcurrentSavers, InterleavedStepsFromTwoCheckpointersAllCommit) {
  TempDir dir("pacer-concurrent-");
  const std::string root = dir.path() + "/root";
  Opened a = open_ck(crash::options(root, "", 0));
  Opened b = open_ck(crash::options(root, "", 0));
  ASSERT_TRUE(a.ck && b.ck);
  std::vector<ckpt::SaveHandle> handles;
  for (std::uint64_t s = 1; s <= 10; ++s) {
    auto buffers = crash::make_step(s);
    auto h = (s % 2 ? a : b).ck->save(s, crash::views(s, buffers), {{"step", s}, {"pid", s % 2 ? 1 : 2}});
    ASSERT_TRUE(h) << "step " << s << ": " << h.error().message;
    handles.push_back(*h);
  }
  for (auto& h : handles) EXPECT_TRUE(h.wait()) << "step " << h.step();
  for (std::uint64_t s = 1; s <= 10; ++s) {
    auto r = ckpt::Reader::open(root + "/" + ckpt::step_dir_name(s));
    ASSERT_TRUE(r) << r.error().message;
    EXPECT_TRUE(r->verify_all());
    EXPECT_TRUE(holds_crash_step(*r, s, s % 2 ? 1 : 2));
  }
  EXPECT_TRUE(no_invalid_commits(root));
  EXPECT_EQ(a.ck->latest(), std::optional<std::uint64_t>(10));
  EXPECT_EQ(b.ck->latest(), std::optional<std::uint64_t>(10));
}

// Two writer processes race through the same steps on one root: no step is
// committed by both, a step one of them skipped was committed by the other,
// and every step holds its committer's data.
TEST(ConcurrentSavers, TwoWriterProcessesNeverCommitTheSameStep) {
  TempDir dir("pacer-concurrent-");
  const std::string root = dir.path() + "/root";
  fs::create_directories(root);
  std::map<std::uint64_t, long> committer;  // step -> the writer that printed it, over all rounds
  std::vector<long> all_pids;
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    std::vector<pid_t> pids;
    std::vector<std::string> outs, errs;
    for (int w = 0; w < 2; ++w) {
      outs.push_back(dir.path() + "/w" + std::to_string(round) + std::to_string(w) + ".out");
      errs.push_back(dir.path() + "/w" + std::to_string(round) + std::to_string(w) + ".err");
      pids.push_back(spawn_writer({root, "--keep-last", "0"}, outs.back(), errs.back()));
      ASSERT_GT(pids.back(), 0);
      all_pids.push_back(pids.back());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    std::map<std::uint64_t, long> skipper;
    std::uint64_t newest_printed = 0;
    for (int w = 0; w < 2; ++w) {
      ASSERT_TRUE(killed_by_us(kill_and_reap(pids[w]), errs[w]));
      const WriterLog log = parse_log(outs[w]);
      ASSERT_TRUE(log.bad.empty()) << log.bad;
      for (auto s : log.committed) {
        auto [it, fresh] = committer.emplace(s, pids[w]);
        EXPECT_TRUE(fresh) << "step " << s << " committed by both writers (" << it->second << " and " << pids[w] << ")";
        newest_printed = std::max(newest_printed, s);
      }
      for (auto s : log.skipped) skipper[s] = pids[w];
    }
    for (const auto& [s, pid] : skipper) {
      auto it = committer.find(s);
      // The other writer may have been killed between its commit and its line.
      if (it != committer.end()) {
        EXPECT_NE(it->second, pid) << "step " << s << " both skipped and committed by " << pid;
      }
      EXPECT_TRUE(fs::exists(root + "/" + ckpt::step_dir_name(s))) << "step " << s << " was skipped but nobody committed it";
    }
    for (const auto& [s, path] : step_dirs(root)) {
      auto r = ckpt::Reader::open(path);
      ASSERT_TRUE(r) << r.error().message;
      auto it = committer.find(s);
      if (it != committer.end()) {
        EXPECT_TRUE(holds_crash_step(*r, s, it->second));
      }
      else EXPECT_TRUE(holds_crash_step(*r, s));
      const long pid = r->manifest().meta.value("pid", 0L);
      EXPECT_NE(std::find(all_pids.begin(), all_pids.end(), pid), all_pids.end()) << path << " written by pid " << pid;
    }
    for (const auto& [s, pid] : committer) EXPECT_TRUE(fs::exists(root + "/" + ckpt::step_dir_name(s))) << "step " << s << " vanished";
    EXPECT_TRUE(no_invalid_commits(root));
    Opened o = open_ck(crash::options(root, "", 0));
    ASSERT_TRUE(o.ck);
    const auto latest = o.ck->latest();
    if (newest_printed > 0) {
      ASSERT_TRUE(latest);
      EXPECT_GE(*latest, newest_printed);
    }
  }
}

// ---------------------------------------------------------------------------
// Input that the manifest cannot hold must fail the save, not the process:
// the manifest is written on a background thread, where an exception ends
// the whole training job. Each attempt runs in a child (a death test) and
// must end by exiting, whether the save was refused or accepted.

void save_in_child(const std::string& root, const std::string& name, const nlohmann::json& meta) {
  auto ck = ckpt::Checkpointer::open(small_options(root));
  if (!ck) std::_Exit(4);
  const auto data = pattern(20, 5000);
  auto h = (*ck)->save(1, {view(name, data)}, meta);
  if (!h) {
    std::fprintf(stderr, "save refused: %s\n", h.error().message.c_str());
    std::_Exit(3);
  }
  pacer::Status st = h->wait();
  if (!st) std::fprintf(stderr, "save failed: %s\n", st.error().message.c_str());
  ck->reset();
  std::_Exit(st ? 0 : 3);
}

TEST(ReliabilityBadInput, InvalidUtf8InMetaOrBlobNameIsAnErrorNotACrash) {
  // "fast": the child is forked here and uses this test's temp dir, which the
  // parent removes (no other threads run at this point).
  GTEST_FLAG_SET(death_test_style, "fast");
  TempDir dir("pacer-badinput-");
  const auto exited = [](int status) { return WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == 3); };
  const std::string bad = "caf\xc3\x28 \xff";  // not UTF-8
  EXPECT_EXIT(save_in_child(dir.path() + "/meta", "w", {{"note", bad}}), exited, "")
      << "a meta string that is not UTF-8 killed the process";
  EXPECT_EXIT(save_in_child(dir.path() + "/name", bad, nlohmann::json::object()), exited, "")
      << "a blob name that is not UTF-8 killed the process";
  // Whatever the outcome, the roots hold nothing half-made.
  for (const char* sub : {"/meta", "/name"}) {
    EXPECT_TRUE(no_invalid_commits(dir.path() + sub));
  }
}

// ---------------------------------------------------------------------------
// A save issued while the previous one is still being written.

TEST(ReliabilityOverlap, SaveWhileWritingCommitsBothInOrderWithTheBytesOfSaveTime) {
  TempDir dir("pacer-overlap-");
  ckpt::Options opt = small_options(dir.path() + "/root");
  opt.staging_bytes = 128 << 10;  // two chunks: save() waits for the writer
  Opened o = open_ck(opt);
  ASSERT_TRUE(o.ck);
  const std::size_t n = (8 << 20) + 1000;
  const auto want1 = pattern(11, n);
  const auto want2 = pattern(12, n);
  const auto side1 = pattern(13, 70000);
  // One buffer for both steps, changed in place, like training parameters.
  std::vector<unsigned char> params = want1;
  std::vector<unsigned char> side = side1;
  auto h1 = o.ck->save(1, {view("params", params), view("side", side)}, {{"step", 1}});
  ASSERT_TRUE(h1) << h1.error().message;
  params = want2;                         // the next training step
  std::fill(side.begin(), side.end(), 0);  // and scribbles
  auto h2 = o.ck->save(2, {view("params", params)}, {{"step", 2}});
  ASSERT_TRUE(h2) << h2.error().message;
  std::fill(params.begin(), params.end(), 0xEE);
  ASSERT_TRUE(h2->wait());
  EXPECT_TRUE(h1->done()) << "step 2 committed before step 1";
  ASSERT_TRUE(h1->wait());
  auto r1 = o.ck->open_reader(1);
  ASSERT_TRUE(r1) << r1.error().message;
  EXPECT_TRUE(read_blob(*r1, "params").first == want1) << "step 1 does not hold the bytes passed to save()";
  EXPECT_TRUE(read_blob(*r1, "side").first == side1);
  auto r2 = o.ck->open_reader(2);
  ASSERT_TRUE(r2) << r2.error().message;
  EXPECT_TRUE(read_blob(*r2, "params").first == want2) << "step 2 does not hold the bytes passed to save()";
  EXPECT_EQ(o.ck->latest(), std::optional<std::uint64_t>(2));
  EXPECT_TRUE(no_invalid_commits(opt.root));
}

TEST(ReliabilityOverlap, DestroyingTheCheckpointerFinishesSavesInFlight) {
  TempDir dir("pacer-overlap-");
  ckpt::Options opt = small_options(dir.path() + "/root");
  opt.staging_bytes = 128 << 10;
  std::vector<ckpt::SaveHandle> handles;
  {
    Opened o = open_ck(opt);
    ASSERT_TRUE(o.ck);
    for (std::uint64_t s = 1; s <= 3; ++s) {
      auto buffers = crash::make_step(s);
      auto h = o.ck->save(s, crash::views(s, buffers), {{"step", s}});
      ASSERT_TRUE(h) << h.error().message;
      handles.push_back(*h);
    }
  }  // no wait(): the destructor must finish them
  for (auto& h : handles) {
    EXPECT_TRUE(h.done());
    EXPECT_TRUE(h.wait());
  }
  for (std::uint64_t s = 1; s <= 3; ++s) {
    auto r = ckpt::Reader::open(opt.root + "/" + ckpt::step_dir_name(s));
    ASSERT_TRUE(r) << r.error().message;
    EXPECT_TRUE(holds_crash_step(*r, s));
  }
}

}  // namespace
