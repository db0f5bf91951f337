// pacer bcast on one rank (the path `pacer bcast` takes without MPI): symlinked
// sources, a source that changes during the copy, and a destination that exists.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <thread>

#include "pacer/comm/bcast.hpp"
#include "test_util.hpp"

namespace pacer::comm {
namespace {

namespace fs = std::filesystem;
using test::contains;
using test::TempDir;

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Whether `p` holds `want`, without printing binary contents on failure.
::testing::AssertionResult holds(const fs::path& p, const std::string& want) {
  const std::string got = slurp(p);
  if (got == want) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << p.string() << ": " << got.size() << " bytes, not the " << want.size() << " expected";
}

std::string bytes(std::size_t n, char seed) {
  std::string s(n, '\0');
  for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>(seed + i * 7 + i / 251);
  return s;
}

// One rank that runs `hook` once, right after its `at`-th chunk went out:
// the moment to change the source under the copy.
class Hooked final : public Communicator {
 public:
  Hooked(std::unique_ptr<Communicator> inner, int at, std::function<void()>* hook)
      : inner_(std::move(inner)), at_(at), hook_(hook) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  void barrier() override { inner_->barrier(); }
  bool all_ok(bool ok) override { return inner_->all_ok(ok); }
  std::string broadcast(const std::string& v, int root) override { return inner_->broadcast(v, root); }
  void broadcast_bytes(void* data, std::size_t n, int root) override {
    inner_->broadcast_bytes(data, n, root);
    if (++calls_ == at_ && *hook_) (*hook_)();
  }
  std::unique_ptr<Communicator> split_node() override { return wrap(inner_->split_node()); }
  std::unique_ptr<Communicator> split(int color) override { return wrap(inner_->split(color)); }

 private:
  std::unique_ptr<Communicator> wrap(std::unique_ptr<Communicator> c) {
    return c ? std::make_unique<Hooked>(std::move(c), at_, hook_) : nullptr;
  }
  std::unique_ptr<Communicator> inner_;
  int at_;
  std::function<void()>* hook_;
  int calls_ = 0;
};

BcastOptions small_chunks() {
  BcastOptions o;
  o.chunk_bytes = 4096;
  return o;
}

Expected<BcastStats> bcast(const fs::path& src, const fs::path& dst, const BcastOptions& o = small_chunks()) {
  auto one = single_rank();
  return broadcast_path(*one, src.string(), dst.string(), o);
}

std::set<std::string> leftovers(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.find(".partial-") != std::string::npos || n.find(".tmp-") != std::string::npos || n.find(".old-") != std::string::npos)
      out.insert(n);
  }
  return out;
}

// A Hugging Face cache: snapshots/<rev>/ holds symlinks into ../../blobs/.
TEST(Bcast, SymlinkedFilesAreCopiedAsTheirTargets) {
  TempDir d("bcast-hf-");
  const fs::path repo = fs::path(d.path()) / "models--org--tiny";
  const std::string weights = bytes(10000, 3), config = "{\"hidden\": 8}\n";
  d.file("models--org--tiny/blobs/aaa111", weights);
  d.file("models--org--tiny/blobs/bbb222", config);
  const fs::path snap = repo / "snapshots" / "rev1";
  fs::create_directories(snap / "sub");
  fs::create_symlink("../../blobs/aaa111", snap / "model.safetensors");
  fs::create_symlink("../../../blobs/bbb222", snap / "sub" / "config.json");
  const fs::path dst = fs::path(d.path()) / "local";
  auto st = bcast(snap, dst);
  ASSERT_TRUE(st) << st.error().message;
  EXPECT_EQ(st->files, 2u);
  EXPECT_EQ(st->bytes, weights.size() + config.size());
  EXPECT_FALSE(fs::is_symlink(dst / "model.safetensors"));
  EXPECT_TRUE(holds(dst / "model.safetensors", weights));
  EXPECT_TRUE(holds(dst / "sub" / "config.json", config));
  // Written under the links' names inside DST, nowhere else.
  std::set<std::string> top;
  for (const auto& e : fs::directory_iterator(d.path())) top.insert(e.path().filename().string());
  EXPECT_EQ(top, (std::set<std::string>{"local", "models--org--tiny"}));
  std::set<std::string> in_dst;
  for (const auto& e : fs::recursive_directory_iterator(dst)) in_dst.insert(e.path().lexically_relative(dst).string());
  EXPECT_EQ(in_dst, (std::set<std::string>{"model.safetensors", "sub", "sub/config.json"}));
  EXPECT_TRUE(holds(repo / "blobs" / "aaa111", weights));
  // Again: the same bytes, nothing to do.
  st = bcast(snap, dst);
  ASSERT_TRUE(st) << st.error().message;
  EXPECT_TRUE(st->unchanged);
}

