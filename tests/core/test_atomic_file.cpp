#include "pacer/core/atomic_file.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>
#include <atomic>

#include "test_util.hpp"

namespace pacer {
namespace {

namespace fs = std::filesystem;
using test::contains;

// Each test gets a fresh directory so "no leftovers" can be checked by listing it.
class AtomicFileTest : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return (fs::path(dir_.path()) / name).string(); }

  static std::string slurp(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  test::TempDir dir_{"pacer_atomic_"};
};

TEST_F(AtomicFileTest, CreatesNewFile) {
  const std::string p = path("report.json");
  ASSERT_TRUE(write_file_atomic(p, "hello\n").ok());
  EXPECT_EQ(slurp(p), "hello\n");
}

TEST_F(AtomicFileTest, ReplacesExistingContent) {
  const std::string p = path("report.json");
  ASSERT_TRUE(write_file_atomic(p, "a much longer first version of the file\n").ok());
  ASSERT_TRUE(write_file_atomic(p, "short\n").ok());
  // A shorter second write must not leave a tail of the first.
  EXPECT_EQ(slurp(p), "short\n");
}

TEST_F(AtomicFileTest, EmptyAndBinaryContents) {
  const std::string p = path("blob");
  ASSERT_TRUE(write_file_atomic(p, "").ok());
  EXPECT_TRUE(fs::exists(p));
  EXPECT_EQ(fs::file_size(p), 0u);

  const std::string binary("a\0b\xff\n\0", 6);
  ASSERT_TRUE(write_file_atomic(p, binary).ok());
  auto back = read_file(p);
  ASSERT_TRUE(back.has_value()) << back.error().message;
  EXPECT_EQ(*back, binary);
}

TEST_F(AtomicFileTest, LeavesNoTemporaryFilesBehind) {
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(write_file_atomic(path("a.txt"), "version " + std::to_string(i)).ok());
    ASSERT_TRUE(write_file_atomic(path("b.txt"), "other " + std::to_string(i)).ok());
  }
  EXPECT_EQ(dir_.entries(), (std::set<std::string>{"a.txt", "b.txt"}));
}

TEST_F(AtomicFileTest, UsesUmaskPermissionsNotMkstempDefaults) {
  const mode_t old = ::umask(022);
  const Status st = write_file_atomic(path("perm.txt"), "x");
  ::umask(old);
  ASSERT_TRUE(st.ok()) << st.error().message;
  struct stat sb {};
  ASSERT_EQ(::stat(path("perm.txt").c_str(), &sb), 0);
  EXPECT_EQ(sb.st_mode & 0777, 0644u);
}

// Writers on many threads (shard indexes are built in parallel) must never
// touch the process umask: reading it by setting it once left it at 0.
TEST_F(AtomicFileTest, ParallelWritersLeaveTheUmaskAlone) {
  const mode_t old = ::umask(027);
  std::vector<std::thread> ts;
  std::atomic<int> failed{0};
  for (int t = 0; t < 8; ++t)
    ts.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i)
        if (!write_file_atomic(path("f" + std::to_string(t) + "-" + std::to_string(i)), "x", Durability::kCache).ok()) ++failed;
    });
  for (auto& th : ts) th.join();
  const mode_t now = ::umask(old);
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(now, 027u);
  struct stat sb {};
  ASSERT_EQ(::stat(path("f7-49").c_str(), &sb), 0);
  EXPECT_EQ(sb.st_mode & 0777, 0640u);
  EXPECT_EQ(dir_.entries().size(), 400u);  // no temporary file left behind
}

TEST_F(AtomicFileTest, CacheDurabilityStillReplacesAtomically) {
  ASSERT_TRUE(write_file_atomic(path("c.bin"), "old").ok());
  ASSERT_TRUE(write_file_atomic(path("c.bin"), "new contents", Durability::kCache).ok());
  EXPECT_EQ(slurp(path("c.bin")), "new contents");
  EXPECT_EQ(dir_.entries(), (std::set<std::string>{"c.bin"}));
}

TEST_F(AtomicFileTest, PathWithoutDirectoryWritesToCurrentDirectory) {
  const fs::path cwd = fs::current_path();
  fs::current_path(dir_.path());
  const Status st = write_file_atomic("plain.txt", "here");
  fs::current_path(cwd);
  ASSERT_TRUE(st.ok()) << st.error().message;
  EXPECT_EQ(slurp(path("plain.txt")), "here");
  EXPECT_EQ(dir_.entries(), (std::set<std::string>{"plain.txt"}));
}

TEST_F(AtomicFileTest, MissingDirectoryFailsNamingThePath) {
  const std::string p = path("no/such/dir/report.json");
  const Status st = write_file_atomic(p, "x");
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().kind, ErrorKind::kIo);
  EXPECT_TRUE(contains(st.error().message, p));
  EXPECT_FALSE(fs::exists(path("no")));
  EXPECT_TRUE(dir_.entries().empty());
}

