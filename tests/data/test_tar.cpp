// Tar shards and datasets: scan_tar (ustar, pax, GNU, malformed archives), WebDataset grouping, the
// per-shard index, shard spec expansion, Dataset reads, the Permutation and the Partition.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <xxhash.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "data/raw_tar.hpp"
#include "data/tmpfs.hpp"
#include "pacer/data.hpp"
#include "test_util.hpp"

namespace pacer::data {
namespace {

namespace fs = std::filesystem;
using test::contains;
using test::RawTar;
using test::TempDir;
using test::Tmpfs;

// ---------------------------------------------------------------------------
// Helpers

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string bytes_at(const std::string& path, std::uint64_t offset, std::uint64_t size) {
  const std::string all = slurp(path);
  if (offset + size > all.size()) return "<out of range>";
  return all.substr(offset, size);
}

// Runs a shell command; true on exit status 0.
bool sh(const std::string& cmd) { return std::system(cmd.c_str()) == 0; }

std::string quote(const std::string& s) { return "'" + s + "'"; }

// Creates `files` (name -> contents) under dir/src and archives `args` (paths
// relative to dir/src, in that order) with GNU tar into dir/NAME.
std::string gnu_tar(const TempDir& dir, const std::string& name, const std::string& format,
                    const std::map<std::string, std::string>& files, const std::vector<std::string>& args,
                    const std::string& extra = "") {
  for (const auto& [f, text] : files) dir.file("src/" + f, text);
  std::string cmd = "cd " + quote(dir.path() + "/src") + " && tar --sort=name --format=" + format + " " + extra + " -cf " +
                    quote(dir.path() + "/" + name);
  for (const auto& a : args) cmd += " " + quote(a);
  EXPECT_TRUE(sh(cmd)) << cmd;
  return dir.path() + "/" + name;
}

std::vector<std::string> names_of(const std::vector<TarMember>& ms) {
  std::vector<std::string> out;
  for (const auto& m : ms) out.push_back(m.name);
  return out;
}

// Every member's bytes equal the source file's.
void expect_member_bytes(const std::string& tar, const std::vector<TarMember>& ms,
                         const std::map<std::string, std::string>& files) {
  for (const auto& m : ms) {
    auto it = files.find(m.name);
    ASSERT_NE(it, files.end()) << "unexpected member " << m.name;
    EXPECT_EQ(m.size, it->second.size()) << m.name;
    EXPECT_EQ(bytes_at(tar, m.offset, m.size), it->second) << m.name;
    EXPECT_LT(m.header_offset, m.offset) << m.name;
    EXPECT_EQ(m.offset % 512, 0u) << m.name;
  }
}

std::string binary_blob(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng() & 0xff);
  return s;
}

void truncate_file(const std::string& path, std::uint64_t size) { fs::resize_file(path, size); }

void write_bytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// ---------------------------------------------------------------------------
// scan_tar

TEST(TarScan, UstarMembersWithOffsetsAndExactBytes) {
  TempDir d("pacer-tar-");
  const std::string long_dir = std::string(60, 'd') + "/" + std::string(60, 'e');  // > 100 chars: ustar splits it into prefix and name
  const std::map<std::string, std::string> files = {
      {"a.txt", "hello"},
      {"sub/b.bin", binary_blob(1000, 1)},
      {"sub/empty.txt", ""},
      {"sub/exact.bin", std::string(512, 'x')},
      {long_dir + "/file.txt", "in a long directory"},
  };
  const std::string tar = gnu_tar(d, "u.tar", "ustar", files, {"a.txt", "sub", long_dir});
  auto ms = scan_tar(tar);
  ASSERT_TRUE(ms) << ms.error().message;
  // Directories ("sub/", long_dir + "/") are skipped.
  EXPECT_EQ(names_of(*ms), (std::vector<std::string>{"a.txt", "sub/b.bin", "sub/empty.txt", "sub/exact.bin", long_dir + "/file.txt"}));
  expect_member_bytes(tar, *ms, files);
  EXPECT_EQ((*ms)[0].header_offset, 0u);
  EXPECT_EQ((*ms)[0].offset, 512u);
}

TEST(TarScan, PaxLongAndNonAsciiNames) {
  TempDir d("pacer-tar-");
  const std::string long_name = "d/" + std::string(150, 'n') + ".txt";
  const std::string utf8 = "donn\xc3\xa9" "es/\xc3\xa9t\xc3\xa9-\xe6\x97\xa5\xe6\x9c\xac.txt";
  const std::map<std::string, std::string> files = {
      {long_name, "long"},
      {utf8, "accents"},
      {"plain.cls", "7"},
  };
  const std::string tar = gnu_tar(d, "p.tar", "pax", files, {long_name, utf8, "plain.cls"});
  auto ms = scan_tar(tar);
  ASSERT_TRUE(ms) << ms.error().message;
  EXPECT_EQ(names_of(*ms), (std::vector<std::string>{long_name, utf8, "plain.cls"}));
  expect_member_bytes(tar, *ms, files);
  EXPECT_EQ((*ms)[0].header_offset, 0u) << "the pax header comes first";
  EXPECT_GE((*ms)[0].offset, 3u * 512);
}

TEST(TarScan, GnuLongNamesAndLongDirectories) {
  TempDir d("pacer-tar-");
  const std::string long_dir(130, 'D');
  const std::string long_name = std::string(140, 'f') + ".jpg";
  const std::map<std::string, std::string> files = {
      {long_name, binary_blob(700, 2)},
      {long_dir + "/x.txt", "under a long dir"},
      {"short.txt", "s"},
  };
  // The long directory gets its own 'L' record: it must not leak into the next member.
  const std::string tar = gnu_tar(d, "g.tar", "gnu", files, {long_name, long_dir, "short.txt"});
  auto ms = scan_tar(tar);
  ASSERT_TRUE(ms) << ms.error().message;
  EXPECT_EQ(names_of(*ms), (std::vector<std::string>{long_name, long_dir + "/x.txt", "short.txt"}));
  expect_member_bytes(tar, *ms, files);
  // header_offset is that of the member's first header: its 'L' record.
  EXPECT_EQ((*ms)[0].header_offset, 0u);
  EXPECT_EQ((*ms)[0].offset, 3u * 512);
}

TEST(TarScan, GnuHeadersWithAccessTimesAreNotReadAsUstarPrefix) {
  // GNU tar -G (incremental) fills the old-GNU atime/ctime fields, which sit
  // where ustar keeps its name prefix.
  TempDir d("pacer-tar-");
  const std::map<std::string, std::string> files = {{"a.txt", "hi\n"}};
  const std::string tar = gnu_tar(d, "g.tar", "gnu", files, {"a.txt"}, "-G");
  auto ms = scan_tar(tar);
  ASSERT_TRUE(ms) << ms.error().message;
  EXPECT_EQ(names_of(*ms), (std::vector<std::string>{"a.txt"}));
  expect_member_bytes(tar, *ms, files);
}

TEST(TarScan, DotSlashPrefixesAreStripped) {
  TempDir d("pacer-tar-");
  const std::map<std::string, std::string> files = {{"a.txt", "A"}, {"sub/b.txt", "B"}};
  const std::string tar = gnu_tar(d, "dot.tar", "ustar", files, {"."});
  auto ms = scan_tar(tar);
  ASSERT_TRUE(ms) << ms.error().message;
  EXPECT_EQ(names_of(*ms), (std::vector<std::string>{"a.txt", "sub/b.txt"}));
  expect_member_bytes(tar, *ms, files);

  RawTar raw;
  raw.add("././c.txt", "C");
  const std::string rt = d.file("raw.tar", raw.finish());
  auto rm = scan_tar(rt);
  ASSERT_TRUE(rm) << rm.error().message;
  EXPECT_EQ(names_of(*rm), (std::vector<std::string>{"c.txt"}));
}

TEST(TarScan, RawPaxRecordsBase256SizesAndSkippedTypes) {
  TempDir d("pacer-tar-");
  RawTar raw;
  raw.add("g", "9 a=bcd\n", 'g');             // a pax global header: skipped, affects nothing
  raw.add("dir/", "", '5');                   // a directory
  raw.add("link", "", '2', [](char* h) { std::memcpy(h + 157, "a.txt", 5); });  // a symlink
  raw.pax({{"path", "pax/" + std::string(200, 'p') + ".txt"}, {"mtime", "1700000000.5"}});
  raw.add("short-name-ignored", "pax data");
  raw.add("after-pax.txt", "plain");  // the pax path does not stick
  // A base-256 size (GNU, for >= 8 GiB members), here a small one.
  const std::string b256 = "base256 data!";
  {
    std::string h = RawTar::header("b256.bin", 0, '0', [&](char* p) {
      std::memset(p + 124, 0, 12);
      p[124] = static_cast<char>(0x80);
      p[135] = static_cast<char>(b256.size());
    });
    raw.bytes += h + b256;
    raw.pad();
  }
  // A pax size record overrides the header's size field.
  raw.pax({{"size", "9"}});
  raw.bytes += RawTar::header("pax-size.bin", 0) + "nine byte";
  raw.pad();
  raw.add("contiguous.bin", "seven", '7');
  raw.add("v7-type.bin", "nul type", '\0');
  const std::string tar = d.file("raw.tar", raw.finish());
  auto ms = scan_tar(tar);
  ASSERT_TRUE(ms) << ms.error().message;
  EXPECT_EQ(names_of(*ms), (std::vector<std::string>{"pax/" + std::string(200, 'p') + ".txt", "after-pax.txt", "b256.bin",
                                                    "pax-size.bin", "contiguous.bin", "v7-type.bin"}));
  const std::vector<std::string> data = {"pax data", "plain", b256, "nine byte", "seven", "nul type"};
  for (std::size_t i = 0; i < ms->size() && i < data.size(); ++i)
    EXPECT_EQ(bytes_at(tar, (*ms)[i].offset, (*ms)[i].size), data[i]) << (*ms)[i].name;
}

TEST(TarScan, EmptyArchiveHasNoMembers) {
  TempDir d("pacer-tar-");
  RawTar raw;
  auto ms = scan_tar(d.file("empty.tar", raw.finish()));
  ASSERT_TRUE(ms) << ms.error().message;
  EXPECT_TRUE(ms->empty());
}

TEST(TarScan, TruncatedInsideDataNamesShardAndHeaderOffset) {
  TempDir d("pacer-tar-");
  const std::map<std::string, std::string> files = {{"a.txt", "A"}, {"b.bin", binary_blob(3000, 3)}, {"c.txt", "C"}};
  const std::string tar = gnu_tar(d, "t.tar", "ustar", files, {"a.txt", "b.bin", "c.txt"});
  auto ms = scan_tar(tar);
  ASSERT_TRUE(ms) << ms.error().message;
  ASSERT_EQ(ms->size(), 3u);
  const TarMember b = (*ms)[1];
  truncate_file(tar, b.offset + 1000);
  auto bad = scan_tar(tar);
  ASSERT_FALSE(bad);
  EXPECT_TRUE(contains(bad.error().message, tar));
  EXPECT_TRUE(contains(bad.error().message, fmt::format("offset {}", b.header_offset)));
  EXPECT_TRUE(contains(bad.error().message, "truncated"));
}

TEST(TarScan, TruncatedInsideHeaderNamesShardAndOffset) {
  TempDir d("pacer-tar-");
  const std::map<std::string, std::string> files = {{"a.txt", "A"}, {"b.txt", "B"}};
  const std::string tar = gnu_tar(d, "t.tar", "ustar", files, {"a.txt", "b.txt"});
  auto ms = scan_tar(tar);
  ASSERT_TRUE(ms) << ms.error().message;
  const TarMember b = (*ms)[1];
  truncate_file(tar, b.header_offset + 100);
  auto bad = scan_tar(tar);
  ASSERT_FALSE(bad);
  EXPECT_TRUE(contains(bad.error().message, tar));
  EXPECT_TRUE(contains(bad.error().message, fmt::format("offset {}", b.header_offset)));
  EXPECT_TRUE(contains(bad.error().message, "truncated"));

  // Cut cleanly after the last member's data: no end-of-archive blocks.
  const std::string tar2 = gnu_tar(d, "t2.tar", "ustar", files, {"a.txt", "b.txt"});
  truncate_file(tar2, b.offset + 512);
  auto bad2 = scan_tar(tar2);
  ASSERT_FALSE(bad2);
  EXPECT_TRUE(contains(bad2.error().message, tar2));
  EXPECT_TRUE(contains(bad2.error().message, fmt::format("offset {}", b.offset + 512)));
}

TEST(TarScan, CorruptHeaderChecksumNamesShardAndOffset) {
  TempDir d("pacer-tar-");
  const std::map<std::string, std::string> files = {{"a.txt", "A"}, {"b.txt", "B"}, {"c.txt", "C"}};
  const std::string tar = gnu_tar(d, "c.tar", "ustar", files, {"a.txt", "b.txt", "c.txt"});
  auto ms = scan_tar(tar);
  ASSERT_TRUE(ms) << ms.error().message;
  const TarMember c = (*ms)[2];
  std::string bytes = slurp(tar);
  bytes[c.header_offset + 1] ^= 0x20;  // "c.txt" -> "cxtxt": the stored checksum no longer matches
  write_bytes(tar, bytes);
  auto bad = scan_tar(tar);
  ASSERT_FALSE(bad);
  EXPECT_TRUE(contains(bad.error().message, tar));
  EXPECT_TRUE(contains(bad.error().message, fmt::format("offset {}", c.header_offset)));
  EXPECT_TRUE(contains(bad.error().message, "checksum"));
}

TEST(TarScan, MembersEscapingTheRootAreErrors) {
  TempDir d("pacer-tar-");
  int n = 0;
  for (const std::string name : {"../evil", "/abs", "a/../../b", "./../x", "a/..", "x/../y"}) {
    RawTar raw;
    raw.add("good.txt", "fine");
    const std::uint64_t off = raw.add(name, "evil");
    const std::string tar = d.file(fmt::format("e{}.tar", n++), raw.finish());
    auto bad = scan_tar(tar);
    ASSERT_FALSE(bad) << name;
    EXPECT_TRUE(contains(bad.error().message, tar)) << name;
    EXPECT_TRUE(contains(bad.error().message, fmt::format("offset {}", off))) << name;
    EXPECT_EQ(off, 1024u);
  }
  // A pax path escaping the root: the offset is that of the member's first (pax) header.
  {
    RawTar raw;
    raw.add("good.txt", "fine");
    const std::uint64_t off = raw.bytes.size();
    raw.pax({{"path", "../../etc/passwd"}});
    raw.add("harmless.txt", "evil");
    const std::string tar = d.file("pax-evil.tar", raw.finish());
    auto bad = scan_tar(tar);
    ASSERT_FALSE(bad);
    EXPECT_TRUE(contains(bad.error().message, tar));
    EXPECT_TRUE(contains(bad.error().message, fmt::format("offset {}", off)));
    EXPECT_TRUE(contains(bad.error().message, "../../etc/passwd"));
  }
  // Names that merely contain dots are fine.
  RawTar ok;
  ok.add("..hidden/x.txt", "1");
  ok.add("a..b/c...d", "2");
  auto ms = scan_tar(d.file("ok.tar", ok.finish()));
  ASSERT_TRUE(ms) << ms.error().message;
  EXPECT_EQ(names_of(*ms), (std::vector<std::string>{"..hidden/x.txt", "a..b/c...d"}));
}

TEST(TarScan, NonTarFilesAreErrorsNamingTheShard) {
  TempDir d("pacer-tar-");
  std::string text;
  for (int i = 0; i < 100; ++i) text += "this is not a tar archive, just some text\n";
  const std::string p = d.file("text.tar", text);
  auto bad = scan_tar(p);
  ASSERT_FALSE(bad);
  EXPECT_TRUE(contains(bad.error().message, p));
  EXPECT_TRUE(contains(bad.error().message, "offset 0"));

  const std::string small = d.file("small.tar", "tiny");
  auto bad2 = scan_tar(small);
  ASSERT_FALSE(bad2);
  EXPECT_TRUE(contains(bad2.error().message, small));
  EXPECT_TRUE(contains(bad2.error().message, "offset 0"));

  const std::string blob = d.file("blob.tar", binary_blob(4096, 9));
  auto bad3 = scan_tar(blob);
  ASSERT_FALSE(bad3);
  EXPECT_TRUE(contains(bad3.error().message, blob));

  auto missing = scan_tar(d.path() + "/missing.tar");
  ASSERT_FALSE(missing);
  EXPECT_TRUE(contains(missing.error().message, "missing.tar"));
}

// ---------------------------------------------------------------------------
// group_samples

TarMember member(const std::string& name, std::uint64_t off, std::uint64_t size) { return {name, off - 512, off, size}; }

TEST(TarGroup, WebDatasetKeysAndExtensions) {
  const std::vector<TarMember> ms = {
      member("dir/000017.jpg", 512, 10),  member("dir/000017.cls", 1536, 1), member("dir/000017.seg.png", 2560, 5),
      member("a.b.c", 4096, 3),           member("a.txt", 5120, 4),         member("b.x", 6144, 1),
      member("a.y", 7168, 2),             member("dir.v2/file.ext", 8192, 6), member("noext", 9216, 7),
  };
  const auto s = group_samples("g.tar", ms).value();
  ASSERT_EQ(s.size(), 5u);
  EXPECT_EQ(s[0].key, "dir/000017");
  ASSERT_EQ(s[0].fields.size(), 3u);
  EXPECT_EQ(s[0].fields[0].ext, "jpg");
  EXPECT_EQ(s[0].fields[0].offset, 512u);
  EXPECT_EQ(s[0].fields[0].size, 10u);
  EXPECT_EQ(s[0].fields[1].ext, "cls");
  EXPECT_EQ(s[0].fields[2].ext, "seg.png");
  EXPECT_EQ(s[0].fields[2].offset, 2560u);
  EXPECT_EQ(s[0].fields[2].size, 5u);
  // "a.b.c" -> key "a", ext "b.c"; "a.txt" has the same key, and so has the
  // later "a.y": members of one key form one sample wherever they lie.
  EXPECT_EQ(s[1].key, "a");
  ASSERT_EQ(s[1].fields.size(), 3u);
  EXPECT_EQ(s[1].fields[0].ext, "b.c");
  EXPECT_EQ(s[1].fields[1].ext, "txt");
  EXPECT_EQ(s[1].fields[2].ext, "y");
  EXPECT_EQ(s[1].fields[2].offset, 7168u);
  EXPECT_EQ(s[2].key, "b");
  // Dots in directories do not count.
  EXPECT_EQ(s[3].key, "dir.v2/file");
  EXPECT_EQ(s[3].fields[0].ext, "ext");
  EXPECT_EQ(s[4].key, "noext");
  EXPECT_EQ(s[4].fields[0].ext, "");
  EXPECT_TRUE(group_samples("g.tar", {})->empty());
  // A field twice is an error however far apart its members lie.
  auto dup = group_samples("g.tar", {member("a.txt", 512, 1), member("b.txt", 1536, 1), member("a.txt", 2560, 1)});
  ASSERT_FALSE(dup);
  EXPECT_TRUE(contains(dup.error().message, "offset 2048: sample 'a' has field 'txt' twice")) << dup.error().message;
}

// ---------------------------------------------------------------------------
// Index

// A shard of `n` samples with fields "txt" and "cls"; returns its path.
std::string make_shard(const TempDir& d, const std::string& name, int n, int first = 0,
                       std::map<std::string, std::vector<std::pair<std::string, std::string>>>* expected = nullptr) {
  RawTar raw;
  for (int i = first; i < first + n; ++i) {
    const std::string key = fmt::format("s/{:06d}", i);
    const std::string txt = fmt::format("sample {} ", i) + std::string(static_cast<std::size_t>(i % 13) * 40, 'a' + i % 26);
    const std::string cls = std::to_string(i % 10);
    raw.add(key + ".txt", txt);
    raw.add(key + ".cls", cls);
    if (expected) (*expected)[key] = {{"txt", txt}, {"cls", cls}};
  }
  return d.file(name, raw.finish());
}

void expect_same_entries(const std::vector<SampleEntry>& a, const std::vector<SampleEntry>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].key, b[i].key) << i;
    ASSERT_EQ(a[i].fields.size(), b[i].fields.size()) << i;
    for (std::size_t k = 0; k < a[i].fields.size(); ++k) {
      EXPECT_EQ(a[i].fields[k].ext, b[i].fields[k].ext);
      EXPECT_EQ(a[i].fields[k].offset, b[i].fields[k].offset);
      EXPECT_EQ(a[i].fields[k].size, b[i].fields[k].size);
    }
  }
}

