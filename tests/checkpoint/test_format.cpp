// The checkpoint format: names, dtypes, manifests and their self-checksum, retention arithmetic, intervals.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cmath>

#include "checkpoint/ckpt_internal.hpp"
#include "pacer/checkpoint.hpp"
#include "test_util.hpp"

namespace pacer::ckpt {
namespace {

using test::contains;

BlobInfo shard(std::uint64_t off, std::uint64_t size, std::uint64_t global) {
  BlobInfo b;
  b.name = "w";
  b.dtype = "float32";
  b.size = size;
  b.shape = {static_cast<std::int64_t>(size / 4)};
  b.layout = Layout::kShard;
  b.shard_offset = off;
  b.global_size = global;
  b.global_shape = {static_cast<std::int64_t>(global / 4)};
  return b;
}

// What the checksums cannot see: pieces that each check but do not fit
// together, and shapes a loader would allocate from.
TEST(CkptFormat, LayoutCheckRejectsPiecesThatDoNotFitTogether) {
  Manifest m;
  m.blobs = {shard(0, 800, 1600), shard(800, 800, 1600)};
  EXPECT_TRUE(check_layout(m, true, "M"));
  m.blobs = {shard(0, 800, 1600), shard(400, 800, 1600)};  // an overlap the size of the gap it hides
  auto st = check_layout(m, true, "M");
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.error().message, "blob 'w': shards overlap at byte 400")) << st.error().message;
  m.blobs = {shard(0, 800, 1600)};
  EXPECT_TRUE(check_layout(m, false, "M")) << "one node's share need not cover the blob";
  st = check_layout(m, true, "M");
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.error().message, "no shard holds bytes 800..1600")) << st.error().message;
  m.blobs = {shard(UINT64_MAX - 10, 800, 1600)};
  EXPECT_FALSE(check_layout(m, false, "M")) << "an offset that overflows";
  m.blobs = {shard(0, 800, 1600)};
  m.blobs[0].global_shape = {1 << 30, 1 << 30};  // a loader would allocate 4 EiB
  EXPECT_FALSE(check_layout(m, false, "M"));
  BlobInfo r;
  r.name = "x";
  r.dtype = "float32";
  r.size = 16;
  r.shape = {4};
  m.blobs = {r};
  EXPECT_TRUE(check_layout(m, true, "M"));
  m.blobs[0].shape = {400000000000};
  EXPECT_FALSE(check_layout(m, true, "M"));
  m.blobs = {r, r};
  EXPECT_FALSE(check_layout(m, true, "M")) << "a replicated blob stored twice";
}

TEST(CkptFormat, StepDirNamesRoundTripAndSortLexically) {
  EXPECT_EQ(step_dir_name(42), "step-000000000042");
  EXPECT_EQ(parse_step_dir_name("step-000000000042"), 42u);
  EXPECT_FALSE(parse_step_dir_name("step-"));
  EXPECT_FALSE(parse_step_dir_name("step-12x"));
  EXPECT_FALSE(parse_step_dir_name(".partial-step-000000000042-h-1-aa"));
  EXPECT_LT(step_dir_name(9), step_dir_name(10));
}

TEST(CkptFormat, TempNamesCarryStepHostAndPid) {
  const std::string n = temp_dir_name(7, "node-01.cluster", 4242);
  auto t = parse_temp_dir_name(n);
  ASSERT_TRUE(t) << n;
  EXPECT_EQ(t->step, 7u);
  EXPECT_EQ(t->host, "node-01.cluster");
  EXPECT_EQ(t->pid, 4242);
  EXPECT_NE(temp_dir_name(7, "h", 1), temp_dir_name(7, "h", 1)) << "two saves of one step must not share a temp dir";
  EXPECT_FALSE(parse_temp_dir_name("step-000000000007"));
}

TEST(CkptFormat, Dtypes) {
  EXPECT_EQ(dtype_size("float32"), 4u);
  EXPECT_EQ(dtype_size("bfloat16"), 2u);
  EXPECT_EQ(dtype_size("complex128"), 16u);
  EXPECT_EQ(dtype_size("bytes"), 1u);
  EXPECT_EQ(dtype_size("float8_e4m3fn"), 1u);  // torch's names, as pacer.Checkpointer writes them
  EXPECT_EQ(dtype_size("complex32"), 4u);
  EXPECT_FALSE(valid_dtype("float33"));
  EXPECT_FALSE(valid_dtype("object"));
}

Manifest sample() {
  Manifest m;
  m.step = 12;
  m.created_at = "2026-11-29T00:00:00Z";
  m.world_size = 2;
  m.chunk_bytes = 4096;
  m.meta = {{"lr", 0.5}, {"rng", {1, 2, 3}}};
  BlobInfo b;
  b.name = "w";
  b.file = "rank-00001.bin";
  b.rank = 1;
  b.offset = 8192;
  b.size = 5000;
  b.dtype = "float32";
  b.shape = {1250};
  b.layout = Layout::kShard;
  b.shard_offset = 5000;
  b.global_size = 10000;
  b.global_shape = {2500};
  b.chunk_hashes = {0x0123456789abcdefULL, 42};
  m.blobs.push_back(b);
  m.files = {{"rank-00001.bin", 13192}};
  return m;
}

