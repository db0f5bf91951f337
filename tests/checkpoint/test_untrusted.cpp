// Checkpoints from untrusted hands: manifests that are FIFOs or devices,
// crafted paths and sizes, tiers that are one directory, read-only roots.
// None may hang, crash, allocate beyond the files' real size or read outside
// the step directory; a bad step is skipped with a warning naming it.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "blobs.hpp"
#include "pacer/checkpoint.hpp"
#include "test_util.hpp"

namespace pacer::ckpt {
namespace {

namespace fs = std::filesystem;
using test::contains;
using test::pattern;
using test::TempDir;
using test_blobs::read_all;
using test_blobs::small_options;
using test_blobs::view;

// Steps 1 and 2 under root; tests damage step 2 and expect step 1 back.
class Untrusted : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = dir_.path() + "/root";
    auto ck = Checkpointer::open(options()).value();
    for (std::uint64_t s = 1; s <= 2; ++s) ASSERT_TRUE(ck->save(s, {view("w", data_, "float32", {2500}), view("b", small_)})->wait());
    step2_ = root_ + "/" + step_dir_name(2);
    manifest_ = step2_ + "/" + kManifestName;
    good_ = Reader::open(step2_).value().manifest();
  }

  Options options() {
    Options o = small_options(root_);
    o.warn = [this](const std::string& w) { warnings_.push_back(w); };
    return o;
  }

  // latest() of a fresh checkpointer, and whether a warning named step 2.
  std::optional<std::uint64_t> latest() {
    warnings_.clear();
    auto ck = Checkpointer::open(options()).value();
    return ck->latest();
  }
  bool warned_step2(const std::string& also = "") const {
    for (const auto& w : warnings_)
      if (contains(w, "step 2") && contains(w, also)) return true;
    return false;
  }

  // Writes m as step 2's manifest, with a valid self-checksum: what a
  // crafted manifest looks like.
  void write_manifest(const Manifest& m) {
    fs::remove(manifest_);
    std::ofstream(manifest_) << to_json(m).dump();
  }

  TempDir dir_{"pacer-untrusted-"};
  std::string root_, step2_, manifest_;
  Manifest good_;
  std::vector<std::string> warnings_;
  const std::vector<unsigned char> data_ = pattern(10000, 1);
  const std::vector<unsigned char> small_ = pattern(3000, 2);
};