// The dataset's form of a shard's entries holds what they hold: keys of any
// length (empty too), samples without fields, extensions numbered once per
// table (up to the 64 distinct ones it searches).
TEST(SampleTableTest, HoldsTheEntriesItWasMadeOf) {
  std::vector<SampleEntry> entries;
  entries.push_back({"", {{"txt", 512, 3}}});
  entries.push_back({std::string(300, 'k'), {}});
  entries.push_back({"a", {{"jpg", 1024, 7}, {"json", 2048, 0}, {"", 4096, 1}}});
  for (int i = 0; i < 40; ++i) entries.push_back({fmt::format("x{}", i), {{fmt::format("e{}", i % 25), 8192u + 1024u * i, 5}, {"jpg", 9000u, 2}}});
  const SampleTable t = SampleTable::of(entries);
  ASSERT_EQ(t.size(), entries.size());
  expect_same_entries(t.entries(), entries);
  EXPECT_EQ(t.key(1).size(), 300u);
  EXPECT_EQ(t.field_count(1), 0u);
  EXPECT_EQ(t.total_fields(), 4u + 80u);
  // "jpg" is one number wherever it appears, and e0..e24 one each.
  EXPECT_EQ(t.fields_begin(2)->ext, (t.fields_begin(3) + 1)->ext);
  EXPECT_EQ(t.fields_begin(3)->ext, t.fields_begin(3 + 25)->ext);
  EXPECT_NE(t.fields_begin(3)->ext, t.fields_begin(4)->ext);
  EXPECT_EQ(t.ext(t.fields_begin(3 + 39)->ext), "e14");
  EXPECT_TRUE(SampleTable().empty());
  EXPECT_TRUE(SampleTable::of({}).entries().empty());
  // Moved from, a table is empty and usable; a field before any sample belongs to an empty key.
  SampleTable moved = SampleTable::of(entries);
  SampleTable taken = std::move(moved);
  EXPECT_EQ(taken.size(), entries.size());
  EXPECT_TRUE(moved.empty());  // NOLINT(bugprone-use-after-move): what is tested
  moved.add_sample("k");
  moved.add_field("txt", 512, 1);
  EXPECT_EQ(moved.size(), 1u);
  EXPECT_EQ(moved.entry(0).fields.size(), 1u);
  SampleTable bare;
  bare.add_field("cls", 512, 1);
  ASSERT_EQ(bare.size(), 1u);
  EXPECT_EQ(bare.key(0), "");
  EXPECT_EQ(bare.ext(bare.fields_begin(0)->ext), "cls");
}