TEST(Bcast, LinksToDirectoriesDanglingLinksAndFifosAreRefused) {
  TempDir d("bcast-links-");
  const fs::path src = fs::path(d.path()) / "src";
  d.file("src/a.bin", "a");
  d.file("elsewhere/b.bin", "b");
  fs::create_directory_symlink("../elsewhere", src / "dir-link");
  auto st = bcast(src, fs::path(d.path()) / "out1");
  ASSERT_FALSE(st);
  EXPECT_EQ(st.error().kind, ErrorKind::kUsage);
  EXPECT_TRUE(contains(st.error().message, "dir-link"));
  EXPECT_TRUE(contains(st.error().message, "a symlink to the directory"));
  fs::remove(src / "dir-link");
  fs::create_symlink("nowhere.bin", src / "dangling");
  st = bcast(src, fs::path(d.path()) / "out2");
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.error().message, "dangling"));
  fs::remove(src / "dangling");
  ASSERT_EQ(::mkfifo((src / "pipe").c_str(), 0600), 0);
  st = bcast(src, fs::path(d.path()) / "out3");
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.error().message, "pipe"));
  EXPECT_FALSE(fs::exists(fs::path(d.path()) / "out3"));
}

// The source is written to after its listing, while its chunks are on the
// wire: the copy would mix two versions, so the bcast fails and puts nothing
// in place.
TEST(Bcast, SourceChangedDuringTheCopyFails) {
  for (const bool same_size : {true, false}) {
    TempDir d("bcast-change-");
    const fs::path src = fs::path(d.path()) / "src";
    d.file("src/a.bin", bytes(40000, 1));
    d.file("src/b.bin", bytes(100, 2));
    std::function<void()> hook = [&] {
      // Past the file system's timestamp granularity, as a real writer would be.
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      std::fstream f(src / "a.bin", std::ios::in | std::ios::out | std::ios::binary);
      if (same_size) {
        f.seekp(0);
        f << "rewritten";
      } else {
        f.seekp(0, std::ios::end);
        f << "appended";
      }
    };
    Hooked world(single_rank(), 2, &hook);
    const fs::path dst = fs::path(d.path()) / "dst";
    auto st = broadcast_path(world, src.string(), dst.string(), small_chunks());
    ASSERT_FALSE(st) << "same_size=" << same_size;
    EXPECT_TRUE(contains(st.error().message, "a.bin"));
    EXPECT_TRUE(contains(st.error().message, "changed")) << st.error().message;
    EXPECT_FALSE(fs::exists(dst));
    EXPECT_EQ(leftovers(d.path()), std::set<std::string>{});
  }
}

