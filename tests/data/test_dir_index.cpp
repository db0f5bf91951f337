// The directory index (DIR/.pacer-index): written where a dataset open indexes many shards of one
// directory, read instead of SHARD.pidx, merged, rebuilt when stale or corrupt, and refused when
// crafted.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <chrono>
#include <map>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "data/raw_tar.hpp"
#include "data/tmpfs.hpp"
#include "data/tar_internal.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/core/time.hpp"
#include "pacer/data.hpp"
#include "test_util.hpp"

namespace pacer::data {
namespace {

namespace fs = std::filesystem;
using test::contains;
using test::RawTar;
using test::TempDir;
using test::Tmpfs;

std::string slurp(const std::string& path) {
  auto bytes = read_file(path);
  return bytes ? *bytes : std::string();
}

// Replaced through a rename, as pacer writes it: a new inode, never a cached one.
void replace_file(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".new";
  std::ofstream(tmp, std::ios::binary) << bytes;
  fs::rename(tmp, path);
}

// Shard `s` of a test dataset: 1 + s % 3 samples, or `samples` when given.
std::string shard_bytes(int s, int samples = -1, char fill = 'v') {
  RawTar raw;
  const int n = samples >= 0 ? samples : 1 + s % 3;
  for (int i = 0; i < n; ++i) raw.add(fmt::format("s{:03d}k{}.txt", s, i), fmt::format("{} {} ", s, i) + std::string(static_cast<std::size_t>(10 + i), fill));
  return raw.finish();
}

std::vector<std::string> make_shards(const TempDir& d, int from, int to, const std::string& sub = "") {
  std::vector<std::string> paths;
  for (int s = from; s < to; ++s) paths.push_back(d.file(sub + fmt::format("d-{:03d}.tar", s), shard_bytes(s)));
  return paths;
}

std::uint64_t samples_of(const std::vector<std::string>& paths) {
  std::uint64_t n = 0;
  for (const auto& p : paths) {
    const int s = std::stoi(fs::path(p).filename().string().substr(2, 3));
    n += static_cast<std::uint64_t>(1 + s % 3);
  }
  return n;
}

std::string dir_index_of(const TempDir& d, const std::string& sub = "") { return (fs::path(d.path()) / sub / kDirIndexName).string(); }

ino_t inode_of(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

// Every sample of the dataset reads back as shard_bytes wrote it (a key "sNNNkI" holds "NNN I " and
// 10 + I fill bytes).
// The first sample that does not, or "" (usable where gtest's checks are not: in a child process).
std::string bad_read(const std::shared_ptr<Dataset>& ds) {
  for (std::uint64_t i = 0; i < ds->size(); ++i) {
    auto s = ds->read(i);
    if (!s) return fmt::format("{}: {}", i, s.error().message);
    if (s->fields.size() != 1) return fmt::format("{}: {} fields", i, s->fields.size());
    if (s->key.size() < 6 || s->key[4] != 'k') continue;  // renamed by a test
    const int shard = std::stoi(s->key.substr(1, 3)), k = std::stoi(s->key.substr(5));
    if (s->fields[0].second != fmt::format("{} {} ", shard, k) + std::string(static_cast<std::size_t>(10 + k), 'v'))
      return fmt::format("{}: sample {} has other bytes", i, s->key);
  }
  return "";
}
void expect_reads(const std::shared_ptr<Dataset>& ds) { EXPECT_EQ(bad_read(ds), ""); }

// The global number of the first sample of shard `s`.
std::uint64_t first_of(const Dataset& ds, std::size_t s) {
  std::uint64_t n = 0;
  for (std::size_t k = 0; k < s; ++k) n += ds.shard_samples()[k];
  return n;
}

// Seals a crafted directory index: the table's checksum, then the header's.
void reseal(std::string& f) {
  std::uint64_t table = 0;
  std::memcpy(&table, f.data() + 24, 8);
  const std::uint64_t tsum = XXH3_64bits(f.data() + 48, static_cast<std::size_t>(std::min<std::uint64_t>(table, f.size() - 48)));
  std::memcpy(f.data() + 32, &tsum, 8);
  const std::uint64_t hsum = XXH3_64bits(f.data(), 40);
  std::memcpy(f.data() + 40, &hsum, 8);
}

struct Row {
  std::uint64_t offset = 0, bytes = 0;
  std::int64_t written = 0;
};
// The table of a directory index, as the format lays it out (docs/data.md).
std::map<std::string, Row> rows_of(const std::string& file) {
  const std::string f = slurp(file);
  std::map<std::string, Row> out;
  if (f.size() < 48) return out;
  std::uint64_t n = 0;
  std::memcpy(&n, f.data() + 16, 8);
  std::size_t pos = 48;
  for (std::uint64_t i = 0; i < n && pos + 2 <= f.size(); ++i) {
    std::uint16_t len = 0;
    std::memcpy(&len, f.data() + pos, 2);
    Row r;
    const std::string name = f.substr(pos + 2, len);
    pos += 2 + len;
    std::memcpy(&r.offset, f.data() + pos, 8);
    std::memcpy(&r.bytes, f.data() + pos + 8, 8);
    std::memcpy(&r.written, f.data() + pos + 16, 8);
    pos += 24;
    out[name] = r;
  }
  return out;
}

std::int64_t ctime_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return 0;
  return static_cast<std::int64_t>(st.st_ctim.tv_sec) * 1'000'000'000 + st.st_ctim.tv_nsec;
}

void settle() { std::this_thread::sleep_for(std::chrono::milliseconds(2100)); }

// Shards whose directory index one open wrote, settled first: a record hashed within 2 s of its
// shard's change is rebound by a later open, which would rewrite the file the tests expect left alone.
std::vector<std::string> indexed_shards(const TempDir& d, int from, int to) {
  auto paths = make_shards(d, from, to);
  settle();
  auto ds = Dataset::open(paths);
  EXPECT_TRUE(ds) << (ds ? std::string() : ds.error().message);
  return paths;
}

TEST(DirIndex, ADatasetOfManyNewShardsWritesOneFileThatLaterOpensRead) {
  TempDir d("pacer-dirindex-");
  const auto paths = make_shards(d, 0, 40);
  // Settled first: a record hashed within 2 s of its shard's change is rebound by a later open,
  // which would rewrite the file this test expects left alone.
  settle();
  auto ds = Dataset::open(paths);
  ASSERT_TRUE(ds) << ds.error().message;
  EXPECT_EQ((*ds)->size(), samples_of(paths));
  const std::string file = dir_index_of(d);
  ASSERT_TRUE(fs::exists(file));
  for (const auto& p : paths) {
    EXPECT_FALSE(fs::exists(index_path(p))) << "one file for the directory, none per shard";
    auto has = has_index(p);
    ASSERT_TRUE(has) << has.error().message;
    EXPECT_TRUE(*has) << p;
    auto idx = read_index(p, false);
    ASSERT_TRUE(idx) << idx.error().message;
    auto scanned = scan_tar(p);
    ASSERT_TRUE(scanned);
    auto grouped = group_samples(p, *scanned);
    ASSERT_TRUE(grouped);
    ASSERT_EQ(idx->entries.size(), grouped->size());
    for (std::size_t i = 0; i < grouped->size(); ++i) {
      EXPECT_EQ(idx->entries[i].key, (*grouped)[i].key);
      EXPECT_EQ(idx->entries[i].fields[0].offset, (*grouped)[i].fields[0].offset);
    }
  }
  expect_reads(*ds);

  // A later open reads the records and writes nothing.
  const ino_t ino = inode_of(file);
  auto again = Dataset::open(paths);
  ASSERT_TRUE(again) << again.error().message;
  EXPECT_EQ((*again)->size(), samples_of(paths));
  expect_reads(*again);
  EXPECT_EQ(inode_of(file), ino);

  // Fewer new shards than kDirIndexMin in a directory: one SHARD.pidx each.
  const auto few = make_shards(d, 0, static_cast<int>(kDirIndexMin) - 1, "few/");
  auto small = Dataset::open(few);
  ASSERT_TRUE(small) << small.error().message;
  EXPECT_FALSE(fs::exists(dir_index_of(d, "few")));
  for (const auto& p : few) EXPECT_TRUE(fs::exists(index_path(p))) << p;
}

// The directory index is the file beside the shard. "." components and repeated slashes name the
// same directory; ".." is not collapsed: through a symbolic link, "lnk/../x.tar" lies in the
// parent of the link's target, not beside the link.
TEST(DirIndex, ItIsKeptInTheShardsOwnDirectoryThroughLinksAndDots) {
  EXPECT_EQ(shard_dir("./data/x.tar"), "data");
  EXPECT_EQ(shard_dir("data//x.tar"), "data");
  EXPECT_EQ(shard_dir("/a/./b/x.tar"), "/a/b");
  EXPECT_EQ(shard_dir("x.tar"), ".");
  EXPECT_EQ(shard_dir("/x.tar"), "/");
  EXPECT_EQ(shard_dir("a/b/../x.tar"), "a/b/..");
  TempDir d("pacer-dirindex-link-");
  const auto real = make_shards(d, 0, 20, "real/");
  fs::create_directories(fs::path(d.path()) / "real" / "inner");
  fs::create_directory_symlink(fs::path(d.path()) / "real" / "inner", fs::path(d.path()) / "lnk");
  std::vector<std::string> via;
  for (const auto& p : real) via.push_back((fs::path(d.path()) / "lnk" / ".." / fs::path(p).filename()).string());
  auto ds = Dataset::open(via);
  ASSERT_TRUE(ds) << ds.error().message;
  expect_reads(*ds);
  EXPECT_TRUE(fs::exists(dir_index_of(d, "real"))) << "beside the shards";
  EXPECT_FALSE(fs::exists(dir_index_of(d))) << "not beside the link";
  auto again = Dataset::open(real);
  ASSERT_TRUE(again) << again.error().message;
  for (const auto& p : real) {
    auto has = has_index(p);
    ASSERT_TRUE(has) << has.error().message;
    EXPECT_TRUE(*has) << p;
  }
}

TEST(DirIndex, ShardPidxWinsOverTheRecord) {
  TempDir d("pacer-dirindex-own-");
  const auto paths = indexed_shards(d, 0, 20);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const std::string file = dir_index_of(d);
  const ino_t ino = inode_of(file);
  // The shard changes and gets its own index: the record, stale now, is not read.
  const std::string changed = d.file("d-003.tar", shard_bytes(3, 7));
  ASSERT_TRUE(build_index(changed));
  auto ds = Dataset::open(paths);
  ASSERT_TRUE(ds) << ds.error().message;
  EXPECT_EQ((*ds)->shard_samples()[3], 7u);
  expect_reads(*ds);
  EXPECT_EQ(inode_of(file), ino) << "nothing to rewrite";
  // A corrupt SHARD.pidx is rebuilt in its place, as without a directory index.
  replace_file(index_path(changed), "NOTANIDX" + std::string(200, 'x'));
  ds = Dataset::open(paths);
  ASSERT_TRUE(ds) << ds.error().message;
  EXPECT_EQ((*ds)->shard_samples()[3], 7u);
  auto own = read_index(changed, false);
  ASSERT_TRUE(own) << own.error().message;
  EXPECT_EQ(own->samples, 7u);
  EXPECT_EQ(inode_of(file), ino);
}

TEST(DirIndex, ShardsChangedUnderTheirRecordsAreRebuiltAndTheRestKept) {
  TempDir d("pacer-dirindex-stale-");
  auto paths = indexed_shards(d, 0, 40);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const std::string file = dir_index_of(d);
  // One shard rewritten: its record is replaced, the others copied into the new file.
  const auto before = rows_of(file);
  const ino_t first = inode_of(file);
  d.file("d-005.tar", shard_bytes(5, 9));
  auto ds = Dataset::open(paths);
  ASSERT_TRUE(ds) << ds.error().message;
  EXPECT_EQ((*ds)->shard_samples()[5], 9u);
  EXPECT_FALSE(fs::exists(index_path(paths[5])));
  EXPECT_NE(inode_of(file), first);
  const auto after = rows_of(file);
  ASSERT_EQ(after.size(), 40u);
  for (const auto& [name, row] : after) {
    ASSERT_TRUE(before.count(name)) << name;
    if (name != "d-005.tar") {
      EXPECT_EQ(row.bytes, before.at(name).bytes) << name;
      EXPECT_EQ(row.written, before.at(name).written) << name << ": a copied record keeps its binding's time";
    }
  }
  EXPECT_GT(after.at("d-005.tar").bytes, before.at("d-005.tar").bytes);
  // A rewrite that keeps the size and the mtime is caught by the member headers' hash when
  // the entries are read (a loader's first read): rebuilt as SHARD.pidx there.
  {
    struct stat before {};
    ASSERT_EQ(::stat(paths[6].c_str(), &before), 0);
    std::string bytes = slurp(paths[6]);
    const std::string old_name = "s006k0.txt", new_name = "s006q0.txt";
    const auto at = bytes.find(old_name);
    ASSERT_NE(at, std::string::npos);
    bytes.replace(at, old_name.size(), new_name);
    RawTar::set_checksum(bytes.data() + at);
    std::ofstream(paths[6], std::ios::binary | std::ios::in) << bytes;
    struct timespec ts[2] = {before.st_atim, before.st_mtim};
    ASSERT_EQ(::utimensat(AT_FDCWD, paths[6].c_str(), ts, 0), 0);
    auto renamed = Dataset::open(paths);
    ASSERT_TRUE(renamed) << renamed.error().message;
    auto s = (*renamed)->read(first_of(**renamed, 6));
    ASSERT_TRUE(s) << s.error().message;
    EXPECT_EQ(s->key, "s006q0");
    EXPECT_TRUE(fs::exists(index_path(paths[6])));
  }
  // Sixteen rewritten: their records are replaced in the directory index, the others copied.
  const ino_t ino = inode_of(file);
  for (int s = 20; s < 36; ++s) d.file(fmt::format("d-{:03d}.tar", s), shard_bytes(s, 4));
  settle();
  ds = Dataset::open(paths);
  ASSERT_TRUE(ds) << ds.error().message;
  EXPECT_NE(inode_of(file), ino);
  for (int s = 0; s < 40; ++s) {
    const std::uint64_t want = s == 5 ? 9u : (s >= 20 && s < 36) ? 4u : static_cast<std::uint64_t>(1 + s % 3);
    EXPECT_EQ((*ds)->shard_samples()[static_cast<std::size_t>(s)], want) << s;
    if (s != 5 && s != 6) {
      EXPECT_FALSE(fs::exists(index_path(paths[static_cast<std::size_t>(s)]))) << s;
    }
  }
  expect_reads(*ds);
  const ino_t rewritten = inode_of(file);
  ASSERT_TRUE(Dataset::open(paths));
  EXPECT_EQ(inode_of(file), rewritten) << "every record fits now";
}

TEST(DirIndex, NewShardsAreMergedAndRemovedShardsDropped) {
  TempDir d("pacer-dirindex-merge-");
  auto first = make_shards(d, 0, 20);
  ASSERT_TRUE(Dataset::open(first));
  auto more = make_shards(d, 20, 40);
  auto all = first;
  all.insert(all.end(), more.begin(), more.end());
  auto ds = Dataset::open(all);
  ASSERT_TRUE(ds) << ds.error().message;
  EXPECT_EQ((*ds)->size(), samples_of(all));
  for (const auto& p : all) {
    EXPECT_FALSE(fs::exists(index_path(p))) << p;
    auto has = has_index(p);
    ASSERT_TRUE(has) << has.error().message;
    EXPECT_TRUE(*has) << p;
  }
  // Five shards go, sixteen come: the next write leaves the gone ones out.
  for (int s = 0; s < 5; ++s) fs::remove(all[static_cast<std::size_t>(s)]);
  auto last = make_shards(d, 40, 56);
  ASSERT_TRUE(Dataset::open(last));
  auto dir = DirIndex::get(d.path());
  ASSERT_TRUE(dir) << dir.error().message;
  ASSERT_TRUE(*dir);
  for (int s = 0; s < 56; ++s) EXPECT_EQ((*dir)->find(fmt::format("d-{:03d}.tar", s)) != nullptr, s >= 5) << s;
  // A record copied into the new file keeps skipping the hash: its binding still holds.
  std::vector<std::string> kept(all.begin() + 5, all.end());
  auto again = Dataset::open(kept);
  ASSERT_TRUE(again) << again.error().message;
  expect_reads(*again);
}

TEST(DirIndex, CorruptFilesAreRebuiltNeverTrusted) {
  TempDir d("pacer-dirindex-bad-");
  const auto paths = indexed_shards(d, 0, 20);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const std::string file = dir_index_of(d);
  const std::string good = slurp(file);
  ASSERT_GT(good.size(), 48u);
  std::uint64_t table = 0;
  std::memcpy(&table, good.data() + 24, 8);
  std::vector<std::pair<std::string, std::string>> bad;
  bad.push_back({"empty", ""});
  bad.push_back({"short", good.substr(0, 30)});
  bad.push_back({"magic", "NOTADIRX" + good.substr(8)});
  for (std::size_t at : {std::size_t{20}, std::size_t{60}, static_cast<std::size_t>(48 + table + 5), good.size() - 3}) {
    std::string f = good;
    f[at] = static_cast<char>(f[at] ^ 0x10);
    bad.push_back({fmt::format("flip at {}", at), f});
  }
  bad.push_back({"truncated records", good.substr(0, good.size() - 40)});
  bad.push_back({"table cut", good.substr(0, static_cast<std::size_t>(48 + table / 2))});
  for (const auto& [what, bytes] : bad) {
    for (const auto& p : paths) fs::remove(index_path(p));
    replace_file(file, bytes);
    const ino_t crafted = inode_of(file);
    auto ds = Dataset::open(paths);
    ASSERT_TRUE(ds) << what << ": " << ds.error().message;
    EXPECT_EQ((*ds)->size(), samples_of(paths)) << what;
    expect_reads(*ds);
    if (what == fmt::format("flip at {}", good.size() - 3)) {
      // Inside the last record's entries, which only a first read checks: rebuilt there, as SHARD.pidx.
      EXPECT_EQ(inode_of(file), crafted) << what;
      EXPECT_TRUE(fs::exists(index_path(paths.back()))) << what;
    } else {
      EXPECT_NE(inode_of(file), crafted) << what << ": replaced at open";
      EXPECT_EQ(rows_of(file).size(), paths.size()) << what;
      for (const auto& p : paths) EXPECT_FALSE(fs::exists(index_path(p))) << what << ": " << p;
    }
    auto dir = DirIndex::get(d.path());
    ASSERT_TRUE(dir) << what << ": " << dir.error().message;
  }
}

TEST(DirIndex, CraftedTablesAreErrorsNamingTheFile) {
  TempDir d("pacer-dirindex-craft-");
  const auto paths = make_shards(d, 0, 20);
  ASSERT_TRUE(Dataset::open(paths));
  const std::string file = dir_index_of(d);
  const std::string good = slurp(file);
  std::uint64_t rows = 0;
  std::memcpy(&rows, good.data() + 16, 8);
  ASSERT_EQ(rows, 20u);
  // The first row: u16 length, "d-000.tar", offset, bytes, written change time.
  const std::size_t name_at = 48 + 2, offset_at = name_at + 9, bytes_at = offset_at + 8;
  ASSERT_EQ(good.substr(name_at, 9), "d-000.tar");
  auto with = [&](std::size_t at, const void* v, std::size_t n) {
    std::string f = good;
    std::memcpy(f.data() + at, v, n);
    reseal(f);
    return f;
  };
  const std::uint64_t huge = ~0ULL, past = good.size(), zero = 0;
  const std::uint64_t many_rows = 1ULL << 40;
  struct Case {
    std::string what, bytes, message;
  };
  const std::vector<Case> cases = {
      {"offset past the end", with(offset_at, &past, 8), "lies outside"},
      {"offset + bytes wraps", with(bytes_at, &huge, 8), "lies outside"},
      {"record inside the table", with(offset_at, &zero, 8), "lies outside"},
      {"rows beyond the table", with(16, &many_rows, 8), "cannot fit"},
      {"table beyond the file", with(24, &huge, 8), "cannot fit"},
      {"a name with a slash", with(name_at + 1, "/", 1), "is not a file name"},
      {"rows out of order", with(name_at + 4, "9", 1), "out of order"},
      {"version 0", with(8, "\x00", 1), "version 0"},
  };
  for (const auto& c : cases) {
    replace_file(file, c.bytes);
    auto dir = DirIndex::get(d.path());
    ASSERT_FALSE(dir) << c.what;
    EXPECT_EQ(dir.error().kind, ErrorKind::kConfig) << c.what;
    EXPECT_TRUE(contains(dir.error().message, file)) << c.what << ": " << dir.error().message;
    EXPECT_TRUE(contains(dir.error().message, c.message)) << c.what << ": " << dir.error().message;
    auto idx = read_index(paths[0], true);
    ASSERT_FALSE(idx) << c.what;
    // A dataset open rebuilds it.
    auto ds = Dataset::open(paths);
    ASSERT_TRUE(ds) << c.what << ": " << ds.error().message;
    EXPECT_EQ((*ds)->size(), samples_of(paths));
    ASSERT_TRUE(DirIndex::get(d.path())) << c.what;
  }
}

TEST(DirIndex, ANewerVersionIsLeftAloneAndItsShardsGetTheirOwnIndexes) {
  TempDir d("pacer-dirindex-newer-");
  const auto paths = make_shards(d, 0, 20);
  std::string newer = "PACERDIR";
  const std::uint32_t version = 2;
  newer.append(reinterpret_cast<const char*>(&version), 4);
  newer += std::string(100, 'n');
  const std::string file = d.file(kDirIndexName, newer);
  auto dir = DirIndex::get(d.path());
  ASSERT_TRUE(dir) << dir.error().message;
  EXPECT_FALSE(*dir) << "read as absent";
  auto ds = Dataset::open(paths);
  ASSERT_TRUE(ds) << ds.error().message;
  expect_reads(*ds);
  EXPECT_EQ(slurp(file), newer) << "not replaced";
  for (const auto& p : paths) EXPECT_TRUE(fs::exists(index_path(p))) << p;
}

TEST(DirIndex, RecordsAreBoundToTheirHashTimeReboundOnceSettledThenSkipTheHash) {
  TempDir d("pacer-dirindex-settle-");
  const auto paths = make_shards(d, 0, 20);
  ASSERT_TRUE(Dataset::open(paths));
  const std::string file = dir_index_of(d);
  // A fresh record's time: the file's change time less the time since the hash, so at most that.
  for (const auto& [name, row] : rows_of(file)) {
    EXPECT_LE(row.written, ctime_of(file)) << name;
    EXPECT_GT(row.written, ctime_of(file) - 5'000'000'000) << name;
  }
  // A record hashed 10 s before it is written is dated 10 s before the file.
  {
    const auto rows = rows_of(file);
    const Row r = rows.at("d-003.tar");
    std::string image = slurp(file).substr(r.offset, r.bytes);
    const std::int64_t ten_ago = static_cast<std::int64_t>(wall_now() * 1e9) - 10'000'000'000;
    std::memcpy(image.data() + 72, &ten_ago, 8);
    const std::uint64_t self = XXH3_64bits(image.data(), 88);
    std::memcpy(image.data() + 88, &self, 8);
    ASSERT_TRUE(DirIndex::write(d.path(), {{"d-003.tar", image}}));
    const std::int64_t lag = ctime_of(file) - rows_of(file).at("d-003.tar").written;
    EXPECT_GT(lag, 9'000'000'000);
    EXPECT_LT(lag, 15'000'000'000);
    ASSERT_TRUE(Dataset::open(paths));
  }
  // Hashed within 2 s of the shards' change times: not trusted to skip the hash yet. Once the
  // shards have settled, an open hashes them and writes the records rebound, once.
  const ino_t unsettled = inode_of(file);
  settle();
  ASSERT_TRUE(Dataset::open(paths));
  const ino_t rebound = inode_of(file);
  EXPECT_NE(rebound, unsettled);
  ASSERT_TRUE(Dataset::open(paths));
  EXPECT_EQ(inode_of(file), rebound);
  // A rebound record skips the hash: one whose stored hash is wrong still reads.
  auto rows = rows_of(file);
  std::string f = slurp(file);
  const Row r = rows.at("d-007.tar");
  f[r.offset + 40] = static_cast<char>(f[r.offset + 40] ^ 1);
  const std::uint64_t self = XXH3_64bits(f.data() + r.offset, 88);
  std::memcpy(f.data() + r.offset + 88, &self, 8);
  replace_file(file, f);
  auto skipped = read_index(paths[7], false);
  EXPECT_TRUE(skipped) << "the rebound record skips the hash: " << skipped.error().message;
  // Its binding's time is the row's, not the file's (which is new, and past the shard's change
  // time): a row dated at the shard's change time makes the read hash the shard.
  const std::size_t row_at = [&] {
    const std::string name = "d-007.tar";
    return f.find(name) + name.size() + 16;
  }();
  const std::int64_t at_change = ctime_of(paths[7]);
  std::memcpy(f.data() + row_at, &at_change, 8);
  reseal(f);
  replace_file(file, f);
  auto hashed = read_index(paths[7], false);
  ASSERT_FALSE(hashed) << "hashed, and the wrong hash found";
  EXPECT_TRUE(contains(hashed.error().message, "member headers")) << hashed.error().message;
}

TEST(DirIndex, ABadShardDoesNotCostTheOthersTheirIndexes) {
  TempDir d("pacer-dirindex-oneBad-");
  auto paths = make_shards(d, 0, 20);
  paths.push_back(d.path() + "/d-020.tar");  // missing
  auto ds = Dataset::open(paths);
  ASSERT_FALSE(ds);
  EXPECT_TRUE(contains(ds.error().message, "d-020.tar")) << ds.error().message;
  EXPECT_EQ(rows_of(dir_index_of(d)).size(), 20u);
}

TEST(DirIndex, VerifyReportsACorruptDirectoryIndex) {
  TempDir d("pacer-dirindex-verify-");
  const auto paths = make_shards(d, 0, 20);
  ASSERT_TRUE(Dataset::open(paths));
  const std::string spec = d.path() + "/d-{000..019}.tar";
  auto ok = verify_shards(spec);
  ASSERT_TRUE(ok) << ok.error().message;
  for (const auto& v : ok->shards) {
    EXPECT_TRUE(v.indexed) << v.path;
    EXPECT_EQ(v.problem, "") << v.path;
  }
  std::string f = slurp(dir_index_of(d));
  f[60] = static_cast<char>(f[60] ^ 1);  // the table
  replace_file(dir_index_of(d), f);
  auto bad = verify_shards(spec);
  ASSERT_TRUE(bad) << bad.error().message;
  for (const auto& v : bad->shards) EXPECT_TRUE(contains(v.problem, kDirIndexName)) << v.path << ": " << v.problem;
  EXPECT_FALSE(bad->ok());
}

TEST(DirIndex, AcopiedDatasetIsReboundOnceAndConcurrentOpensAgree) {
  TempDir d("pacer-dirindex-copy-");
  const auto paths = make_shards(d, 0, 24, "a/");
  ASSERT_TRUE(Dataset::open(paths));
  // Copied without keeping mtimes (cp without -p), index included.
  fs::create_directories(d.path() + "/b");
  std::vector<std::string> copies;
  for (const auto& p : paths) {
    copies.push_back(d.path() + "/b/" + fs::path(p).filename().string());
    fs::copy_file(p, copies.back());
  }
  fs::copy_file(dir_index_of(d, "a"), dir_index_of(d, "b"));
  settle();
  const ino_t copied = inode_of(dir_index_of(d, "b"));
  auto ds = Dataset::open(copies);
  ASSERT_TRUE(ds) << ds.error().message;
  expect_reads(*ds);
  const ino_t rebound = inode_of(dir_index_of(d, "b"));
  EXPECT_NE(rebound, copied) << "the records are rebound to the copies";
  for (const auto& p : copies) EXPECT_FALSE(fs::exists(index_path(p)));
  ASSERT_TRUE(Dataset::open(copies));
  EXPECT_EQ(inode_of(dir_index_of(d, "b")), rebound);

  // Four opens of one new directory at once: each succeeds, and what is left reads.
  const auto fresh = make_shards(d, 0, 32, "c/");
  std::vector<std::thread> ts;
  std::vector<std::string> errors(4);
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&, t] {
      auto got = Dataset::open(fresh);
      if (!got) errors[static_cast<std::size_t>(t)] = got.error().message;
      else if ((*got)->size() != samples_of(fresh)) errors[static_cast<std::size_t>(t)] = "wrong size";
    });
  for (auto& t : ts) t.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
  auto after = Dataset::open(fresh);
  ASSERT_TRUE(after) << after.error().message;
  expect_reads(*after);
  auto dir = DirIndex::get(d.path() + "/c");
  ASSERT_TRUE(dir && *dir);
}

// Processes opening shards of one new directory at once, as the ranks of a node do (here each
// another overlapping part of it): each indexes its shards and writes the directory index merged
// with the file it found, the last rename winning. Every one opens and reads its shards; a record
// lost to another's rename is rebuilt by a later open, after which every shard has one.
TEST(DirIndex, ProcessesOpeningOneNewDirectoryAtOnceAllReadIt) {
  TempDir d("pacer-dirindex-procs-");
  const auto paths = make_shards(d, 0, 48);
  int go[2];
  ASSERT_EQ(::pipe(go), 0);
  std::vector<pid_t> kids;
  auto release = [&] {  // the children start (or, after a failed fork, end) at this close
    ::close(go[0]);
    ::close(go[1]);
  };
  for (int k = 0; k < 4; ++k) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      release();
      for (const pid_t kid : kids) ::waitpid(kid, nullptr, 0);
      FAIL() << "fork: " << std::strerror(errno);
    }
    if (pid == 0) {
      // Never back into gtest from here: any exception or failure is an exit code and a line.
      int code = 5;
      try {
        ::close(go[1]);
        char c = 0;
        (void)!::read(go[0], &c, 1);  // returns at the parent's close: all start together
        const std::vector<std::string> part(paths.begin() + 8 * k, paths.begin() + 8 * k + 24);
        auto ds = Dataset::open(part);
        const std::string bad = !ds ? ds.error().message : (*ds)->size() != samples_of(part) ? "wrong size" : bad_read(*ds);
        code = bad.empty() ? 0 : 4;
        if (!bad.empty()) std::fprintf(stderr, "child %d: %s\n", k, bad.c_str());
      } catch (...) {
        code = 5;
      }
      ::_exit(code);
    }
    kids.push_back(pid);
  }
  release();
  for (const pid_t pid : kids) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  }
  auto dir = DirIndex::get(d.path());
  ASSERT_TRUE(dir) << dir.error().message;
  ASSERT_TRUE(*dir) << "written";
  auto after = Dataset::open(paths);
  ASSERT_TRUE(after) << after.error().message;
  expect_reads(*after);
  for (const auto& p : paths) {
    EXPECT_FALSE(fs::exists(index_path(p))) << p;
    auto has = has_index(p);
    ASSERT_TRUE(has) << has.error().message;
    EXPECT_TRUE(*has) << p;
  }
}