// Samples of more fields than the extensions a table searches (64), through an index and a
// dataset: every field keeps its extension and bytes, whatever the table numbers them.
TEST(SampleTableTest, SamplesOfVeryManyFieldsReadBackExactly) {
  TempDir d("pacer-many-fields-");
  RawTar raw;
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> expected;
  for (int i = 0; i < 6; ++i) {
    const std::string key = fmt::format("m{:03d}", i);
    // The same 100 extensions in each sample, in another order in every other one.
    for (int k = 0; k < 100; ++k) {
      const int e = i % 2 ? 99 - k : k;
      const std::string ext = fmt::format("f{:03d}", e), value = fmt::format("{} {} ", i, e) + std::string(static_cast<std::size_t>(e % 7), 'z');
      raw.add(key + "." + ext, value);
      expected[key].emplace_back(ext, value);
    }
  }
  const std::string shard = d.file("many.tar", raw.finish());
  auto built = build_index(shard);
  ASSERT_TRUE(built) << built.error().message;
  auto back = read_index(shard, false);
  ASSERT_TRUE(back) << back.error().message;
  auto grouped = group_samples(shard, scan_tar(shard).value());
  ASSERT_TRUE(grouped);
  expect_same_entries(back->entries, *grouped);
  auto ds = Dataset::open(shard);
  ASSERT_TRUE(ds) << ds.error().message;
  for (std::uint64_t i = 0; i < (*ds)->size(); ++i) {
    auto r = (*ds)->read(i);
    ASSERT_TRUE(r) << r.error().message;
    EXPECT_EQ(r->fields, expected.at(r->key)) << r->key;
  }
}

TEST(ShardIndex, BuildWritesIndexAndReadsBack) {
  TempDir d("pacer-idx-");
  const std::string shard = make_shard(d, "a.tar", 25);
  EXPECT_EQ(index_path(shard), shard + ".pidx");
  auto built = build_index(shard);
  ASSERT_TRUE(built) << built.error().message;
  EXPECT_TRUE(fs::exists(shard + ".pidx"));
  EXPECT_EQ(built->samples, 25u);
  EXPECT_EQ(built->entries.size(), 25u);
  EXPECT_EQ(built->shard_bytes, fs::file_size(shard));
  EXPECT_EQ(built->shard, shard);

  auto head = read_index(shard, true);
  ASSERT_TRUE(head) << head.error().message;
  EXPECT_EQ(head->samples, 25u);
  EXPECT_EQ(head->shard_bytes, fs::file_size(shard));
  EXPECT_TRUE(head->entries.empty());

  auto full = read_index(shard, false);
  ASSERT_TRUE(full) << full.error().message;
  EXPECT_EQ(full->samples, 25u);
  expect_same_entries(full->entries, built->entries);

  // The entries point at the members' bytes.
  EXPECT_EQ(bytes_at(shard, full->entries[3].fields[1].offset, full->entries[3].fields[1].size), "3");
  EXPECT_EQ(full->entries[3].key, "s/000003");
}

TEST(ShardIndex, IndexOfChangedShardIsRejected) {
  TempDir d("pacer-idx-");
  const std::string shard = make_shard(d, "a.tar", 4);
  ASSERT_TRUE(build_index(shard));
  {
    std::ofstream(shard, std::ios::binary | std::ios::app) << std::string(512, '\0');
  }
  for (bool header_only : {true, false}) {
    auto r = read_index(shard, header_only);
    ASSERT_FALSE(r) << header_only;
    EXPECT_TRUE(contains(r.error().message, shard)) << r.error().message;
    EXPECT_TRUE(contains(r.error().message, "bytes")) << r.error().message;
  }
  // Loading rebuilds the stale index (the directory is writable) from the shard.
  auto l = load_or_build_index(shard, true);
  ASSERT_TRUE(l) << l.error().message;
  EXPECT_EQ(l->shard_bytes, fs::file_size(shard));
  EXPECT_EQ(l->samples, 4u);
  auto back = read_index(shard, false);
  ASSERT_TRUE(back) << back.error().message;
  expect_same_entries(back->entries, group_samples(shard, scan_tar(shard).value()).value());
}

TEST(ShardIndex, MalformedIndexesAreErrors) {
  TempDir d("pacer-idx-");
  const std::string shard = make_shard(d, "a.tar", 6);
  ASSERT_TRUE(build_index(shard));
  const std::string good = slurp(index_path(shard));

  write_bytes(index_path(shard), "NOTANIDX" + good.substr(8));
  auto r1 = read_index(shard, true);
  ASSERT_FALSE(r1);
  EXPECT_TRUE(contains(r1.error().message, "not a pacer shard index"));

  write_bytes(index_path(shard), good.substr(0, 20));
  EXPECT_FALSE(read_index(shard, true));
  EXPECT_FALSE(read_index(shard, false));

  write_bytes(index_path(shard), good.substr(0, good.size() - 5));
  auto r3 = read_index(shard, false);
  ASSERT_FALSE(r3);
  EXPECT_TRUE(contains(r3.error().message, "truncated"));
  EXPECT_TRUE(read_index(shard, true)) << "the header alone is intact";

  // A sample count far beyond what the file holds is an error, not an exception.
  std::string huge = good;
  const std::uint64_t count = 1ULL << 60;
  std::memcpy(huge.data() + 24, &count, 8);
  write_bytes(index_path(shard), huge);
  auto r4 = read_index(shard, false);
  EXPECT_FALSE(r4);

  for (char version : {1, 2, 3, 6}) {
    std::string other = good;
    other[8] = version;
    write_bytes(index_path(shard), other);
    auto r5 = read_index(shard, true);
    ASSERT_FALSE(r5);
    EXPECT_TRUE(contains(r5.error().message, fmt::format("version {}", int(version)))) << r5.error().message;
  }

  fs::remove(index_path(shard));
  EXPECT_FALSE(read_index(shard, true));
}