TEST(Bcast, SameContentIsNothingToDo) {
  TempDir d("bcast-again-");
  const fs::path src = fs::path(d.path()) / "src";
  d.file("src/model.bin", bytes(50000, 5));
  d.file("src/deep/meta.json", "{}\n");
  d.file("src/empty", "");
  ::chmod((src / "model.bin").c_str(), 0640);
  const fs::path dst = fs::path(d.path()) / "dst";
  auto first = bcast(src, dst);
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_FALSE(first->unchanged);
  EXPECT_EQ(fs::status(dst / "model.bin").permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  struct stat before {};
  ASSERT_EQ(::stat((dst / "model.bin").c_str(), &before), 0);
  // A requeued job broadcasts again: OK, and DST is left as it was.
  auto again = bcast(src, dst);
  ASSERT_TRUE(again) << again.error().message;
  EXPECT_TRUE(again->unchanged);
  EXPECT_EQ(again->bytes_written, 0u);
  struct stat after {};
  ASSERT_EQ(::stat((dst / "model.bin").c_str(), &after), 0);
  EXPECT_EQ(after.st_ino, before.st_ino);
  EXPECT_EQ(after.st_mtim.tv_nsec, before.st_mtim.tv_nsec);
  EXPECT_EQ(leftovers(d.path()), std::set<std::string>{});
  // A single file, too.
  ASSERT_TRUE(bcast(src / "model.bin", fs::path(d.path()) / "one.bin"));
  auto one = bcast(src / "model.bin", fs::path(d.path()) / "one.bin");
  ASSERT_TRUE(one) << one.error().message;
  EXPECT_TRUE(one->unchanged);
}

TEST(Bcast, DifferentContentReplacesTheWholeDestination) {
  TempDir d("bcast-replace-");
  const fs::path src = fs::path(d.path()) / "src";
  std::string a = bytes(30000, 1), b = bytes(20000, 2), c = bytes(9000, 3);
  d.file("src/a.bin", a);
  d.file("src/b.bin", b);
  d.file("src/c.bin", c);
  const fs::path dst = fs::path(d.path()) / "dst";
  ASSERT_TRUE(bcast(src, dst));
  auto check_copy = [&] {
    EXPECT_TRUE(holds(dst / "a.bin", a));
    EXPECT_TRUE(holds(dst / "b.bin", b));
    EXPECT_TRUE(holds(dst / "c.bin", c));
    EXPECT_EQ(leftovers(d.path()), std::set<std::string>{});
  };
  // One byte differs in the last chunk of the middle file: the files and
  // chunks before it, which matched, must reach the new copy too.
  b[b.size() - 10] ^= 0x40;
  d.file("src/b.bin", b);
  auto st = bcast(src, dst);
  ASSERT_TRUE(st) << st.error().message;
  EXPECT_FALSE(st->unchanged);
  check_copy();
  // A file that is not in the source any more, or a different mode, differs too.
  d.file("dst/stray.txt", "left over");
  st = bcast(src, dst);
  ASSERT_TRUE(st) << st.error().message;
  EXPECT_FALSE(st->unchanged);
  EXPECT_FALSE(fs::exists(dst / "stray.txt"));
  check_copy();
  ::chmod((src / "c.bin").c_str(), 0700);
  st = bcast(src, dst);
  ASSERT_TRUE(st);
  EXPECT_FALSE(st->unchanged);
  EXPECT_EQ(fs::status(dst / "c.bin").permissions() & fs::perms::all, fs::perms::owner_all);
  // A single file is replaced by one rename.
  ASSERT_TRUE(bcast(src / "a.bin", fs::path(d.path()) / "one.bin"));
  a[0] ^= 1;
  d.file("src/a.bin", a);
  st = bcast(src / "a.bin", fs::path(d.path()) / "one.bin");
  ASSERT_TRUE(st);
  EXPECT_FALSE(st->unchanged);
  EXPECT_TRUE(holds(fs::path(d.path()) / "one.bin", a));
}

// A bcast that fails while replacing an existing copy leaves that copy whole.
TEST(Bcast, FailedReplacementLeavesTheOldCopy) {
  TempDir d("bcast-keep-");
  const fs::path src = fs::path(d.path()) / "src";
  const std::string old_a = bytes(40000, 1);
  d.file("src/a.bin", old_a);
  const fs::path dst = fs::path(d.path()) / "dst";
  ASSERT_TRUE(bcast(src, dst));
  d.file("src/a.bin", bytes(40000, 9));  // different from the copy, from the first chunk on
  std::function<void()> hook = [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    std::ofstream(src / "a.bin", std::ios::app) << "more";
  };
  Hooked world(single_rank(), 3, &hook);
  auto st = broadcast_path(world, src.string(), dst.string(), small_chunks());
  ASSERT_FALSE(st);
  EXPECT_TRUE(holds(dst / "a.bin", old_a));
  EXPECT_EQ(leftovers(d.path()), std::set<std::string>{});
}

TEST(Bcast, ADirectoryNeverReplacesAFileNorTheOtherWay) {
  TempDir d("bcast-kind-");
  d.file("src/a.bin", "a");
  const std::string file = d.file("plain", "not a directory");
  auto st = bcast(fs::path(d.path()) / "src", file);
  ASSERT_FALSE(st);
  EXPECT_EQ(st.error().kind, ErrorKind::kUsage);
  EXPECT_EQ(slurp(file), "not a directory");
  st = bcast(fs::path(d.path()) / "src" / "a.bin", fs::path(d.path()) / "src");
  ASSERT_FALSE(st);
  EXPECT_TRUE(fs::is_directory(fs::path(d.path()) / "src"));
}

}  // namespace
}  // namespace pacer::comm