// Runs f; if it is still running after `limit`, opens the FIFO for writing
// (which frees a reader blocked in open) until f returns. True when f had to
// be freed: it hung.
bool hangs_on_fifo(const std::string& fifo, const std::function<void()>& f, std::chrono::seconds limit = std::chrono::seconds(10)) {
  std::atomic<bool> done{false}, freed{false};
  std::thread watchdog([&] {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!done && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    while (!done) {
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
      if (fd >= 0) {
        freed = true;
        ::close(fd);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  f();
  done = true;
  watchdog.join();
  return freed;
}

TEST_F(Untrusted, FifoManifestNeitherHangsListNorLatest) {
  fs::remove(manifest_);
  ASSERT_EQ(::mkfifo(manifest_.c_str(), 0644), 0) << std::strerror(errno);
  std::vector<Entry> entries;
  EXPECT_FALSE(hangs_on_fifo(manifest_, [&] { entries = list(root_, false); })) << "list() blocked opening a FIFO manifest";
  bool seen = false;
  for (const auto& e : entries)
    if (e.step == 2) {
      seen = true;
      EXPECT_FALSE(e.committed);
      EXPECT_TRUE(contains(e.problem, kManifestName)) << e.problem;
    }
  EXPECT_TRUE(seen);
  std::optional<std::uint64_t> l;
  EXPECT_FALSE(hangs_on_fifo(manifest_, [&] { l = latest(); })) << "latest() blocked opening a FIFO manifest";
  EXPECT_EQ(l, std::optional<std::uint64_t>(1));
  EXPECT_TRUE(warned_step2("not a regular file")) << (warnings_.empty() ? "" : warnings_[0]);
}

TEST_F(Untrusted, ManifestLinkedToDevZeroIsNotRead) {
  fs::remove(manifest_);
  fs::create_symlink("/dev/zero", manifest_);
  auto r = Reader::open(step2_);
  ASSERT_FALSE(r) << "read a manifest from /dev/zero";
  EXPECT_TRUE(contains(r.error().message, manifest_)) << r.error().message;
  EXPECT_TRUE(contains(r.error().message, "not a regular file")) << r.error().message;
  EXPECT_EQ(latest(), std::optional<std::uint64_t>(1));
}

TEST_F(Untrusted, BlobFileOutsideTheStepDirectoryIsRefused) {
  const std::string outside = dir_.file("outside.bin", std::string(20000, 'x'));
  for (const std::string& name : {std::string("/etc/passwd"), outside, std::string("../") + step_dir_name(1) + "/rank-00000.bin",
                                 std::string("sub/rank-00000.bin"), std::string(".."), std::string("")}) {
    SCOPED_TRACE(name);
    Manifest m = good_;
    std::error_code ec;
    const auto size = fs::file_size(fs::path(step2_) / name, ec);
    m.files = {{name, ec ? 0 : size}};
    for (auto& b : m.blobs) b.file = name;
    write_manifest(m);
    auto r = Reader::open(step2_);
    ASSERT_FALSE(r) << "accepted a blob in file '" << name << "'";
    EXPECT_TRUE(contains(r.error().message, "not a plain name")) << r.error().message;
    EXPECT_EQ(latest(), std::optional<std::uint64_t>(1));
    EXPECT_TRUE(warned_step2());
  }
  // A blob naming a file the manifest does not list.
  Manifest m = good_;
  m.blobs[0].file = "rank-00001.bin";
  write_manifest(m);
  auto r = Reader::open(step2_);
  ASSERT_FALSE(r);
  EXPECT_TRUE(contains(r.error().message, "not one of the step's data files")) << r.error().message;
}

// Sizes and offsets that the file cannot hold: the step is invalid at open
// (nothing is allocated from them) and the older step is used.
TEST_F(Untrusted, BlobOutsideItsFileMakesTheStepInvalid) {
  const std::uint64_t huge = 1ull << 62;
  struct Edit {
    const char* what;
    std::function<void(Manifest&)> apply;
  };
  const std::vector<Edit> edits = {
      {"size 2^62 in one chunk", [&](Manifest& m) {
         m.chunk_bytes = huge;
         for (auto& b : m.blobs) b.chunk_hashes.resize(1);
         m.blobs[0].size = huge;
         m.blobs[0].shape = {static_cast<std::int64_t>(huge / 4)};
       }},
      {"offset 2^62", [&](Manifest& m) { m.blobs[1].offset = huge; }},
      {"offset + size wraps", [&](Manifest& m) {
         m.blobs[1].offset = UINT64_MAX - 100;
         m.blobs[1].size = 3000;
       }},
      {"one byte past the end", [&](Manifest& m) { m.blobs[1].offset = m.files[0].second - m.blobs[1].size + 1; }},
  };
  for (const auto& e : edits) {
    SCOPED_TRACE(e.what);
    Manifest m = good_;
    e.apply(m);
    write_manifest(m);
    auto r = Reader::open(step2_);
    ASSERT_FALSE(r) << "opened a step whose blob lies outside its file";
    EXPECT_TRUE(contains(r.error().message, "outside its file")) << r.error().message;
    EXPECT_EQ(latest(), std::optional<std::uint64_t>(1));
    EXPECT_TRUE(warned_step2("outside its file"));
    // load() asks for no target of the bad step and reads step 1.
    auto ck = Checkpointer::open(options()).value();
    std::vector<unsigned char> w(data_.size());
    std::uint64_t asked_for = 0;
    auto loaded = ck->load([&](const Reader::Logical& l) {
      asked_for = std::max(asked_for, l.size);
      return l.name == "w" && l.size == w.size() ? LoadTarget{w.data(), 0, w.size()} : LoadTarget{};
    });
    ASSERT_TRUE(loaded) << loaded.error().message;
    EXPECT_EQ(loaded->manifest().step, 1u);
    EXPECT_LE(asked_for, data_.size());
    EXPECT_EQ(w, data_);
  }
}

TEST_F(Untrusted, ChunkCountNearTwoToTheSixtyFourDoesNotWrap) {
  Manifest m = good_;
  m.blobs[1].size = UINT64_MAX;  // (size + chunk_bytes - 1) / chunk_bytes would be 0 chunks
  m.blobs[1].chunk_hashes.clear();
  auto back = manifest_from_json(to_json(m).dump(), "M");
  ASSERT_FALSE(back) << "a blob of 2^64-1 bytes with no chunk checksums";
  EXPECT_TRUE(contains(back.error().message, "chunks")) << back.error().message;
}

TEST(UntrustedReads, ByteRangesThatWrapAreRefused) {
  TempDir dir("pacer-untrusted-");
  auto ck = Checkpointer::open(small_options(dir.path())).value();
  const auto d = pattern(5000, 3);
  ASSERT_TRUE(ck->save(1, {view("x", d)})->wait());
  auto r = Reader::open(dir.path() + "/" + step_dir_name(1)).value();
  unsigned char buf[16];
  EXPECT_FALSE(r.read("x", buf, sizeof buf, UINT64_MAX - 4)) << "offset + size wraps to a small number";
  EXPECT_FALSE(r.covers("x", sizeof buf, UINT64_MAX - 4));
  EXPECT_TRUE(r.covers("x", sizeof buf, 100));
}

TEST(UntrustedTiers, FastTierThatIsTheRootIsAUsageError) {
  TempDir dir("pacer-untrusted-");
  const std::string root = dir.path() + "/root";
  fs::create_directories(root);
  fs::create_directory_symlink(root, dir.path() + "/alias");
  for (const std::string& fast : {root, root + "/", root + "/.", dir.path() + "/alias"}) {
    SCOPED_TRACE(fast);
    Options o = small_options(root);
    o.fast_tier = fast;
    auto ck = Checkpointer::open(o);
    ASSERT_FALSE(ck) << "accepted a fast tier that is the root";
    EXPECT_EQ(ck.error().kind, ErrorKind::kUsage);
    EXPECT_TRUE(contains(ck.error().message, fast)) << ck.error().message;
    EXPECT_TRUE(contains(ck.error().message, root)) << ck.error().message;
  }
  // A fast tier inside the root (or the root inside it) keeps retention apart: each lists only its own steps.
  Options o = small_options(root);
  o.fast_tier = root + "/fast";
  o.keep_last = 1;
  auto ck = Checkpointer::open(o).value();
  const auto d = pattern(5000, 4);
  for (std::uint64_t s = 1; s <= 3; ++s) ASSERT_TRUE(ck->save(s, {view("x", d)})->wait_persistent());
  EXPECT_EQ(list(root, false).size(), 1u);
  EXPECT_EQ(list(root + "/fast", false).size(), 1u);
  EXPECT_EQ(ck->latest(), 3u);
}

// A read-only root (a read-only bind mount as root, else a tree without write
// permission) loads; only save() is refused, naming the root.
constexpr fs::perms kAllWrite = fs::perms::owner_write | fs::perms::group_write | fs::perms::others_write;

TEST(UntrustedReadOnly, ReadOnlyRootLoadsButDoesNotSave) {
  TempDir dir("pacer-untrusted-");
  const std::string src = dir.path() + "/src";
  const auto d = pattern(9000, 5);
  {
    auto ck = Checkpointer::open(small_options(src)).value();
    ASSERT_TRUE(ck->save(1, {view("x", d)})->wait());
  }
  std::string root = dir.path() + "/ro";
  fs::create_directories(root);
  bool mounted = false;
  if (::mount(src.c_str(), root.c_str(), nullptr, MS_BIND, nullptr) == 0) {
    mounted = ::mount(nullptr, root.c_str(), nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY, nullptr) == 0;
    if (!mounted) ::umount2(root.c_str(), MNT_DETACH);
  }
  if (!mounted) {
    fs::remove(root);
    fs::copy(src, root, fs::copy_options::recursive);
    for (const auto& e : fs::recursive_directory_iterator(root)) fs::permissions(e.path(), kAllWrite, fs::perm_options::remove);
    fs::permissions(root, kAllWrite, fs::perm_options::remove);
    if (::access(root.c_str(), W_OK) == 0) GTEST_SKIP() << "cannot bind-mount read-only and write permission does not bind here (root)";
  }
  struct Unmount {
    std::string dir;
    bool mounted;
    ~Unmount() {
      if (mounted && ::umount2(dir.c_str(), 0) != 0) ::umount2(dir.c_str(), MNT_DETACH);
      if (!mounted) {
        std::error_code ec;
        fs::permissions(dir, fs::perms::owner_all, fs::perm_options::add, ec);
        for (const auto& e : fs::recursive_directory_iterator(dir, ec)) fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add, ec);
      }
    }
  } unmount{root, mounted};

  auto ck = Checkpointer::open(small_options(root));
  ASSERT_TRUE(ck) << ck.error().message;
  EXPECT_EQ((*ck)->latest(), std::optional<std::uint64_t>(1));
  EXPECT_EQ((*ck)->candidates().size(), 1u);
  std::vector<unsigned char> out(d.size());
  auto loaded = (*ck)->load([&](const Reader::Logical&) { return LoadTarget{out.data(), 0, out.size()}; });
  ASSERT_TRUE(loaded) << loaded.error().message;
  EXPECT_EQ(out, d);
  auto saved = (*ck)->save(2, {view("x", d)});
  ASSERT_FALSE(saved) << "saved into a read-only root";
  EXPECT_TRUE(contains(saved.error().message, root)) << saved.error().message;
  EXPECT_TRUE(contains(saved.error().message, "not writable")) << saved.error().message;
}

}  // namespace
}  // namespace pacer::ckpt