// A shard of 4 MiB and more is scanned through its mapping rather than a
// pread per header: the same index, pax and GNU long-name records included,
// and the same errors.
TEST(ShardIndex, LargeShardsAreScannedThroughTheMappingToTheSameIndex) {
  TempDir d("pacer-idx-large-");
  RawTar raw;
  raw.pax({{"path", "p/" + std::string(150, 'x') + ".txt"}});
  raw.add("placeholder", "pax named");
  raw.add("././@LongLink", "L/" + std::string(120, 'y') + ".txt", 'L');
  raw.add("truncated", "long named");
  for (int i = 0; i < 40; ++i) raw.add(fmt::format("s{:03d}.bin", i), std::string(150'000 + i, static_cast<char>('a' + i % 26)));
  raw.add("last.txt", "end");
  const std::string bytes = raw.finish();
  ASSERT_GE(bytes.size(), 4u << 20);
  const std::string shard = d.file("big.tar", bytes);
  auto built = build_index(shard);
  ASSERT_TRUE(built) << built.error().message;
  auto scanned = scan_tar(shard);  // a pread per header
  ASSERT_TRUE(scanned) << scanned.error().message;
  expect_same_entries(built->entries, group_samples(shard, *scanned).value());
  EXPECT_EQ(built->entries.size(), 43u);
  EXPECT_EQ(built->entries[0].key, "p/" + std::string(150, 'x'));
  EXPECT_EQ(built->entries[1].key, "L/" + std::string(120, 'y'));
  auto back = read_index(shard, false);
  ASSERT_TRUE(back) << back.error().message;
  // A header broken in the middle is the same error either way, naming the offset.
  std::string broken = bytes;
  const std::size_t at = bytes.find("s020.bin");
  ASSERT_NE(at, std::string::npos);
  broken[at + 1] = '9';  // its name, under the checksum it keeps
  const std::string bad = d.file("bad.tar", broken);
  auto via_map = build_index(bad);
  auto via_pread = scan_tar(bad);
  ASSERT_FALSE(via_map);
  ASSERT_FALSE(via_pread);
  EXPECT_EQ(via_map.error().message, via_pread.error().message);
  EXPECT_TRUE(contains(via_map.error().message, fmt::format("offset {}", at))) << via_map.error().message;
}

TEST(ShardIndex, MissingIndexIsBuiltAndWritten) {
  TempDir d("pacer-idx-");
  const std::string shard = make_shard(d, "a.tar", 9);
  ASSERT_FALSE(fs::exists(index_path(shard)));
  auto idx = load_or_build_index(shard, true);
  ASSERT_TRUE(idx) << idx.error().message;
  EXPECT_EQ(idx->samples, 9u);
  EXPECT_TRUE(fs::exists(index_path(shard)));
  auto again = load_or_build_index(shard, false);
  ASSERT_TRUE(again) << again.error().message;
  EXPECT_EQ(again->entries.size(), 9u);

  // A shard that is not a tar: the scan error comes through.
  const std::string bad = d.file("bad.tar", std::string(2048, 'z'));
  auto e = load_or_build_index(bad, true);
  ASSERT_FALSE(e);
  EXPECT_TRUE(contains(e.error().message, bad));
  EXPECT_FALSE(fs::exists(index_path(bad)));
  auto e2 = build_index(bad);
  EXPECT_FALSE(e2);
}

TEST(ShardIndex, EmptyShardHasNoSamples) {
  TempDir d("pacer-idx-");
  RawTar raw;
  raw.add("only-a-dir/", "", '5');
  const std::string shard = d.file("e.tar", raw.finish());
  auto idx = build_index(shard);
  ASSERT_TRUE(idx) << idx.error().message;
  EXPECT_EQ(idx->samples, 0u);
  auto back = read_index(shard, false);
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(back->samples, 0u);
}

// A read-only directory (a tmpfs remounted read-only): the index stays in memory.
TEST(ShardIndex, ReadOnlyDirectoryKeepsIndexInMemory) {
  Tmpfs t;
  PACER_MOUNT_TMPFS_OR_SKIP(t);
  const std::string& mnt = t.mnt;
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> expected;
  RawTar raw;
  for (int i = 0; i < 5; ++i) raw.add(fmt::format("k{}.txt", i), fmt::format("value {}", i));
  const std::string shard = mnt + "/ro.tar";
  write_bytes(shard, raw.finish());
  ASSERT_TRUE(t.read_only()) << std::strerror(errno);
  ASSERT_FALSE(build_index(shard)) << "writing the index into a read-only directory must fail";

  auto idx = load_or_build_index(shard, true);
  ASSERT_TRUE(idx) << idx.error().message;
  EXPECT_EQ(idx->samples, 5u);
  EXPECT_EQ(idx->entries.size(), 5u) << "a scanned index is returned whole";
  EXPECT_FALSE(fs::exists(index_path(shard)));

  auto ds = Dataset::open(std::vector<std::string>{shard});
  ASSERT_TRUE(ds) << ds.error().message;
  ASSERT_EQ((*ds)->size(), 5u);
  for (std::uint64_t i = 0; i < 5; ++i) {
    auto s = (*ds)->read(i);
    ASSERT_TRUE(s) << s.error().message;
    EXPECT_EQ(s->key, fmt::format("k{}", i));
    ASSERT_EQ(s->fields.size(), 1u);
    EXPECT_EQ(s->fields[0].second, fmt::format("value {}", i));
  }
}

// ---------------------------------------------------------------------------
// expand_shard_spec

TEST(SpecExpand, NumericRangesAreZeroPadded) {
  auto r = expand_shard_spec("/data/train-{000..003}.tar");
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(*r, (std::vector<std::string>{"/data/train-000.tar", "/data/train-001.tar", "/data/train-002.tar", "/data/train-003.tar"}));
  auto w = expand_shard_spec("s-{8..11}.tar");
  ASSERT_TRUE(w) << w.error().message;
  EXPECT_EQ(*w, (std::vector<std::string>{"s-8.tar", "s-9.tar", "s-10.tar", "s-11.tar"}));
  auto one = expand_shard_spec("s-{000005..000005}.tar");
  ASSERT_TRUE(one);
  EXPECT_EQ(*one, (std::vector<std::string>{"s-000005.tar"}));
  auto plain = expand_shard_spec("just/a/file.tar");
  ASSERT_TRUE(plain);
  EXPECT_EQ(*plain, (std::vector<std::string>{"just/a/file.tar"}));
}

TEST(SpecExpand, ListsMultipleAndNestedGroups) {
  auto a = expand_shard_spec("a-{x,y}.tar");
  ASSERT_TRUE(a) << a.error().message;
  EXPECT_EQ(*a, (std::vector<std::string>{"a-x.tar", "a-y.tar"}));
  auto m = expand_shard_spec("{p,q}/s-{0..1}.tar");
  ASSERT_TRUE(m) << m.error().message;
  EXPECT_EQ(*m, (std::vector<std::string>{"p/s-0.tar", "p/s-1.tar", "q/s-0.tar", "q/s-1.tar"}));
  auto n = expand_shard_spec("d-{a,b{0..1},c}.tar");
  ASSERT_TRUE(n) << n.error().message;
  EXPECT_EQ(*n, (std::vector<std::string>{"d-a.tar", "d-b0.tar", "d-b1.tar", "d-c.tar"}));
  auto n2 = expand_shard_spec("{x,{y,z}w}.tar");
  ASSERT_TRUE(n2) << n2.error().message;
  EXPECT_EQ(*n2, (std::vector<std::string>{"x.tar", "yw.tar", "zw.tar"}));
}

TEST(SpecExpand, BadRangesAndUnbalancedBracesAreErrors) {
  for (const std::string spec : {"s-{3..1}.tar", "s-{a..b}.tar", "s-{1..}.tar", "s-{..2}.tar", "s-{1..2x}.tar"}) {
    auto r = expand_shard_spec(spec);
    ASSERT_FALSE(r) << spec;
    EXPECT_TRUE(contains(r.error().message, "range")) << r.error().message;
  }
  auto u = expand_shard_spec("s-{a,b.tar");
  ASSERT_FALSE(u);
  EXPECT_TRUE(contains(u.error().message, "{"));
}

TEST(SpecExpand, GlobsMatchInOrder) {
  TempDir d("pacer-spec-");
  for (const char* n : {"s-2.tar", "s-0.tar", "s-1.tar", "t-0.tar", "other.txt"}) d.file(n, "x");
  auto g = expand_shard_spec(d.path() + "/s-*.tar");
  ASSERT_TRUE(g) << g.error().message;
  EXPECT_EQ(*g, (std::vector<std::string>{d.path() + "/s-0.tar", d.path() + "/s-1.tar", d.path() + "/s-2.tar"}));
  auto q = expand_shard_spec(d.path() + "/{t,s}-?.tar");
  ASSERT_TRUE(q) << q.error().message;
  EXPECT_EQ(*q, (std::vector<std::string>{d.path() + "/t-0.tar", d.path() + "/s-0.tar", d.path() + "/s-1.tar", d.path() + "/s-2.tar"}));
  auto c = expand_shard_spec(d.path() + "/s-[01].tar");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_EQ(c->size(), 2u);

  auto none = expand_shard_spec(d.path() + "/none-*.tar");
  ASSERT_FALSE(none);
  EXPECT_TRUE(contains(none.error().message, "none-*.tar"));
  EXPECT_TRUE(contains(none.error().message, "matches no file"));
}

TEST(SpecExpand, ManifestPathsAreRelativeToItsDirectory) {
  TempDir d("pacer-spec-");
  const std::string m = d.file("pack/manifest.json",
                               R"({"schema":"pacer.shards/1","shards":[{"path":"s-0.tar","samples":3},{"path":"sub/s-1.tar"},{"path":"/abs/s-2.tar"}]})");
  auto r = expand_shard_spec(m);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(*r, (std::vector<std::string>{d.path() + "/pack/s-0.tar", d.path() + "/pack/sub/s-1.tar", "/abs/s-2.tar"}));

  // A manifest named relative to the working directory.
  const std::string cwd = fs::current_path().string();
  fs::current_path(d.path() + "/pack");
  auto rel = expand_shard_spec("manifest.json");
  fs::current_path(cwd);
  ASSERT_TRUE(rel) << rel.error().message;
  EXPECT_EQ(rel->at(0), "s-0.tar");
}

TEST(SpecExpand, BadManifestsAreErrors) {
  TempDir d("pacer-spec-");
  const std::vector<std::string> bad = {
      R"({"schema":"other/1","shards":[]})",
      R"({"schema":"pacer.shards/1"})",
      R"(not json)",
      R"([1,2,3])",
      R"({"schema":"pacer.shards/1","shards":[{"name":"x.tar"}]})",
      R"({"schema":"pacer.shards/1","shards":[{"path":7}]})",
      R"({"schema":"pacer.shards/1","shards":"x.tar"})",
      // A shard listed twice (it would be read twice per epoch).
      R"({"schema":"pacer.shards/1","shards":[{"path":"x.tar"},{"path":"./x.tar"}]})",
  };
  int i = 0;
  for (const auto& text : bad) {
    const std::string m = d.file(fmt::format("m{}.json", i++), text);
    Expected<std::vector<std::string>> r = Error{};
    ASSERT_NO_THROW(r = expand_shard_spec(m)) << text;
    ASSERT_FALSE(r) << text;
    EXPECT_TRUE(contains(r.error().message, m)) << r.error().message;
  }
  auto missing = expand_shard_spec(d.path() + "/missing.json");
  EXPECT_FALSE(missing);
}

// ---------------------------------------------------------------------------
// Dataset

struct Shards {
  TempDir dir{"pacer-ds-"};
  std::vector<std::string> paths;
  std::vector<std::string> keys;  // in dataset order
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> expected;

  explicit Shards(const std::vector<int>& counts) {
    int first = 0;
    for (std::size_t s = 0; s < counts.size(); ++s) {
      paths.push_back(make_shard(dir, fmt::format("shard-{:03d}.tar", s), counts[s], first, &expected));
      for (int i = first; i < first + counts[s]; ++i) keys.push_back(fmt::format("s/{:06d}", i));
      first += counts[s];
    }
  }
};

TEST(DatasetRead, SamplesAreNumberedAcrossShardsWithExactBytes) {
  Shards sh({5, 0, 7, 1, 3});
  auto ds = Dataset::open(sh.dir.path() + "/shard-{000..004}.tar");
  ASSERT_TRUE(ds) << ds.error().message;
  const Dataset& d = **ds;
  EXPECT_EQ(d.size(), 16u);
  EXPECT_EQ(d.shards(), sh.paths);
  EXPECT_EQ(d.shard_samples(), (std::vector<std::uint64_t>{5, 0, 7, 1, 3}));
  for (const auto& p : sh.paths) EXPECT_TRUE(fs::exists(index_path(p))) << "open builds missing indexes";
  for (std::uint64_t i = 0; i < d.size(); ++i) {
    auto s = d.read(i);
    ASSERT_TRUE(s) << s.error().message;
    EXPECT_EQ(s->key, sh.keys[i]);
    EXPECT_EQ(s->fields, sh.expected[sh.keys[i]]) << i;
  }
  // A second open uses the written indexes and reads the same.
  auto again = Dataset::open(sh.paths);
  ASSERT_TRUE(again) << again.error().message;
  for (std::uint64_t i = d.size(); i-- > 0;) {
    auto s = (*again)->read(i);
    ASSERT_TRUE(s) << s.error().message;
    EXPECT_EQ(s->key, sh.keys[i]);
    EXPECT_EQ(s->fields, sh.expected[sh.keys[i]]);
  }
}

TEST(DatasetRead, OutOfRangeAndMissingShardsAreErrors) {
  Shards sh({3, 2});
  auto ds = Dataset::open(sh.paths);
  ASSERT_TRUE(ds) << ds.error().message;
  auto r = (*ds)->read(5);
  ASSERT_FALSE(r);
  EXPECT_TRUE(contains(r.error().message, "5"));
  EXPECT_FALSE((*ds)->read(~0ULL));
  EXPECT_TRUE((*ds)->read(4));

  auto missing = Dataset::open(std::vector<std::string>{sh.paths[0], sh.dir.path() + "/nope.tar"});
  ASSERT_FALSE(missing);
  EXPECT_TRUE(contains(missing.error().message, "nope.tar"));

  auto notar = Dataset::open(std::vector<std::string>{sh.dir.file("text.tar", std::string(3000, 'q'))});
  ASSERT_FALSE(notar);
  EXPECT_TRUE(contains(notar.error().message, "text.tar"));

  auto empty = Dataset::open(std::vector<std::string>{});
  ASSERT_TRUE(empty) << empty.error().message;
  EXPECT_EQ((*empty)->size(), 0u);
  EXPECT_FALSE((*empty)->read(0));
}

TEST(DatasetRead, ShardTruncatedAfterIndexingNamesShardAndOffset) {
  Shards sh({4, 10});
  auto ds = Dataset::open(sh.paths);
  ASSERT_TRUE(ds) << ds.error().message;
  const Dataset& d = **ds;
  ASSERT_TRUE(d.read(4));  // loads shard 1's entries
  auto idx = read_index(sh.paths[1], false);
  ASSERT_TRUE(idx);
  const Field cut_field = idx->entries[6].fields[0];
  truncate_file(sh.paths[1], cut_field.offset + 1);
  for (std::uint64_t i = 0; i < 4 + 6; ++i) {
    auto s = d.read(i);
    EXPECT_TRUE(s) << i << ": " << s.error().message;
  }
  auto bad = d.read(4 + 6);
  ASSERT_FALSE(bad);
  EXPECT_TRUE(contains(bad.error().message, sh.paths[1]));
  EXPECT_TRUE(contains(bad.error().message, fmt::format("offset {}", cut_field.offset + 1)));
  auto bad2 = d.read(13);
  ASSERT_FALSE(bad2);
  EXPECT_TRUE(contains(bad2.error().message, sh.paths[1]));
  EXPECT_TRUE(contains(bad2.error().message, "offset"));

  // A fresh open sees the index no longer matches the shard.
  auto reopened = Dataset::open(sh.paths);
  ASSERT_FALSE(reopened);
  EXPECT_TRUE(contains(reopened.error().message, sh.paths[1]));

  // Truncation before the entries are loaded: every read from the shard fails, naming it.
  Shards sh2({3, 3});
  auto ds2 = Dataset::open(sh2.paths);
  ASSERT_TRUE(ds2);
  truncate_file(sh2.paths[1], 1024);
  auto bad3 = (*ds2)->read(3);
  ASSERT_FALSE(bad3);
  EXPECT_TRUE(contains(bad3.error().message, sh2.paths[1]));
  EXPECT_TRUE((*ds2)->read(2));
}

TEST(DatasetRead, ConcurrentReadsReturnExactBytes) {
  Shards sh({13, 9, 21});
  auto ds = Dataset::open(sh.paths);
  ASSERT_TRUE(ds) << ds.error().message;
  std::atomic<int> failures{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int k = 0; k < 500; ++k) {
        const std::uint64_t i = rng() % (*ds)->size();
        auto s = (*ds)->read(i);
        if (!s || s->key != sh.keys[i] || s->fields != sh.expected[sh.keys[i]]) ++failures;
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(failures.load(), 0);
}

// More shards than the dataset keeps open: descriptors are closed and reopened
// while other threads read.
// Opening many shards indexes them on several threads; what comes out must
// not depend on that: the shards' order, counts, and the first bad shard in
// the given order named, whatever shard a thread reached first.
TEST(DatasetOpen, ManyShardsIndexedInParallelKeepOrderAndTheFirstError) {
  TempDir d("pacer-open-many-");
  std::vector<std::string> paths;
  std::uint64_t total = 0;
  for (int s = 0; s < 200; ++s) {
    RawTar raw;
    for (int i = 0; i <= s % 3; ++i, ++total) raw.add(fmt::format("s{:03d}k{}.txt", s, i), fmt::format("{} {}", s, i));
    paths.push_back(d.file(fmt::format("p-{:03d}.tar", s), raw.finish()));
  }
  auto ds = Dataset::open(paths);
  ASSERT_TRUE(ds) << ds.error().message;
  EXPECT_EQ((*ds)->size(), total);
  EXPECT_EQ((*ds)->shards(), paths);
  for (int s = 0; s < 200; ++s) EXPECT_EQ((*ds)->shard_samples()[static_cast<std::size_t>(s)], static_cast<std::uint64_t>(s % 3 + 1));
  auto last = (*ds)->read(total - 1);
  ASSERT_TRUE(last) << last.error().message;
  EXPECT_EQ(last->key, "s199k1");  // 199 % 3 + 1 = 2 samples

  // Two bad shards, late ones first in any thread's path: the error names the earlier one.
  std::vector<std::string> bad = paths;
  bad[150] = d.file("bad-150.tar", std::string(3000, 'q'));
  bad[90] = d.file("bad-090.tar", std::string(3000, 'z'));
  bad[170] = d.path() + "/missing-170.tar";
  auto got = Dataset::open(bad);
  ASSERT_FALSE(got);
  EXPECT_TRUE(contains(got.error().message, "bad-090.tar")) << got.error().message;
}

TEST(DatasetRead, ManyShardsWithConcurrentReaders) {
  TempDir d("pacer-many-");
  std::vector<std::string> paths;
  std::vector<std::string> values;
  for (int s = 0; s < 150; ++s) {
    RawTar raw;
    for (int i = 0; i < 2; ++i) {
      const std::string v = fmt::format("shard {} sample {} ", s, i) + std::string(static_cast<std::size_t>(s * 7 % 600), 'a' + s % 26);
      raw.add(fmt::format("k{:03d}{}.bin", s, i), v);
      values.push_back(v);
    }
    paths.push_back(d.file(fmt::format("m-{:03d}.tar", s), raw.finish()));
  }
  auto ds = Dataset::open(paths);
  ASSERT_TRUE(ds) << ds.error().message;
  ASSERT_EQ((*ds)->size(), 300u);
  std::atomic<int> failures{0};
  std::string first_error;
  std::mutex mu;
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      for (int k = 0; k < 6000; ++k) {
        const std::uint64_t i = rng() % 300;
        auto s = (*ds)->read(i);
        if (!s || s->fields.size() != 1 || s->fields[0].second != values[i]) {
          if (failures++ == 0) {
            std::lock_guard g(mu);
            first_error = s ? "wrong bytes for sample " + std::to_string(i) : s.error().message;
          }
        }
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(failures.load(), 0) << first_error;
}

// ---------------------------------------------------------------------------
// Permutation

TEST(PermutationTest, IsABijection) {
  for (std::uint64_t n : {1ULL, 2ULL, 3ULL, 7ULL, 100ULL, 1000ULL, 4097ULL, 100003ULL}) {
    for (std::uint64_t seed : {0ULL, 42ULL}) {
      const Permutation p(n, seed, 3);
      EXPECT_EQ(p.size(), n);
      std::vector<char> seen(n, 0);
      bool ok = true;
      for (std::uint64_t i = 0; i < n; ++i) {
        const std::uint64_t v = p(i);
        if (v >= n || seen[v]) {
          ok = false;
          ADD_FAILURE() << "n=" << n << " seed=" << seed << ": p(" << i << ") = " << v;
          break;
        }
        seen[v] = 1;
      }
      EXPECT_TRUE(ok) << n;
      EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), static_cast<std::ptrdiff_t>(n)) << n;
    }
  }
}

TEST(PermutationTest, FillGivesTheSameValuesAsOneAtATime) {
  for (std::uint64_t n : {1ULL, 2ULL, 3ULL, 7ULL, 100ULL, 4097ULL, 100003ULL}) {
    const Permutation p(n, 11, 4);
    // Whole range and a slice whose ends are not lane-aligned.
    for (auto [lo, hi] : {std::pair<std::uint64_t, std::uint64_t>{0, n}, {n / 3, n - n / 5}}) {
      std::vector<std::uint64_t> out(hi - lo, ~0ULL);
      p.fill(lo, hi, out.data());
      for (std::uint64_t i = lo; i < hi; ++i) ASSERT_EQ(out[i - lo], p(i)) << "n=" << n << " i=" << i;
    }
  }
}

TEST(PermutationTest, DeterministicPerSeedAndEpoch) {
  for (std::uint64_t n : {1ULL, 2ULL, 3ULL, 7ULL, 100ULL, 1000ULL, 4097ULL, 100003ULL}) {
    const Permutation a(n, 7, 2), b(n, 7, 2);
    for (std::uint64_t i = 0; i < n; i += 1 + n / 1000) ASSERT_EQ(a(i), b(i)) << n << " " << i;
  }
}

TEST(PermutationTest, NewSeedOrEpochGivesNewOrder) {
  for (std::uint64_t n : {100ULL, 1000ULL, 4097ULL, 100003ULL}) {
    const Permutation base(n, 7, 0), epoch1(n, 7, 1), seed8(n, 8, 0);
    std::uint64_t same_epoch = 0, same_seed = 0, fixed = 0;
    for (std::uint64_t i = 0; i < n; ++i) {
      same_epoch += base(i) == epoch1(i);
      same_seed += base(i) == seed8(i);
      fixed += base(i) == i;
    }
    // A random permutation agrees with another in about one place.
    EXPECT_LT(same_epoch, n / 10) << n;
    EXPECT_LT(same_seed, n / 10) << n;
    EXPECT_LT(fixed, n / 10) << n << ": barely shuffled";
  }
  // Different epochs of one seed are all distinct orders.
  std::set<std::vector<std::uint64_t>> orders;
  for (std::uint64_t e = 0; e < 20; ++e) {
    const Permutation p(100, 1, e);
    std::vector<std::uint64_t> v;
    for (std::uint64_t i = 0; i < 100; ++i) v.push_back(p(i));
    orders.insert(v);
  }
  EXPECT_EQ(orders.size(), 20u);
}

// ---------------------------------------------------------------------------
// Partition

TEST(PartitionTest, EveryPositionOnceWithContiguousRanges) {
  int combos = 0;
  for (std::uint64_t samples : {1ULL, 2ULL, 5ULL, 7ULL, 8ULL, 16ULL, 17ULL, 31ULL, 64ULL, 97ULL, 100ULL, 1001ULL}) {
    for (std::uint64_t batch : {1ULL, 2ULL, 3ULL, 5ULL, 8ULL, 32ULL}) {
      for (int world : {1, 2, 3, 4, 7}) {
        for (bool drop_last : {false, true}) {
          ++combos;
          const std::string what = fmt::format("samples={} batch={} world={} drop_last={}", samples, batch, world, drop_last);
          Partition p0{samples, batch, 0, world, drop_last};
          const std::uint64_t gb = batch * static_cast<std::uint64_t>(world);
          ASSERT_EQ(p0.global_batch(), gb) << what;
          const std::uint64_t batches = p0.batches();
          ASSERT_EQ(batches, drop_last ? samples / gb : (samples + gb - 1) / gb) << what;
          const std::uint64_t covered = drop_last ? batches * gb : samples;
          std::vector<int> hits(samples, 0);
          for (std::uint64_t g = 0; g < batches; ++g) {
            const std::uint64_t start = g * gb;
            const std::uint64_t end = std::min(start + gb, samples);
            std::uint64_t expect_lo = start;
            for (int r = 0; r < world; ++r) {
              Partition p{samples, batch, r, world, drop_last};
              ASSERT_EQ(p.batches(), batches) << what;
              const auto [lo, hi] = p.range(g);
              ASSERT_EQ(lo, expect_lo) << what << " g=" << g << " r=" << r;
              ASSERT_LE(lo, hi) << what;
              ASSERT_LE(hi, end) << what;
              ASSERT_LE(hi - lo, batch) << what;
              if (end - start == gb) {
                ASSERT_EQ(hi - lo, batch) << what << ": a full global batch gives every rank batch_size";
              }
              for (std::uint64_t i = lo; i < hi; ++i) ++hits[i];
              expect_lo = hi;
            }
            ASSERT_EQ(expect_lo, end) << what << " g=" << g;
          }
          for (std::uint64_t i = 0; i < samples; ++i) ASSERT_EQ(hits[i], i < covered ? 1 : 0) << what << " position " << i;
        }
      }
    }
  }
  EXPECT_GT(combos, 500);
}

TEST(PartitionTest, GlobalBatchesHoldTheSamePositionsAtAnyWorldSize) {
  // The same global batch over 1, 2, 4, 8 ranks reads the same positions per global batch.
  for (std::uint64_t samples : {50ULL, 64ULL, 77ULL}) {
    for (std::uint64_t w : {1ULL, 2ULL, 4ULL, 8ULL}) {
      const std::uint64_t b = 8 / w;
      Partition p{samples, b, 0, static_cast<int>(w), false};
      ASSERT_EQ(p.batches(), (samples + 7) / 8);
      for (std::uint64_t g = 0; g < p.batches(); ++g) {
        Partition first{samples, b, 0, static_cast<int>(w), false};
        Partition last{samples, b, static_cast<int>(w) - 1, static_cast<int>(w), false};
        EXPECT_EQ(first.range(g).first, g * 8);
        EXPECT_EQ(last.range(g).second, std::min(g * 8 + 8, samples));
      }
    }
  }
  EXPECT_EQ((Partition{10, 0, 0, 1, false}.batches()), 0u);
}

}  // namespace
}  // namespace pacer::data