TEST(DirIndex, AReadOnlyDatasetReadsItsRecordsAndRefusesAStaleOne) {
  Tmpfs t;
  PACER_MOUNT_TMPFS_OR_SKIP(t);
  std::vector<std::string> paths;
  for (int s = 0; s < 20; ++s) {
    paths.push_back(t.mnt + fmt::format("/d-{:03d}.tar", s));
    std::ofstream(paths.back(), std::ios::binary) << shard_bytes(s);
  }
  ASSERT_TRUE(Dataset::open(paths));
  ASSERT_TRUE(fs::exists(t.mnt + "/" + kDirIndexName));
  // Same size, another sample count: the record no longer fits.
  std::ofstream(paths[2], std::ios::binary) << shard_bytes(2, 0) + std::string(shard_bytes(2).size() - shard_bytes(2, 0).size(), '\0');
  ASSERT_TRUE(t.read_only()) << std::strerror(errno);
  std::vector<std::string> fine = paths;
  fine.erase(fine.begin() + 2);
  auto ds = Dataset::open(fine);
  ASSERT_TRUE(ds) << ds.error().message;
  expect_reads(*ds);
  auto stale = Dataset::open(paths);
  ASSERT_FALSE(stale) << "a stale record that cannot be replaced is not worked around";
  EXPECT_TRUE(contains(stale.error().message, paths[2])) << stale.error().message;
  EXPECT_TRUE(contains(stale.error().message, "rebuild it with pacer shard index")) << stale.error().message;
}