TEST_F(AtomicFileTest, FailedWriteLeavesOtherFilesIntact) {
  const std::string good = path("good.json");
  ASSERT_TRUE(write_file_atomic(good, "{\"ok\": true}\n").ok());
  const Status st = write_file_atomic(path("missing/good.json"), "garbage");
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(slurp(good), "{\"ok\": true}\n");
  EXPECT_EQ(dir_.entries(), (std::set<std::string>{"good.json"}));
}

TEST_F(AtomicFileTest, FailedRenameLeavesTargetUntouchedAndNoTemporary) {
  // A non-empty directory cannot be renamed over, even as root: the rename
  // step fails after the temporary file was written.
  const std::string target = path("target");
  fs::create_directory(target);
  ASSERT_TRUE(write_file_atomic(target + "/inside.txt", "keep me").ok());

  const Status st = write_file_atomic(target, "replacement");
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().kind, ErrorKind::kIo);
  EXPECT_TRUE(contains(st.error().message, target));
  EXPECT_TRUE(fs::is_directory(target));
  EXPECT_EQ(slurp(target + "/inside.txt"), "keep me");
  EXPECT_EQ(dir_.entries(), (std::set<std::string>{"target"}));
}

TEST_F(AtomicFileTest, CommitInOrderPlacesEveryGroupAndLeavesNoTemporaries) {
  ASSERT_TRUE(write_file_atomic(path("data.bin"), "old data").ok());
  auto data = AtomicFileWriter::create(path("data.bin")).value();
  auto index = AtomicFileWriter::create(path("data.idx")).value();
  auto manifest = AtomicFileWriter::create(path("data.json")).value();
  std::string big(3u << 20, 'x');
  for (std::size_t i = 0; i < big.size(); i += 4096) big[i] = static_cast<char>('a' + i / 4096 % 26);
  ASSERT_TRUE(data.write(big.data(), big.size() / 2).ok());
  data.start_writeback();  // a hint mid-file: the rest is still written and kept
  ASSERT_TRUE(data.write(big.data() + big.size() / 2, big.size() - big.size() / 2).ok());
  ASSERT_TRUE(index.write("idx", 3).ok());
  ASSERT_TRUE(manifest.write("{}", 2).ok());
  // Nothing replaced before the commit.
  EXPECT_EQ(slurp(path("data.bin")), "old data");
  EXPECT_FALSE(fs::exists(path("data.json")));
  ASSERT_TRUE(commit_in_order({{&data, &index}, {&manifest}}).ok());
  EXPECT_EQ(slurp(path("data.bin")), big);
  EXPECT_EQ(slurp(path("data.idx")), "idx");
  EXPECT_EQ(slurp(path("data.json")), "{}");
  EXPECT_EQ(dir_.entries(), (std::set<std::string>{"data.bin", "data.idx", "data.json"}));
  // A committed writer is not committed twice.
  const Status again = commit_in_order({{&manifest}});
  ASSERT_FALSE(again.ok());
  EXPECT_TRUE(contains(again.error().message, "data.json"));
}

TEST_F(AtomicFileTest, CommitInOrderStopsAtAFailedRenameAndLaterGroupsStayOld) {
  // A non-empty directory cannot be renamed over: the first group fails, so
  // the manifest of the second must not appear and no temporary is left.
  const std::string target = path("target");
  fs::create_directory(target);
  ASSERT_TRUE(write_file_atomic(target + "/inside.txt", "keep me").ok());
  auto blocked = AtomicFileWriter::create(target).value();
  auto manifest = AtomicFileWriter::create(path("manifest.json")).value();
  ASSERT_TRUE(blocked.write("x", 1).ok());
  ASSERT_TRUE(manifest.write("{}", 2).ok());
  const Status st = commit_in_order({{&blocked}, {&manifest}});
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(contains(st.error().message, target));
  EXPECT_FALSE(fs::exists(path("manifest.json")));
  EXPECT_EQ(slurp(target + "/inside.txt"), "keep me");
  EXPECT_EQ(dir_.entries(), (std::set<std::string>{"target"}));
}

TEST_F(AtomicFileTest, ReadFileReturnsWholeContent) {
  std::string big(1 << 20, 'x');
  big[12345] = '\n';
  ASSERT_TRUE(write_file_atomic(path("big"), big).ok());
  auto back = read_file(path("big"));
  ASSERT_TRUE(back.has_value()) << back.error().message;
  EXPECT_EQ(*back, big);
}

TEST_F(AtomicFileTest, ReadMissingFileNamesThePath) {
  const std::string p = path("absent.toml");
  auto r = read_file(p);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().kind, ErrorKind::kIo);
  EXPECT_TRUE(contains(r.error().message, p));
}

TEST_F(AtomicFileTest, ReadDirectoryIsAnErrorNamingThePath) {
  // A directory is not a file: returning "" would let a caller treat it as
  // an empty profile or baseline.
  auto r = read_file(dir_.path());
  ASSERT_FALSE(r.has_value()) << "read a directory as '" << *r << "'";
  EXPECT_TRUE(contains(r.error().message, dir_.path()));
}

}  // namespace
}  // namespace pacer