// ---------------------------------------------------------------------------
// Crafted input: sizes that wrap, allocations beyond the file, malformed pax,
// sparse members, duplicate fields, bit-flipped and stale indexes, brace bombs.

namespace pacer::data {
namespace {

using test::RawTar;
using test::TempDir;
using test::contains;

// A header whose size field is GNU base-256: 0x80, then 11 big-endian bytes.
std::string base256_header(const std::string& name, std::uint64_t size, char type = '0') {
  return RawTar::header(name, 0, type, [&](char* p) {
    std::memset(p + 124, 0, 12);
    p[124] = static_cast<char>(0x80);
    for (int i = 0; i < 8; ++i) p[135 - i] = static_cast<char>((size >> (8 * i)) & 0xff);
  });
}

TEST(TarCrafted, HugeBase256SizesAreErrorsNotLoops) {
  TempDir d("pacer-crafted-");
  for (std::uint64_t size : {~std::uint64_t{0}, ~std::uint64_t{0} - 511, ~std::uint64_t{0} - 1023, std::uint64_t{1} << 63}) {
    RawTar raw;
    raw.add("a.txt", "A");
    raw.bytes += base256_header("big.bin", size);
    raw.add("c.txt", "C");
    const std::string tar = d.file("big.tar", raw.finish());
    auto ms = scan_tar(tar);
    ASSERT_FALSE(ms) << size;
    EXPECT_TRUE(contains(ms.error().message, tar));
    EXPECT_TRUE(contains(ms.error().message, "offset 1024")) << ms.error().message;
  }
  // More than 64 bits of base-256 digits.
  RawTar raw;
  raw.bytes += RawTar::header("wide.bin", 0, '0', [](char* p) {
    std::memset(p + 124, 0xff, 12);
    p[124] = static_cast<char>(0x80);
  });
  auto ms = scan_tar(d.file("wide.tar", raw.finish()));
  ASSERT_FALSE(ms);
  EXPECT_TRUE(contains(ms.error().message, "bad size field"));
}

TEST(TarCrafted, PaxSizesThatWrapAreErrorsNotRereads) {
  TempDir d("pacer-crafted-");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"18446744073709551104", "runs past the end"},  // 2^64 - 512: data_off + padded size wraps to the header itself
      {"18446744073709551615", "runs past the end"},
      {"99999999999999999999999", "not a byte count"},
      {"12abc", "not a byte count"},
      {"", "not a byte count"},
  };
  for (const auto& [value, needle] : cases) {
    RawTar raw;
    raw.pax({{"size", value}});
    raw.add("x.bin", "payload");
    const std::string tar = d.file("pax.tar", raw.finish());
    auto ms = scan_tar(tar);
    ASSERT_FALSE(ms) << value;
    EXPECT_TRUE(contains(ms.error().message, tar));
    EXPECT_TRUE(contains(ms.error().message, needle)) << value;
    auto idx = load_or_build_index(tar, true);
    EXPECT_FALSE(idx) << value;
  }
}