TEST(DirIndex, AReadOnlyDatasetWithoutIndexesOpensAndOneWithACorruptFileIsRefused) {
  Tmpfs t;
  PACER_MOUNT_TMPFS_OR_SKIP(t);
  std::vector<std::string> fresh, corrupt;
  for (int s = 0; s < 20; ++s) {
    fresh.push_back(t.mnt + fmt::format("/a/d-{:03d}.tar", s));
    corrupt.push_back(t.mnt + fmt::format("/b/d-{:03d}.tar", s));
  }
  fs::create_directories(t.mnt + "/a");
  fs::create_directories(t.mnt + "/b");
  for (int s = 0; s < 20; ++s) {
    std::ofstream(fresh[static_cast<std::size_t>(s)], std::ios::binary) << shard_bytes(s);
    std::ofstream(corrupt[static_cast<std::size_t>(s)], std::ios::binary) << shard_bytes(s);
  }
  ASSERT_TRUE(Dataset::open(corrupt));
  std::string f = slurp(t.mnt + "/b/" + kDirIndexName);
  f[60] = static_cast<char>(f[60] ^ 1);
  std::ofstream(t.mnt + "/b/" + kDirIndexName, std::ios::binary) << f;
  ASSERT_TRUE(t.read_only()) << std::strerror(errno);
  auto ds = Dataset::open(fresh);
  ASSERT_TRUE(ds) << "indexes kept in memory: " << ds.error().message;
  expect_reads(*ds);
  EXPECT_FALSE(fs::exists(t.mnt + "/a/" + kDirIndexName));
  auto refused = Dataset::open(corrupt);
  ASSERT_FALSE(refused) << "a corrupt directory index that cannot be replaced is not worked around";
  EXPECT_TRUE(contains(refused.error().message, kDirIndexName)) << refused.error().message;
  EXPECT_TRUE(contains(refused.error().message, "rebuild it with pacer shard index")) << refused.error().message;
}

}  // namespace
}  // namespace pacer::data