TEST(CkptFormat, ManifestRoundTrips) {
  const Manifest m = sample();
  auto back = manifest_from_json(to_json(m).dump(), "MANIFEST.json");
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(back->step, 12u);
  EXPECT_EQ(back->world_size, 2);
  EXPECT_EQ(back->meta, m.meta);
  ASSERT_EQ(back->blobs.size(), 1u);
  const BlobInfo& b = back->blobs[0];
  EXPECT_EQ(b.layout, Layout::kShard);
  EXPECT_EQ(b.shard_offset, 5000u);
  EXPECT_EQ(b.global_shape, std::vector<std::int64_t>{2500});
  EXPECT_EQ(b.chunk_hashes, m.blobs[0].chunk_hashes);
  EXPECT_EQ(back->files, m.files);
}

TEST(CkptFormat, ManifestRejectsEditsTornTextAndWrongSchema) {
  nlohmann::json j = to_json(sample());
  j["step"] = 13;  // an edit without re-checksumming
  auto edited = manifest_from_json(j.dump(), "dir/MANIFEST.json");
  ASSERT_FALSE(edited);
  EXPECT_TRUE(contains(edited.error().message, "dir/MANIFEST.json"));
  EXPECT_TRUE(contains(edited.error().message, "checksum"));

  const std::string full = to_json(sample()).dump();
  auto torn = manifest_from_json(full.substr(0, full.size() / 2), "M");
  ASSERT_FALSE(torn);
  EXPECT_TRUE(contains(torn.error().message, "not valid JSON"));

  nlohmann::json other = {{"schema", "something/1"}};
  EXPECT_FALSE(manifest_from_json(other.dump(), "M"));
}

TEST(CkptFormat, ManifestRejectsWrongChunkCount) {
  Manifest m = sample();
  m.blobs[0].chunk_hashes.push_back(7);  // 5000 bytes in 4096-byte chunks is 2 chunks, not 3
  auto r = manifest_from_json(to_json(m).dump(), "M");
  ASSERT_FALSE(r);
  EXPECT_TRUE(contains(r.error().message, "'w'"));
}

// The manifest's self-checksum made right after an edit, as a crafted manifest would have it.
std::string rechecksummed(nlohmann::json j) {
  j.erase("manifest_xxh3");
  const std::string body = j.dump();
  j["manifest_xxh3"] = fmt::format("{:016x}", XXH3_64bits(body.data(), body.size()));
  return j.dump();
}

// Found by tests/fuzz/manifest.cpp: a size of 2.5e59 was cast to uint64, undefined behaviour; a
// negative offset wrapped to a huge one.
TEST(CkptFormat, ManifestNumbersMustBeNonNegativeIntegers) {
  const nlohmann::json good = to_json(sample());
  ASSERT_TRUE(manifest_from_json(rechecksummed(good), "M"));
  for (const char* where : {"/files/0/size", "/blobs/0/offset", "/step", "/world_size", "/blobs/0/shape/0"}) {
    for (const nlohmann::json& value : {nlohmann::json(2.5e59), nlohmann::json(-1), nlohmann::json(1.0)}) {
      nlohmann::json j = good;
      j[nlohmann::json::json_pointer(where)] = value;
      auto r = manifest_from_json(rechecksummed(j), "dir/MANIFEST.json");
      ASSERT_FALSE(r) << where << " = " << value;
      EXPECT_EQ(r.error().kind, ErrorKind::kConfig);
      EXPECT_TRUE(contains(r.error().message, "dir/MANIFEST.json")) << r.error().message;
      EXPECT_TRUE(contains(r.error().message, where)) << r.error().message;
    }
  }
  // The user's meta may hold any number.
  nlohmann::json j = good;
  j["meta"]["lr"] = -2.5e59;
  EXPECT_TRUE(manifest_from_json(rechecksummed(j), "M"));
}

TEST(CkptRetention, KeepsNewestLastNAndMultiples) {
  const std::vector<std::uint64_t> desc = {100, 90, 80, 70, 60, 50, 40};
  EXPECT_EQ(retention_victims(desc, 3, 0), (std::vector<std::uint64_t>{70, 60, 50, 40}));
  EXPECT_EQ(retention_victims(desc, 2, 20), (std::vector<std::uint64_t>{70, 50}));
  EXPECT_TRUE(retention_victims(desc, 0, 0).empty()) << "keep_last 0 keeps everything";
  EXPECT_EQ(retention_victims({5}, 1, 0), std::vector<std::uint64_t>{});
  // The newest always stays, even with keep_last 1 and a keep_every that misses it.
  EXPECT_EQ(retention_victims({7, 6, 4}, 1, 4), (std::vector<std::uint64_t>{6}));
}

TEST(CkptInterval, YoungAndDaly) {
  // Young: sqrt(2 * 60 * 36000) = 2078.46 s.
  EXPECT_NEAR(young_interval(60, 36000), 2078.46, 0.01);
  const double x = 60.0 / (2 * 36000);
  EXPECT_NEAR(optimal_interval(60, 36000), std::sqrt(2 * 60 * 36000.0) * (1 + std::sqrt(x) / 3 + x / 9) - 60, 1e-9);
  EXPECT_LT(optimal_interval(60, 36000), young_interval(60, 36000));
  EXPECT_DOUBLE_EQ(optimal_interval(100, 40), 40) << "a save longer than 2 MTBF: checkpoint every MTBF";
  EXPECT_EQ(optimal_interval(0, 100), 0);
  EXPECT_LT(optimal_interval(10, 3600), optimal_interval(10, 7200));
  EXPECT_LT(optimal_interval(10, 3600), optimal_interval(20, 3600));
}

}  // namespace
}  // namespace pacer::ckpt