TEST(TarCrafted, LongNamesAreBoundedAndNeverAllocateBeyondTheFile) {
  TempDir d("pacer-crafted-");
  // A GNU long name of 1 MiB: refused by the limit, before it is read.
  {
    RawTar raw;
    raw.add("././@LongLink", std::string(1 << 20, 'n'), 'L');
    raw.add("short", "data");
    const std::string tar = d.file("long.tar", raw.finish());
    auto ms = scan_tar(tar);
    ASSERT_FALSE(ms);
    EXPECT_TRUE(contains(ms.error().message, tar));
    EXPECT_TRUE(contains(ms.error().message, "GNU long name of 1048576 bytes")) << ms.error().message;
  }
  // A 4 GiB long-name header in a sparse 4 GiB file: refused without allocating it.
  {
    const std::string tar = d.file("sparse-long.tar", RawTar::header("././@LongLink", 0, 'L', [](char* p) {
                                       std::memcpy(p + 124, "40000000000", 12);  // 4 GiB in octal
                                     }));
    fs::resize_file(tar, (4ULL << 30) + 4096);
    auto ms = scan_tar(tar);
    ASSERT_FALSE(ms);
    EXPECT_TRUE(contains(ms.error().message, "GNU long name of 4294967296 bytes")) << ms.error().message;
  }
  // A long-name size that wraps: an error naming the file, not a length_error.
  {
    RawTar raw;
    raw.bytes += base256_header("././@LongLink", ~std::uint64_t{0} - 100, 'L');
    const std::string tar = d.file("wrap-long.tar", raw.finish());
    auto ms = scan_tar(tar);
    ASSERT_FALSE(ms);
    EXPECT_TRUE(contains(ms.error().message, tar));
    EXPECT_TRUE(contains(ms.error().message, "offset 0"));
  }
  // A pax path longer than the index can hold.
  {
    RawTar raw;
    raw.pax({{"path", std::string(70000, 'p') + ".txt"}});
    raw.add("x.txt", "data");
    const std::string tar = d.file("pax-long.tar", raw.finish());
    auto ms = scan_tar(tar);
    ASSERT_FALSE(ms);
    EXPECT_TRUE(contains(ms.error().message, "member name of 70004 bytes")) << ms.error().message;
  }
}

TEST(TarCrafted, MalformedPaxRecordsNameTheShardAndHeader) {
  TempDir d("pacer-crafted-");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"abc path=x\n", "no decimal length"},
      {"99 path=x\n", "past the header's end"},
      {"12 path=xyz", "past the header's end"},
      {"10 path=xyz", "not 'LEN key=value"},
      {"9 pathxy\n", "no key=value"},
      {"5 =x\n", "no key=value"},
      {"1 \n", "not 'LEN key=value"},
  };
  for (const auto& [records, needle] : cases) {
    RawTar raw;
    raw.add("ok.txt", "fine");
    raw.add("PaxHeaders/victim.txt", records, 'x');
    raw.add("victim.txt", "data");
    const std::string tar = d.file("pax.tar", raw.finish());
    auto ms = scan_tar(tar);
    ASSERT_FALSE(ms) << records;
    EXPECT_TRUE(contains(ms.error().message, tar));
    EXPECT_TRUE(contains(ms.error().message, "offset 1024"));
    EXPECT_TRUE(contains(ms.error().message, "PaxHeaders/victim.txt"));
    EXPECT_TRUE(contains(ms.error().message, needle)) << records;
  }
  // Well-formed records, NUL padding after them and unknown keys are fine.
  RawTar raw;
  raw.add("PaxHeaders/x", "17 path=good.txt\n11 foo=bar\n" + std::string(7, '\0'), 'x');
  raw.add("ignored", "data");
  auto ms = scan_tar(d.file("ok.tar", raw.finish()));
  ASSERT_TRUE(ms) << ms.error().message;
  ASSERT_EQ(ms->size(), 1u);
  EXPECT_EQ((*ms)[0].name, "good.txt");
}

TEST(TarCrafted, SparseAndMultiVolumeMembersAreErrorsNamingTheMember) {
  TempDir d("pacer-crafted-");
  {
    RawTar raw;
    raw.add("a.txt", "A");
    raw.add("holes.bin", "sparse data", 'S');
    const std::string tar = d.file("s.tar", raw.finish());
    auto ms = scan_tar(tar);
    ASSERT_FALSE(ms);
    EXPECT_TRUE(contains(ms.error().message, tar));
    EXPECT_TRUE(contains(ms.error().message, "'holes.bin'"));
    EXPECT_TRUE(contains(ms.error().message, "sparse"));
  }
  {
    RawTar raw;
    raw.pax({{"GNU.sparse.major", "1"}, {"GNU.sparse.minor", "0"}, {"GNU.sparse.name", "holes.bin"}});
    raw.add("GNUSparseFile.0/holes.bin", "map and pieces");
    const std::string tar = d.file("s1.tar", raw.finish());
    auto ms = scan_tar(tar);
    ASSERT_FALSE(ms);
    EXPECT_TRUE(contains(ms.error().message, tar));
    EXPECT_TRUE(contains(ms.error().message, "GNU.sparse.major"));
  }
  {
    RawTar raw;
    raw.add("rest.bin", "continued", 'M');
    auto ms = scan_tar(d.file("m.tar", raw.finish()));
    ASSERT_FALSE(ms);
    EXPECT_TRUE(contains(ms.error().message, "'rest.bin'"));
    EXPECT_TRUE(contains(ms.error().message, "multi-volume"));
  }
  // GNU tar's own sparse output, when this tar can write it.
  TempDir g("pacer-crafted-");
  const std::string holes = g.path() + "/src/k.bin";
  fs::create_directories(g.path() + "/src");
  {
    std::ofstream(holes, std::ios::binary) << "x";
  }
  fs::resize_file(holes, 1 << 20);
  const std::string tar = g.path() + "/gnu-sparse.tar";
  ASSERT_TRUE(sh("cd " + quote(g.path() + "/src") + " && tar --sparse --format=gnu -cf " + quote(tar) + " k.bin"));
  auto ms = scan_tar(tar);
  ASSERT_FALSE(ms);
  EXPECT_TRUE(contains(ms.error().message, "'k.bin'")) << ms.error().message;
}

TEST(TarCrafted, DuplicateFieldsAreErrorsNamingShardAndKey) {
  TempDir d("pacer-crafted-");
  RawTar raw;
  raw.add("s/000001.txt", "one");
  raw.add("s/000002.txt", "first");
  raw.add("s/000002.cls", "2");
  const std::uint64_t dup = raw.add("s/000002.txt", "second");
  const std::string tar = d.file("dup.tar", raw.finish());
  ASSERT_TRUE(scan_tar(tar)) << "the members themselves are fine";
  auto g = group_samples(tar, scan_tar(tar).value());
  ASSERT_FALSE(g);
  EXPECT_TRUE(contains(g.error().message, tar));
  EXPECT_TRUE(contains(g.error().message, "'s/000002'"));
  EXPECT_TRUE(contains(g.error().message, "'txt' twice"));
  EXPECT_TRUE(contains(g.error().message, fmt::format("offset {}", dup)));
  auto built = build_index(tar);
  ASSERT_FALSE(built);
  EXPECT_TRUE(contains(built.error().message, "'s/000002'"));
  EXPECT_FALSE(fs::exists(index_path(tar)));
  auto ds = Dataset::open(tar);
  ASSERT_FALSE(ds);
  EXPECT_TRUE(contains(ds.error().message, tar));
  auto v = verify_shards(tar);
  ASSERT_TRUE(v) << v.error().message;
  EXPECT_FALSE(v->ok());
  EXPECT_TRUE(contains(v->shards.at(0).problem, "twice"));
}

// Rewrites an index's checksums after a test edited it, as a crafted file would.
void reseal(std::string& idx) {
  const std::uint64_t entries = XXH3_64bits(idx.data() + 96, idx.size() - 96);
  std::memcpy(idx.data() + 48, &entries, 8);
  const std::uint64_t self = XXH3_64bits(idx.data(), 88);
  std::memcpy(idx.data() + 88, &self, 8);
}

// An index as rebuilt from the same shard: all but when its headers were
// hashed (and so the header checksum) is the same.
std::string without_hash_time(std::string idx) {
  if (idx.size() >= 96) {
    std::fill(idx.begin() + 72, idx.begin() + 80, '\0');
    std::fill(idx.begin() + 88, idx.begin() + 96, '\0');
  }
  return idx;
}

// Moves the index's record of when the shard's headers were hashed to
// `after_ns` past the shard's change time, as if it had been built then.
void hashed_after_change(const std::string& shard, std::int64_t after_ns) {
  std::string bin = slurp(index_path(shard));
  std::int64_t ctime = 0;
  std::memcpy(&ctime, bin.data() + 64, 8);
  const std::int64_t at = after_ns == INT64_MIN ? INT64_MIN : ctime + after_ns;
  std::memcpy(bin.data() + 72, &at, 8);
  reseal(bin);
  write_bytes(index_path(shard), bin);
}

// Replaces the index's member-header hash (resealed), so that only a read
// that skips the hash accepts it.
void break_headers_hash(const std::string& shard) {
  std::string bin = slurp(index_path(shard));
  bin[40] = static_cast<char>(bin[40] ^ 1);
  reseal(bin);
  write_bytes(index_path(shard), bin);
}

// Every sample of a dataset over `shard`, as (key, fields).
std::vector<Dataset::Sample> read_all(const std::string& shard) {
  auto ds = Dataset::open(std::vector<std::string>{shard});
  EXPECT_TRUE(ds) << ds.error().message;
  std::vector<Dataset::Sample> out;
  if (!ds) return out;
  for (std::uint64_t i = 0; i < (*ds)->size(); ++i) {
    auto s = (*ds)->read(i);
    EXPECT_TRUE(s) << s.error().message;
    if (s) out.push_back(*s);
  }
  return out;
}

bool same_samples(const std::vector<Dataset::Sample>& a, const std::vector<Dataset::Sample>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].key != b[i].key || a[i].fields != b[i].fields) return false;
  return true;
}

