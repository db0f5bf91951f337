// Shards as tar(1) and gzip(1) write them: members of a sample in any order within the shard,
// and gzip-compressed shards (.tar.gz), with their bad inputs (truncated, corrupt, a gzip bomb).
#include <gtest/gtest.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "data/raw_tar.hpp"
#include "pacer/core/atomic_file.hpp"
#include "data/tar_internal.hpp"
#include "pacer/data.hpp"
#include "test_util.hpp"

namespace pacer::data {
namespace {

namespace fs = std::filesystem;
using test::contains;
using test::RawTar;
using test::TempDir;

bool sh(const std::string& cmd) { return std::system(cmd.c_str()) == 0; }
std::string quote(const std::string& s) { return "'" + s + "'"; }


// 50 samples of two fields; returns name -> contents.
std::map<std::string, std::string> fifty_samples(const TempDir& d) {
  std::map<std::string, std::string> files;
  for (int i = 0; i < 50; ++i) {
    const std::string k = fmt::format("{:04d}", i);
    files[k + ".txt"] = fmt::format("text of {} ", i) + std::string(static_cast<std::size_t>(i) * 37, 'a' + i % 26);
    files[k + ".json"] = fmt::format("{{\"i\": {}}}", i);
  }
  for (const auto& [name, text] : files) d.file("src/" + name, text);
  return files;
}

// Archives the members with tar(1), in exactly the order given (no --sort).
std::string gnu_tar_in_order(const TempDir& d, const std::string& name, const std::vector<std::string>& members) {
  std::string list;
  for (const auto& m : members) list += m + "\n";
  d.file("list", list);
  const std::string out = d.path() + "/" + name;
  EXPECT_TRUE(sh("cd " + quote(d.path() + "/src") + " && tar --format=gnu --no-recursion -cf " + quote(out) + " -T " +
                 quote(d.path() + "/list")));
  return out;
}

// The files archived by name order, as plain.tar.
std::string sorted_tar(const TempDir& d, const std::map<std::string, std::string>& files) {
  std::vector<std::string> order;
  for (const auto& [name, text] : files) order.push_back(name);
  return gnu_tar_in_order(d, "plain.tar", order);
}

// Every sample of the dataset, checked against the files: one sample per key,
// every field with the file's bytes.
void expect_fifty(const std::string& shard, const std::map<std::string, std::string>& files,
                  const std::vector<std::string>& first_exts) {
  auto ds = Dataset::open(std::vector<std::string>{shard});
  ASSERT_TRUE(ds) << ds.error().message;
  ASSERT_EQ((*ds)->size(), 50u) << "one sample per key, never split";
  std::set<std::string> keys;
  for (std::uint64_t i = 0; i < 50; ++i) {
    auto s = (*ds)->read(i);
    ASSERT_TRUE(s) << s.error().message;
    keys.insert(s->key);
    ASSERT_EQ(s->fields.size(), 2u) << s->key;
    // Fields in the order the members appear in the shard.
    EXPECT_EQ(s->fields[0].first, first_exts[0]);
    EXPECT_EQ(s->fields[1].first, first_exts[1]);
    for (const auto& [ext, bytes] : s->fields) EXPECT_EQ(bytes, files.at(s->key + "." + ext)) << s->key << "." << ext;
  }
  EXPECT_EQ(keys.size(), 50u);
}

TEST(TarOrder, InterleavedMembersFromGnuTarFormOneSamplePerKey) {
  TempDir d("pacer-order-");
  const auto files = fifty_samples(d);
  // What tar writes for a directory whose entries come back in that order:
  // every .txt, then every .json (the reported 50 keys -> 147 samples).
  std::vector<std::string> order;
  for (int i = 0; i < 50; ++i) order.push_back(fmt::format("{:04d}.txt", i));
  for (int i = 49; i >= 0; --i) order.push_back(fmt::format("{:04d}.json", i));
  const std::string tar = gnu_tar_in_order(d, "interleaved.tar", order);
  auto members = scan_tar(tar);
  ASSERT_TRUE(members) << members.error().message;
  ASSERT_EQ(members->size(), 100u);
  EXPECT_EQ(members->at(1).name, "0001.txt") << "the archive really is interleaved";
  auto entries = group_samples(tar, *members);
  ASSERT_TRUE(entries) << entries.error().message;
  ASSERT_EQ(entries->size(), 50u);
  // Samples in the order of their keys' first appearance.
  for (int i = 0; i < 50; ++i) EXPECT_EQ(entries->at(static_cast<std::size_t>(i)).key, fmt::format("{:04d}", i));
  expect_fifty(tar, files, {"txt", "json"});
  // The index written on first open gives the same samples on the next.
  ASSERT_TRUE(fs::exists(index_path(tar)));
  expect_fifty(tar, files, {"txt", "json"});
  auto v = verify_shards(tar);
  ASSERT_TRUE(v) << v.error().message;
  EXPECT_TRUE(v->ok()) << v->shards.at(0).problem;
}

TEST(TarOrder, GnuTarOfADirectoryInItsOwnOrder) {
  TempDir d("pacer-order-");
  const auto files = fifty_samples(d);
  // No --sort: tar writes the directory as readdir returns it.
  const std::string tar = d.path() + "/natural.tar";
  ASSERT_TRUE(sh("cd " + quote(d.path() + "/src") + " && tar --format=gnu -cf " + quote(tar) + " ."));
  auto ds = Dataset::open(tar);
  ASSERT_TRUE(ds) << ds.error().message;
  ASSERT_EQ((*ds)->size(), 50u);
  for (std::uint64_t i = 0; i < 50; ++i) {
    auto s = (*ds)->read(i);
    ASSERT_TRUE(s) << s.error().message;
    ASSERT_EQ(s->fields.size(), 2u) << s->key;
    for (const auto& [ext, bytes] : s->fields) EXPECT_EQ(bytes, files.at(s->key + "." + ext));
  }
  // Through the loader too, shuffled: every key once.
  LoaderOptions o;
  o.batch_size = 7;
  auto loader = Loader::open(*ds, o);
  ASSERT_TRUE(loader) << loader.error().message;
  std::multiset<std::string> seen;
  while (auto b = (*loader)->next().value()) {
    for (std::size_t i = 0; i < b->size(); ++i) {
      seen.insert(b->keys[i]);
      EXPECT_EQ(b->first_field[i + 1] - b->first_field[i], 2u);
    }
  }
  EXPECT_EQ(seen.size(), 50u);
  EXPECT_EQ(std::set<std::string>(seen.begin(), seen.end()).size(), 50u);
}

// ---------------------------------------------------------------------------
// Gzip

TEST(TarGzip, GzipShardsReadAsTheirTar) {
  TempDir d("pacer-gzip-");
  const auto files = fifty_samples(d);
  const std::string tar = sorted_tar(d, files);
  ASSERT_TRUE(sh("gzip -c " + quote(tar) + " > " + quote(d.path() + "/a.tar.gz")));
  ASSERT_TRUE(sh("cd " + quote(d.path() + "/src") + " && tar --format=gnu --sort=name -czf ../b.tgz ."));
  for (const std::string name : {"a.tar.gz", "b.tgz"}) {
    const std::string gz = d.path() + "/" + name;
    auto members = scan_tar(gz);
    ASSERT_TRUE(members) << members.error().message;
    EXPECT_EQ(members->size(), 100u);
    expect_fifty(gz, files, {"json", "txt"});
    EXPECT_TRUE(fs::exists(index_path(gz)));
    // Reopened from its index, which is bound to the compressed file.
    expect_fifty(gz, files, {"json", "txt"});
    auto v = verify_shards(gz);
    ASSERT_TRUE(v) << v.error().message;
    EXPECT_TRUE(v->ok()) << v->shards.at(0).problem;
  }
  // A gzip shard rewritten under its index is found, as a plain one is.
  const std::string a = d.path() + "/a.tar.gz";
  ASSERT_TRUE(sh("gzip -1 -c " + quote(tar) + " > " + quote(a)));
  expect_fifty(a, files, {"json", "txt"});
}

// Shards of 2 MiB or more have their gzip magic read through their mapping
// (tar.cpp, shard_data), which the dataset then reads through; smaller ones
// through a pread. Both kinds of shard, on both sides of that size, read the
// same samples.
TEST(TarGzip, ShardsAboveAndBelowTheMappedSizeReadAlike) {
  TempDir d("pacer-gzip-");
  // Incompressible fields, so the gzip shard is as large as its tar.
  std::map<std::string, std::string> files;
  std::uint64_t x = 0x9e3779b97f4a7c15ULL;
  for (int i = 0; i < 40; ++i) {
    std::string bytes(64 * 1024, '\0');
    for (auto& c : bytes) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      c = static_cast<char>(x >> 56);
    }
    files[fmt::format("{:04d}.bin", i)] = std::move(bytes);
    files[fmt::format("{:04d}.json", i)] = fmt::format("{{\"i\": {}}}", i);
  }
  for (const auto& [name, text] : files) d.file("src/" + name, text);
  std::vector<std::string> all, few;
  for (const auto& [name, text] : files) {
    all.push_back(name);
    if (few.size() < 20) few.push_back(name);  // 10 samples, about 640 KiB
  }
  const std::string big = gnu_tar_in_order(d, "big.tar", all), small = gnu_tar_in_order(d, "small.tar", few);
  ASSERT_TRUE(sh("gzip -c " + quote(big) + " > " + quote(d.path() + "/big.tar.gz")));
  ASSERT_TRUE(sh("gzip -c " + quote(small) + " > " + quote(d.path() + "/small.tar.gz")));
  ASSERT_GE(fs::file_size(big), 2u << 20);
  ASSERT_GE(fs::file_size(d.path() + "/big.tar.gz"), 2u << 20);
  ASSERT_LT(fs::file_size(d.path() + "/small.tar.gz"), 2u << 20);
  for (const std::string name : {"big.tar", "big.tar.gz", "small.tar", "small.tar.gz"}) {
    const std::string shard = d.path() + "/" + name;
    const std::size_t samples = name.starts_with("big") ? 40 : 10;
    // Only the large plain shard comes with its mapping, of its whole size.
    auto data = open_shard_data(shard);
    ASSERT_TRUE(data) << name << ": " << data.error().message;
    EXPECT_EQ(data->map != nullptr, name == "big.tar") << name;
    if (data->map) {
      EXPECT_EQ(data->map->size(), data->tar_bytes);
    }
    auto members = scan_tar(shard);
    ASSERT_TRUE(members) << name << ": " << members.error().message;
    EXPECT_EQ(members->size(), 2 * samples) << name;
    for (int pass = 0; pass < 2; ++pass) {  // indexed, then from its index
      auto ds = Dataset::open(std::vector<std::string>{shard});
      ASSERT_TRUE(ds) << name << ": " << ds.error().message;
      ASSERT_EQ((*ds)->size(), samples) << name;
      for (std::uint64_t i = 0; i < samples; ++i) {
        auto s = (*ds)->read(i);
        ASSERT_TRUE(s) << name << ": " << s.error().message;
        ASSERT_EQ(s->fields.size(), 2u) << name << " " << s->key;
        for (const auto& [ext, bytes] : s->fields) EXPECT_EQ(bytes, files.at(s->key + "." + ext)) << name << " " << s->key << "." << ext;
      }
    }
    auto v = verify_shards(shard);
    ASSERT_TRUE(v) << name << ": " << v.error().message;
    EXPECT_TRUE(v->ok()) << name << ": " << v->shards.at(0).problem;
  }
  // A large shard that is gzip only by its first two bytes is a corrupt gzip
  // stream, named, not read as a tar.
  auto read = read_file(big);
  ASSERT_TRUE(read) << read.error().message;
  std::string fake = std::move(*read);
  fake[0] = '\x1f', fake[1] = '\x8b';
  d.file("fake.tar", fake);
  auto bad = Dataset::open(std::vector<std::string>{d.path() + "/fake.tar"});
  ASSERT_FALSE(bad);
  EXPECT_TRUE(contains(bad.error().message, "fake.tar: gzip:")) << bad.error().message;
}

TEST(TarGzip, ConcatenatedMembersAreOneStream) {
  TempDir d("pacer-gzip-");
  const auto files = fifty_samples(d);
  const std::string tar = sorted_tar(d, files);
  const std::string gz = d.path() + "/cat.tar.gz";
  ASSERT_TRUE(sh("head -c 10000 " + quote(tar) + " | gzip > " + quote(gz) + " && tail -c +10001 " + quote(tar) + " | gzip >> " +
                 quote(gz)));
  expect_fifty(gz, files, {"json", "txt"});
}

TEST(TarGzip, TruncatedCorruptAndTrailingBytesNameTheShard) {
  TempDir d("pacer-gzip-");
  const auto files = fifty_samples(d);
  const std::string tar = sorted_tar(d, files);
  ASSERT_TRUE(sh("gzip -c " + quote(tar) + " > " + quote(d.path() + "/good.tar.gz")));
  const std::string good = read_file(d.path() + "/good.tar.gz").value();
  ASSERT_GT(good.size(), 200u);

  const std::string cut = d.file("cut.tar.gz", good.substr(0, good.size() / 2));
  auto ds = Dataset::open(cut);
  ASSERT_FALSE(ds);
  EXPECT_TRUE(contains(ds.error().message, cut)) << ds.error().message;
  EXPECT_TRUE(contains(ds.error().message, "truncated")) << ds.error().message;
  EXPECT_FALSE(fs::exists(index_path(cut)));

  // The trailer alone missing: every tar byte is there, but the CRC is not checked.
  const std::string no_trailer = d.file("notrailer.tar.gz", good.substr(0, good.size() - 8));
  ds = Dataset::open(no_trailer);
  ASSERT_FALSE(ds);
  EXPECT_TRUE(contains(ds.error().message, "truncated")) << ds.error().message;

  std::string flipped = good;
  flipped[flipped.size() / 2] = static_cast<char>(flipped[flipped.size() / 2] ^ 0x55);
  const std::string bad = d.file("bad.tar.gz", flipped);
  ds = Dataset::open(bad);
  ASSERT_FALSE(ds);
  EXPECT_TRUE(contains(ds.error().message, bad)) << ds.error().message;
  EXPECT_TRUE(contains(ds.error().message, "gzip")) << ds.error().message;

  const std::string trailing = d.file("trailing.tar.gz", good + "garbage");
  ds = Dataset::open(trailing);
  ASSERT_FALSE(ds);
  EXPECT_TRUE(contains(ds.error().message, "after the gzip stream")) << ds.error().message;
}

TEST(TarGzip, DecompressionStopsAtTheLimit) {
  TempDir d("pacer-gzip-");
  // 64 MiB of zeros compress to ~64 KiB: a small bomb.
  const std::string bomb = d.path() + "/bomb.tar.gz";
  ASSERT_TRUE(sh("head -c 67108864 /dev/zero | gzip -c > " + quote(bomb)));
  auto f = open_fd(bomb, O_RDONLY);
  ASSERT_TRUE(f);
  std::uint64_t size = 0;
  auto mem = gunzip_to_memory(f->get(), bomb, 1 << 20, size);
  ASSERT_FALSE(mem);
  EXPECT_TRUE(contains(mem.error().message, bomb));
  EXPECT_TRUE(contains(mem.error().message, "more than 1048576 bytes"));
  EXPECT_LE(size, 1u << 20) << "nothing held beyond the limit";
  // The same limit from the environment, for datasets.
  ::setenv("PACER_GZIP_MAX_BYTES", "1048576", 1);
  auto ds = Dataset::open(bomb);
  ::unsetenv("PACER_GZIP_MAX_BYTES");
  ASSERT_FALSE(ds);
  EXPECT_TRUE(contains(ds.error().message, "PACER_GZIP_MAX_BYTES")) << ds.error().message;
  // Sizes with units, as the CLI takes them ("1k" was ignored, leaving 8 GiB).
  ::setenv("PACER_GZIP_MAX_BYTES", "1MiB", 1);
  auto with_unit = Dataset::open(bomb);
  ::unsetenv("PACER_GZIP_MAX_BYTES");
  ASSERT_FALSE(with_unit);
  EXPECT_TRUE(contains(with_unit.error().message, "more than 1048576 bytes")) << with_unit.error().message;
  // Under the limit the stream decompresses whole (all zeros: an empty tar).
  auto whole = gunzip_to_memory(f->get(), bomb, 1ULL << 30, size);
  ASSERT_TRUE(whole) << whole.error().message;
  EXPECT_EQ(size, 67108864u);
  auto empty = Dataset::open(bomb);
  ASSERT_TRUE(empty) << empty.error().message;
  EXPECT_EQ((*empty)->size(), 0u);
}

TEST(TarGzip, RevisitingADroppedShardWarnsOnce) {
  TempDir d("pacer-gzip-");
  RawTar raw;
  raw.add("k.txt", "x");
  const std::string tar = d.file("one.tar", raw.finish());
  ASSERT_TRUE(sh("gzip -c " + quote(tar) + " > " + quote(d.path() + "/one.tar.gz")));
  // More shards than the loader keeps open, so the first ones are dropped.
  std::vector<std::string> paths;
  for (int i = 0; i < 130; ++i) {
    paths.push_back(fmt::format("{}/g-{:03d}.tar.gz", d.path(), i));
    fs::copy_file(d.path() + "/one.tar.gz", paths.back());
  }
  auto ds = Dataset::open(paths);
  ASSERT_TRUE(ds) << ds.error().message;
  ::testing::internal::CaptureStderr();
  for (std::uint64_t i = 0; i < 130; ++i) ASSERT_TRUE((*ds)->read(i));
  const std::string quiet = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(quiet, "") << "each shard decompressed once so far";
  ::testing::internal::CaptureStderr();
  for (std::uint64_t i : {0, 1, 0, 1}) {
    auto s = (*ds)->read(i);
    ASSERT_TRUE(s) << s.error().message;
    EXPECT_EQ(s->fields.at(0).second, "x");
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(contains(err, paths[0])) << err;
  EXPECT_TRUE(contains(err, "decompressed again")) << err;
  EXPECT_EQ(err.find("decompressed again"), err.rfind("decompressed again")) << "one warning: " << err;
}

// A few large gzip shards (far fewer than the open-file bound) are still
// dropped once their decompressed bytes pass the memory bound.
TEST(TarGzip, DecompressedShardsStayWithinTheMemoryBound) {
  TempDir d("pacer-gzip-mem-");
  std::vector<std::string> paths;
  for (int s = 0; s < 4; ++s) {
    RawTar raw;
    for (int i = 0; i < 4; ++i) raw.add(fmt::format("s{}k{}.bin", s, i), std::string(100000, static_cast<char>('a' + s)));
    const std::string tar = d.file(fmt::format("m-{}.tar", s), raw.finish());
    ASSERT_TRUE(sh("gzip " + quote(tar)));
    paths.push_back(tar + ".gz");
  }
  ::setenv("PACER_GZIP_CACHE_BYTES", "900000", 1);  // two shards' 400 KB tars fit, three do not
  auto ds = Dataset::open(paths);
  ::unsetenv("PACER_GZIP_CACHE_BYTES");
  ASSERT_TRUE(ds) << ds.error().message;
  ::testing::internal::CaptureStderr();
  for (std::uint64_t i : {0, 4, 8, 12}) ASSERT_TRUE((*ds)->read(i));
  const std::string first = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(first, "");
  ::testing::internal::CaptureStderr();
  auto again = (*ds)->read(1);  // shard 0: dropped for the later ones
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(again) << again.error().message;
  EXPECT_EQ(again->fields.at(0).second, std::string(100000, 'a'));
  EXPECT_TRUE(contains(err, "decompressed again")) << "shard 0 was kept beyond the bound: '" << err << "'";
}

}  // namespace
}  // namespace pacer::data