// Overwrites a file of the same size in place: truncating it first (as an
// ofstream does) makes ext4 flush it, 10 ms apiece, thousands of times here.
void overwrite(const std::string& path, const std::string& bytes) {
  std::fstream(path, std::ios::in | std::ios::out | std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

TEST(IndexCrafted, EveryBitFlipIsDetectedAndRebuilt) {
  TempDir d("pacer-flip-");
  const std::string shard = make_shard(d, "a.tar", 3);
  const auto truth = read_all(shard);
  ASSERT_EQ(truth.size(), 3u);
  const std::string good = slurp(index_path(shard));
  std::size_t silent = 0, wrong = 0;
  for (std::size_t bit = 0; bit < good.size() * 8; ++bit) {
    std::string flipped = good;
    flipped[bit / 8] = static_cast<char>(flipped[bit / 8] ^ (1 << (bit % 8)));
    overwrite(index_path(shard), flipped);
    if (read_index(shard, false)) ++silent;
    // Through a dataset: the flip is found and the index rebuilt, so reads
    // return the truth. (A sample of the bits: each rebuild fsyncs.)
    if (bit % 29) continue;
    if (!same_samples(read_all(shard), truth)) ++wrong;
    EXPECT_EQ(without_hash_time(slurp(index_path(shard))), without_hash_time(good)) << "bit " << bit << ": the index was not rebuilt";
  }
  EXPECT_EQ(silent, 0u) << "of " << good.size() * 8 << " flips";
  EXPECT_EQ(wrong, 0u) << "of " << good.size() * 8 << " flips";
}

TEST(IndexCrafted, FieldsPastTheShardOrWrappingAreRejected) {
  TempDir d("pacer-flip-");
  const std::string shard = make_shard(d, "a.tar", 2);
  const auto truth = read_all(shard);
  const std::string good = slurp(index_path(shard));
  // Sample 0: u16 key length, key "s/000000", u16 field count, u16 ext length, "txt", u64 offset, u64 size.
  const std::size_t at_offset = 96 + 2 + 8 + 2 + 2 + 3;
  const std::uint64_t shard_bytes = fs::file_size(shard);
  const std::vector<std::pair<std::uint64_t, std::uint64_t>> cases = {
      {~std::uint64_t{0} - 15, 32},           // offset + size wraps past 2^64
      {512, ~std::uint64_t{0} - 100},         // so does this one
      {shard_bytes - 4, 8},                   // ends past the shard
      {0, 4},                                 // no header block in front
  };
  for (const auto& [offset, size] : cases) {
    std::string bad = good;
    std::memcpy(bad.data() + at_offset, &offset, 8);
    std::memcpy(bad.data() + at_offset + 8, &size, 8);
    reseal(bad);
    write_bytes(index_path(shard), bad);
    auto r = read_index(shard, false);
    ASSERT_FALSE(r) << offset << "+" << size;
    EXPECT_TRUE(contains(r.error().message, index_path(shard)));
    EXPECT_TRUE(contains(r.error().message, "outside")) << r.error().message;
    write_bytes(index_path(shard), bad);
    EXPECT_TRUE(same_samples(read_all(shard), truth)) << offset << "+" << size;
  }
}

// A same-size rewrite: five 100-byte samples become three of 600 bytes (one
// block more each), so the byte count is equal and every offset moves.
std::string rewrite_same_size(const TempDir& d, const std::string& name, bool shifted) {
  RawTar raw;
  if (!shifted) {
    for (int i = 0; i < 6; ++i) raw.add(fmt::format("k{}.txt", i), std::string(100, static_cast<char>('a' + i)));
  } else {
    for (int i = 0; i < 4; ++i) raw.add(fmt::format("other{}.bin", i), std::string(600, static_cast<char>('A' + i)));
  }
  return d.file(name, raw.finish());
}

void set_mtime(const std::string& path, std::int64_t sec) {
  struct timespec ts[2] = {{sec, 0}, {sec, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), ts, 0), 0);
}

TEST(IndexCrafted, ShardRewrittenWithTheSameSizeIsDetected) {
  for (bool keep_mtime : {true, false}) {
    TempDir d("pacer-stale-");
    const std::string shard = rewrite_same_size(d, "s.tar", false);
    set_mtime(shard, 1'700'000'000);
    ASSERT_TRUE(build_index(shard));
    const std::uint64_t size = fs::file_size(shard);
    rewrite_same_size(d, "s.tar", true);
    ASSERT_EQ(fs::file_size(shard), size);
    // Same size and (with keep_mtime) the same mtime: only the member headers tell.
    set_mtime(shard, keep_mtime ? 1'700'000'000 : 1'700'000'100);
    auto stale = read_index(shard, false);
    ASSERT_FALSE(stale) << keep_mtime;
    EXPECT_TRUE(contains(stale.error().message, shard));
    EXPECT_TRUE(contains(stale.error().message, "rewritten")) << stale.error().message;
    if (!keep_mtime) {
      EXPECT_FALSE(read_index(shard, true)) << "a moved mtime checks the headers at open";
    } else {
      // Size and mtime match, so opening trusts the stale count (6); the
      // first read checks the headers, rebuilds the index and refuses to go
      // on with the numbering of the old shard.
      auto ds = Dataset::open(std::vector<std::string>{shard});
      ASSERT_TRUE(ds) << ds.error().message;
      auto r = (*ds)->read(0);
      ASSERT_FALSE(r);
      EXPECT_TRUE(contains(r.error().message, shard));
      EXPECT_TRUE(contains(r.error().message, "changed since the dataset was opened")) << r.error().message;
    }
    const auto got = read_all(shard);
    ASSERT_EQ(got.size(), 4u) << keep_mtime;
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(got[i].key, fmt::format("other{}", i));
      ASSERT_EQ(got[i].fields.size(), 1u);
      EXPECT_EQ(got[i].fields[0].second, std::string(600, static_cast<char>('A' + i)));
    }
    EXPECT_TRUE(read_index(shard, false)) << "rebuilt in place";
  }
}

TEST(IndexCrafted, ARewriteOfOnlyPaxOrLongNameRecordsIsDetected) {
  // Same size, same mtime, the same ustar headers in front of the data: only
  // the records before them differ (a member renamed through its pax path,
  // resized through its pax size, or renamed through its GNU long name).
  TempDir d("pacer-pax-rewrite-");
  const std::string long_a = "L/" + std::string(120, 'a'), long_b = "L/" + std::string(120, 'b');
  auto shard_with = [&](const std::string& pax_path, const std::string& pax_size, const std::string& long_name) {
    RawTar raw;
    raw.pax({{"path", pax_path}, {"size", pax_size}});
    raw.add("placeholder", "12345");
    raw.add("././@LongLink", long_name + ".txt", 'L');
    raw.add("truncated", "xyz");
    return raw.finish();
  };
  const std::string shard = d.file("s.tar", shard_with("p/AAAA.txt", "5", long_a));
  for (const std::string& rewritten : {shard_with("p/BBBB.txt", "5", long_a), shard_with("p/AAAA.txt", "3", long_a), shard_with("p/AAAA.txt", "5", long_b)}) {
    write_bytes(shard, shard_with("p/AAAA.txt", "5", long_a));
    set_mtime(shard, 1'700'000'000);
    ASSERT_TRUE(build_index(shard));
    ASSERT_EQ(rewritten.size(), fs::file_size(shard));
    write_bytes(shard, rewritten);
    set_mtime(shard, 1'700'000'000);
    auto stale = read_index(shard, false);
    ASSERT_FALSE(stale);
    EXPECT_TRUE(contains(stale.error().message, "rewritten")) << stale.error().message;
    auto fresh = load_or_build_index(shard, false);
    ASSERT_TRUE(fresh) << fresh.error().message;
    EXPECT_EQ(fresh->entries.size(), 2u);
  }
}

TEST(IndexCrafted, ShardCopiedWithANewMtimeKeepsItsIndex) {
  TempDir d("pacer-stale-");
  const std::string shard = make_shard(d, "a.tar", 4);
  set_mtime(shard, 1'700'000'000);
  ASSERT_TRUE(build_index(shard));
  set_mtime(shard, 1'800'000'000);  // as `cp` without -p leaves it
  auto idx = load_or_build_index(shard, true);
  ASSERT_TRUE(idx) << idx.error().message;
  EXPECT_EQ(idx->samples, 4u);
  // The index was refreshed to the new mtime, so the next header-only open checks nothing more.
  std::int64_t stored = 0;
  const std::string bin = slurp(index_path(shard));
  std::memcpy(&stored, bin.data() + 32, 8);
  EXPECT_EQ(stored, 1'800'000'000LL * 1'000'000'000);
  EXPECT_TRUE(read_index(shard, false));
}

// The shard's change time as fstat gives it, in nanoseconds.
std::int64_t ctime_ns(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return static_cast<std::int64_t>(st.st_ctim.tv_sec) * 1'000'000'000 + st.st_ctim.tv_nsec;
}

// Sets the mtime again until the change time moved: kernels before 6.13 keep
// timestamps to a clock tick, so a change right after another may keep it.
void touch_until_changed(const std::string& path, std::int64_t mtime_s, std::int64_t old_ctime) {
  for (int i = 0; i < 100 && ctime_ns(path) == old_ctime; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    set_mtime(path, mtime_s);
  }
  ASSERT_NE(ctime_ns(path), old_ctime) << path;
}

// The skip needs the index written 2 s after the shard's last change (the
// index's own change time, on the file system's clock): the shards of these
// tests are made, then left 2.1 s, then indexed.
void settle() { std::this_thread::sleep_for(std::chrono::milliseconds(2100)); }

// The member headers are hashed again only when the shard's inode or change
// time moved since they last matched, or the change was still settling then;
// the fields' layout is checked either way.
TEST(IndexCrafted, AnUnchangedShardSkipsTheHeaderHash) {
  TempDir d("pacer-bound-");
  const std::string shard = make_shard(d, "a.tar", 4);
  settle();
  ASSERT_TRUE(build_index(shard));
  struct stat st {};
  ASSERT_EQ(::stat(shard.c_str(), &st), 0);
  const std::string bin = slurp(index_path(shard));
  std::uint64_t ino = 0;
  std::int64_t ctime = 0;
  std::memcpy(&ino, bin.data() + 56, 8);
  std::memcpy(&ctime, bin.data() + 64, 8);
  EXPECT_EQ(ino, static_cast<std::uint64_t>(st.st_ino));
  EXPECT_EQ(ctime, ctime_ns(shard));
  struct Case {
    std::int64_t after_ns;
    bool skipped;
  };
  for (const Case c : {Case{3'000'000'000, true}, Case{2'000'000'000, true}, Case{1'999'999'999, false}, Case{0, false},
                       Case{INT64_MIN, false}}) {
    ASSERT_TRUE(build_index(shard));
    hashed_after_change(shard, c.after_ns);
    break_headers_hash(shard);
    auto r = read_index(shard, false);
    EXPECT_EQ(static_cast<bool>(r), c.skipped) << c.after_ns;
    if (r) {
      EXPECT_EQ(r->entries.size(), 4u);
    } else {
      EXPECT_TRUE(contains(r.error().message, "rewritten")) << r.error().message;
    }
  }
  // Fields that overlap are refused without the hash too: sample 0's second
  // field moved onto its first.
  ASSERT_TRUE(build_index(shard));
  hashed_after_change(shard, 3'000'000'000);
  std::string crafted = slurp(index_path(shard));
  std::size_t pos = 96;
  auto u16 = [&](std::size_t at) {
    std::uint16_t v = 0;
    std::memcpy(&v, crafted.data() + at, 2);
    return v;
  };
  pos += 2 + u16(pos);          // key
  pos += 2;                     // field count
  pos += 2 + u16(pos);          // field 0's extension
  const std::size_t first_offset = pos;
  pos += 16;                    // its offset and size
  pos += 2 + u16(pos);          // field 1's extension
  std::memcpy(crafted.data() + pos, crafted.data() + first_offset, 8);
  reseal(crafted);
  write_bytes(index_path(shard), crafted);
  auto overlapping = read_index(shard, false);
  ASSERT_FALSE(overlapping);
  EXPECT_TRUE(contains(overlapping.error().message, "overlaps another member")) << overlapping.error().message;
  EXPECT_TRUE(contains(overlapping.error().message, shard)) << overlapping.error().message;
}

// An index built long after its shard was written skips the hash; a rewrite
// in place that keeps size and mtime sets the change time, so it is hashed
// and caught; a file renamed over the shard is another inode.
TEST(IndexCrafted, ARewriteAfterTheHashIsCaughtByTheChangeTime) {
  TempDir d("pacer-bound-");
  const std::string in_place = rewrite_same_size(d, "a.tar", false);
  const std::string renamed = rewrite_same_size(d, "b.tar", false);
  const std::string shifted = slurp(rewrite_same_size(d, "shifted.tar", true));
  write_bytes(renamed + ".new", shifted);
  for (const auto& f : {in_place, renamed, renamed + ".new"}) set_mtime(f, 1'700'000'000);
  settle();
  ASSERT_TRUE(build_index(in_place));
  ASSERT_TRUE(read_index(in_place, false));
  const std::int64_t before = ctime_ns(in_place);
  overwrite(in_place, shifted);
  ASSERT_EQ(fs::file_size(in_place), shifted.size());
  set_mtime(in_place, 1'700'000'000);
  touch_until_changed(in_place, 1'700'000'000, before);
  auto stale = read_index(in_place, false);
  ASSERT_FALSE(stale);
  EXPECT_TRUE(contains(stale.error().message, "rewritten")) << stale.error().message;

  ASSERT_TRUE(build_index(renamed));
  break_headers_hash(renamed);
  ASSERT_TRUE(read_index(renamed, false)) << "same inode, hash skipped";
  fs::rename(renamed + ".new", renamed);
  EXPECT_FALSE(read_index(renamed, false)) << "another inode: hashed";
}

// A shard whose change was still settling when it was indexed is hashed at
// the next read, and once settled the index is rebound (written back), after
// which reads skip the hash.
TEST(IndexCrafted, AnIndexOfASettlingShardIsReboundLater) {
  TempDir d("pacer-bound-");
  const std::string shard = make_shard(d, "a.tar", 3);
  ASSERT_TRUE(build_index(shard));
  const std::string first = slurp(index_path(shard));
  settle();
  auto idx = load_or_build_index(shard, false);
  ASSERT_TRUE(idx) << idx.error().message;
  const std::string second = slurp(index_path(shard));
  EXPECT_NE(first, second) << "rebound";
  EXPECT_EQ(without_hash_time(first), without_hash_time(second));
  break_headers_hash(shard);
  EXPECT_TRUE(read_index(shard, false)) << "the rebound index skips the hash";
}

// A version 4 index (64-byte header) is read, its headers hashed, and
// written back as version 5.
TEST(IndexCrafted, AVersion4IndexIsReadAndRewrittenAsVersion5) {
  TempDir d("pacer-v4-");
  const std::string shard = make_shard(d, "a.tar", 5);
  ASSERT_TRUE(build_index(shard));
  const std::string v5 = slurp(index_path(shard));
  // Version 4's header checksum covers bytes 0-55 and sits at 56.
  auto seal_v4 = [](std::string& idx) {
    const std::uint64_t self = XXH3_64bits(idx.data(), 56);
    std::memcpy(idx.data() + 56, &self, 8);
  };
  std::string v4 = v5.substr(0, 56) + std::string(8, '\0') + v5.substr(96);
  const std::uint32_t four = 4;
  std::memcpy(v4.data() + 8, &four, 4);
  seal_v4(v4);
  write_bytes(index_path(shard), v4);
  auto head = read_index(shard, true);
  ASSERT_TRUE(head) << head.error().message;
  EXPECT_EQ(head->samples, 5u);
  auto full = read_index(shard, false);
  ASSERT_TRUE(full) << full.error().message;
  EXPECT_EQ(full->entries.size(), 5u);
  struct stat st {};
  ASSERT_EQ(::stat(shard.c_str(), &st), 0);
  EXPECT_EQ(full->shard_ino, static_cast<std::uint64_t>(st.st_ino)) << "hashed, and bound to the shard to be written back";
  // A version 4 index whose headers no longer match is refused like any.
  std::string bad = v4;
  bad[40] = static_cast<char>(bad[40] ^ 1);
  seal_v4(bad);
  write_bytes(index_path(shard), bad);
  EXPECT_FALSE(read_index(shard, false));
  write_bytes(index_path(shard), v4);
  ASSERT_TRUE(load_or_build_index(shard, false));
  const std::string back = slurp(index_path(shard));
  std::uint32_t version = 0;
  std::memcpy(&version, back.data() + 8, 4);
  EXPECT_EQ(version, 5u);
  EXPECT_EQ(without_hash_time(back).substr(96), v5.substr(96));
}

TEST(IndexCrafted, StaleIndexOnAReadOnlyDatasetIsAnErrorNamingTheShard) {
  Tmpfs t;
  PACER_MOUNT_TMPFS_OR_SKIP(t);
  const std::string& mnt = t.mnt;
  TempDir src("pacer-ro-src-");
  const std::string old_shard = rewrite_same_size(src, "old.tar", false);
  const std::string new_shard = rewrite_same_size(src, "new.tar", true);
  const std::string shard = mnt + "/s.tar";
  fs::copy_file(old_shard, shard);
  set_mtime(shard, 1'700'000'000);
  ASSERT_TRUE(build_index(shard));
  fs::copy_file(new_shard, shard, fs::copy_options::overwrite_existing);
  set_mtime(shard, 1'700'000'100);
  ASSERT_TRUE(t.read_only()) << std::strerror(errno);
  auto ds = Dataset::open(std::vector<std::string>{shard});
  ASSERT_FALSE(ds) << "a stale index that cannot be replaced is not worked around";
  EXPECT_TRUE(contains(ds.error().message, shard));
  EXPECT_TRUE(contains(ds.error().message, "rebuild it with pacer shard index")) << ds.error().message;
}

TEST(SpecCrafted, ExpansionsAreBoundedBeforeExpanding) {
  for (const std::string spec : {"x-{0..18446744073709551615}.tar", "x-{-99999999999999999999..0}.tar"}) {
    auto r = expand_shard_spec(spec);
    ASSERT_FALSE(r) << spec;
    EXPECT_EQ(r.error().kind, ErrorKind::kUsage);
    EXPECT_TRUE(contains(r.error().message, "does not fit 64 bits")) << r.error().message;
  }
  for (const std::string spec : {"x-{0..9223372036854775807}.tar", "x-{-9223372036854775808..9223372036854775807}.tar", "x-{0..1000}{0..999}.tar", "x-{a,b{0..999999}}.tar",
                                 "{0..99}{0..99}{0..99}{0..99}{0..99}{0..99}{0..99}{0..99}{0..99}{0..99}"}) {
    auto r = expand_shard_spec(spec);
    ASSERT_FALSE(r) << spec;
    EXPECT_EQ(r.error().kind, ErrorKind::kUsage);
    EXPECT_TRUE(contains(r.error().message, "more than 1000000 names")) << r.error().message;
  }
  // A range ending at the largest value still ends.
  auto top = expand_shard_spec("x-{9223372036854775806..9223372036854775807}.tar");
  ASSERT_TRUE(top) << top.error().message;
  EXPECT_EQ(*top, (std::vector<std::string>{"x-9223372036854775806.tar", "x-9223372036854775807.tar"}));
  auto neg = expand_shard_spec("x-{-1..1}.tar");
  ASSERT_TRUE(neg) << neg.error().message;
  EXPECT_EQ(neg->size(), 3u);
}

TEST(SpecCrafted, DeepNestingIsRefusedBeforeExpanding) {
  // Each level of groups copies the rest of the spec: 20,000 levels took 800 MB, 40,000 the stack.
  const std::string deep = std::string(40, '{') + "a,b" + std::string(40, '}');
  auto r = expand_shard_spec(deep);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().kind, ErrorKind::kUsage);
  EXPECT_TRUE(contains(r.error().message, "nest deeper than 32")) << r.error().message;
  auto ok = expand_shard_spec(std::string(32, '{') + "a,b" + std::string(32, '}'));
  ASSERT_TRUE(ok) << ok.error().message;
  EXPECT_EQ(*ok, (std::vector<std::string>{"a", "b"}));
}

TEST(DatasetOpen, APathWithANulByteIsRefusedAndTheShardKept) {
  // The kernel stops at the NUL: "s.tar\0x" + ".pidx" would name s.tar itself,
  // and the index built for it would be renamed over the shard.
  Shards sh({3});
  const std::string shard = sh.paths[0];
  fs::remove(index_path(shard));
  const std::string before = slurp(shard);
  const std::string nul = shard + std::string(1, '\0') + "x";
  auto ds = Dataset::open(std::vector<std::string>{nul});
  ASSERT_FALSE(ds);
  EXPECT_EQ(ds.error().kind, ErrorKind::kUsage);
  EXPECT_TRUE(contains(ds.error().message, "NUL byte")) << ds.error().message;
  EXPECT_TRUE(contains(ds.error().message, "\\0x")) << ds.error().message;
  EXPECT_FALSE(Dataset::open(nul));
  EXPECT_FALSE(build_index(nul));
  // A manifest naming such a path is refused, naming the manifest.
  const std::string manifest = sh.dir.file("manifest.json", std::string(R"({"schema": "pacer.shards/1", "shards": [{"path": "shard-000.tar\u0000x"}]})"));
  auto m = Dataset::open(manifest);
  ASSERT_FALSE(m);
  EXPECT_TRUE(contains(m.error().message, manifest)) << m.error().message;
  EXPECT_EQ(slurp(shard), before);
  EXPECT_FALSE(fs::exists(index_path(shard)));
}

TEST(DatasetRead, AShardReplacedAfterItsScanIsReadThroughItsNewIndex) {
  // Opened without an index, the shard's scan is kept; a shard replaced
  // before its first read must not be read at the scan's offsets.
  TempDir dir("pacer-replaced-");
  const std::string shard = make_shard(dir, "s.tar", 4, 0);
  auto replace = [&](int n, int first) {
    std::map<std::string, std::string> texts;
    RawTar raw;
    for (int i = first; i < first + n; ++i) {
      const std::string key = fmt::format("r/{:06d}", i);
      texts[key] = std::string(600 + static_cast<std::size_t>(i), static_cast<char>('a' + i % 26));  // two blocks: another size
      raw.add(key + ".txt", texts[key]);
    }
    const std::string tmp = dir.file("replacement.tar", raw.finish());
    fs::rename(tmp, shard);
    return texts;
  };
  fs::remove(index_path(shard));
  auto ds = Dataset::open(std::vector<std::string>{shard});
  ASSERT_TRUE(ds) << ds.error().message;
  fs::remove(index_path(shard));  // as if the index could not be written
  auto texts = replace(4, 100);
  for (std::uint64_t i = 0; i < 4; ++i) {
    auto s = (*ds)->read(i);
    ASSERT_TRUE(s) << s.error().message;
    const std::string key = fmt::format("r/{:06d}", 100 + i);
    EXPECT_EQ(s->key, key);
    EXPECT_EQ(s->fields, (std::vector<std::pair<std::string, std::string>>{{"txt", texts[key]}}));
  }
  // Another sample count cannot be read as the dataset opened: an error naming the shard.
  fs::remove(index_path(shard));
  auto ds2 = Dataset::open(std::vector<std::string>{shard});
  ASSERT_TRUE(ds2) << ds2.error().message;
  replace(2, 200);
  auto s = (*ds2)->read(0);
  ASSERT_FALSE(s);
  EXPECT_TRUE(contains(s.error().message, shard)) << s.error().message;
  EXPECT_TRUE(contains(s.error().message, "changed since the dataset was opened")) << s.error().message;
}

TEST(TarCrafted, LinkNamesAndGlobalHeadersKeepThePendingNameAndOldDirectoriesAreNotSamples) {
  TempDir dir("pacer-tar-records-");
  const std::string long_key = "k/" + std::string(150, 'l');
  RawTar raw;
  // A GNU long name, then a long link name ('K'), then the member: the long name is the member's.
  raw.add("././@LongLink", long_key + ".txt", 'L');
  raw.add("././@LongLink", "some/link/target", 'K');
  raw.add("truncated-name.txt", "one");
  // A pax path, then a global pax header ('g'), then the member: the pax path is the member's.
  raw.pax({{"path", "p/000002.txt"}});
  raw.add("PaxHeaders/global", "20 comment=anything\n", 'g');
  raw.add("placeholder.txt", "two");
  // A pre-POSIX directory: a regular-file type with a trailing slash.
  raw.add("olddir/", "", '0');
  raw.add("olddir/x.txt", "three");
  const std::string tar = dir.file("records.tar", raw.finish());
  auto ms = scan_tar(tar);
  ASSERT_TRUE(ms) << ms.error().message;
  EXPECT_EQ(names_of(*ms), (std::vector<std::string>{long_key + ".txt", "p/000002.txt", "olddir/x.txt"}));
  auto ds = Dataset::open(tar);
  ASSERT_TRUE(ds) << ds.error().message;
  ASSERT_EQ((*ds)->size(), 3u);
  EXPECT_EQ((*ds)->read(0).value().key, long_key);
  EXPECT_EQ((*ds)->read(1).value().fields, (std::vector<std::pair<std::string, std::string>>{{"txt", "two"}}));
}

}  // namespace
}  // namespace pacer::data
