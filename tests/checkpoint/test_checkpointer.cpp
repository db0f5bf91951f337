// Checkpointer behaviour: round trips, validation, tiers, retention and collective commits across ranks.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <chrono>
#include <thread>

#include "blobs.hpp"
#include "pacer/checkpoint.hpp"
#include "pacer/core/host_buffer.hpp"
#include "blob_data.hpp"
#include "test_util.hpp"
#include "thread_comm.hpp"

namespace pacer::ckpt {
namespace {

namespace fs = std::filesystem;
using test::contains;
using test::flip_byte;
using test::pattern;
using test::TempDir;

using test_blobs::read_all;
using test_blobs::small_options;
using test_blobs::view;

TEST(Checkpointer, SavesAndReadsBackEveryByte) {
  TempDir dir("pacer-ckpt-");
  auto ck = Checkpointer::open(small_options(dir.path() + "/root")).value();
  const auto a = pattern(10000, 1);   // three chunks, last one partial
  const auto b = pattern(4096 * 2, 2);
  const auto c = pattern(0, 3);
  auto h = ck->save(5, {view("a", a, "float32", {2500}), view("b", b), view("empty", c, "int64", {0})}, {{"lr", 0.25}});
  ASSERT_TRUE(h) << h.error().message;
  ASSERT_TRUE(h->wait());
  EXPECT_TRUE(h->done());
  EXPECT_EQ(ck->latest(), 5u);

  auto r = ck->open_reader(std::nullopt);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->manifest().meta["lr"], 0.25);
  EXPECT_EQ(read_all(*r, "a", a.size()), a);
  EXPECT_EQ(read_all(*r, "b", b.size()), b);
  auto logical = r->logical_blobs();
  ASSERT_EQ(logical.size(), 3u);
  EXPECT_EQ(logical[0].dtype, "float32");
  EXPECT_EQ(logical[0].shape, std::vector<std::int64_t>{2500});
  // A byte range that starts and ends inside chunks.
  std::vector<unsigned char> part(5000);
  ASSERT_TRUE(r->read("a", part.data(), part.size(), 3000));
  EXPECT_TRUE(std::equal(part.begin(), part.end(), a.begin() + 3000));
  EXPECT_FALSE(r->read("a", part.data(), part.size(), 6000)) << "past the end";
  EXPECT_FALSE(r->read("nope", part.data(), 1));
  EXPECT_TRUE(r->verify_all());
}

TEST(Checkpointer, StatsCountSavesAndStaging) {
  TempDir dir("pacer-ckpt-");
  auto ck = Checkpointer::open(small_options(dir.path())).value();
  const auto a = pattern(10000, 1);
  ASSERT_TRUE(ck->save(1, {view("a", a)})->wait());
  ASSERT_TRUE(ck->save(2, {view("a", a), view("b", a)})->wait());
  EXPECT_FALSE(ck->save(2, {view("a", a)})) << "a rejected save is not counted";
  const auto s = ck->stats();
  EXPECT_EQ(s.saves, 2u);
  EXPECT_EQ(s.bytes_staged, 3 * a.size());
  EXPECT_GT(s.staging_bytes, 0u);
  EXPECT_LE(s.staging_bytes, 64u * 1024) << "never more than the staging budget";
  EXPECT_LE(s.pinned_bytes, s.staging_bytes);
  EXPECT_GT(s.blocked_s, 0);
}

// Blobs are packed into staging without gaps: a chunk that does not fit in
// what is left of a buffer continues in the next, checksummed piece by piece.
// Four 12 KiB blobs with 8 KiB buffers need at most 6 buffers (fewer when the
// writer frees some while the caller stages), not the 8 that starting every
// chunk in a buffer of its own takes when the writer lags.
TEST(Checkpointer, ChunksContinueAcrossStagingBuffers) {
  TempDir dir("pacer-ckpt-");
  Options o = small_options(dir.path());
  o.chunk_bytes = 8192;
  o.staging_bytes = 1 << 20;
  auto ck = Checkpointer::open(o).value();
  std::vector<std::vector<unsigned char>> data;
  for (unsigned k = 0; k < 4; ++k) data.push_back(pattern(12 * 1024, 20 + k));
  std::vector<BlobView> views;
  for (unsigned k = 0; k < 4; ++k) views.push_back(view("b" + std::to_string(k), data[k]));
  ASSERT_TRUE(ck->save(1, views)->wait());
  EXPECT_LE(ck->stats().staging_bytes, 6u * 8192);
  // Odd sizes, a small blob first so that every later chunk starts mid-buffer.
  const auto tiny = pattern(100, 30), big = pattern(3 * 8192 + 5, 31), mid = pattern(5000, 32);
  ASSERT_TRUE(ck->save(2, {view("tiny", tiny), view("big", big), view("mid", mid)})->wait());
  for (std::uint64_t step : {1u, 2u}) {
    auto r = ck->open_reader(step);
    ASSERT_TRUE(r) << r.error().message;  // every chunk checksum verified
  }
  auto r = ck->open_reader(2).value();
  EXPECT_EQ(read_all(r, "tiny", tiny.size()), tiny);
  EXPECT_EQ(read_all(r, "big", big.size()), big);
  EXPECT_EQ(read_all(r, "mid", mid.size()), mid);
  auto r1 = ck->open_reader(1).value();
  for (unsigned k = 0; k < 4; ++k) EXPECT_EQ(read_all(r1, "b" + std::to_string(k), data[k].size()), data[k]);
}

TEST(Checkpointer, CallerMayReuseBuffersOnceSaveReturns) {
  TempDir dir("pacer-ckpt-");
  auto ck = Checkpointer::open(small_options(dir.path())).value();
  auto data = pattern(200000, 9);  // larger than the staging budget: save() blocks until it is staged
  const auto expected = data;
  auto h = ck->save(1, {view("x", data)});
  ASSERT_TRUE(h);
  std::fill(data.begin(), data.end(), 0);
  ASSERT_TRUE(h->wait());
  auto r = ck->open_reader(1).value();
  EXPECT_EQ(read_all(r, "x", expected.size()), expected);
}

// reserve() makes the whole pool in the background: before the first save
// the staging memory is there, a save then allocates nothing more and never
// waits, and destroying a Checkpointer while it reserves neither hangs nor
// leaks (the reserving thread stops between buffers).
TEST(Checkpointer, ReserveMakesThePoolBeforeTheFirstSave) {
  TempDir dir("pacer-ckpt-");
  Options o = small_options(dir.path());
  o.staging_bytes = 16 * 4096;
  o.pin_staging = false;
  auto ck = Checkpointer::open(o).value();
  EXPECT_EQ(ck->stats().staging_bytes, 0u) << "nothing is allocated before a save or reserve()";
  ck->reserve();
  ck->reserve();  // a second call does nothing
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (ck->stats().staging_bytes < o.staging_bytes && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_EQ(ck->stats().staging_bytes, o.staging_bytes);
  const auto data = pattern(12 * 4096 + 7, 5);  // fits the pool
  ASSERT_TRUE(ck->save(1, {view("x", data)})->wait());
  EXPECT_EQ(ck->stats().staging_bytes, o.staging_bytes) << "the save used the reserved buffers";
  EXPECT_EQ(ck->stats().pool_waits, 0u);
  auto r = ck->open_reader(1).value();
  EXPECT_EQ(read_all(r, "x", data.size()), data);

  TempDir dir2("pacer-ckpt-");
  Options big = small_options(dir2.path());
  big.staging_bytes = std::uint64_t{1} << 30;  // far more than is made before the destructor runs
  big.chunk_bytes = 1 << 20;
  big.pin_staging = false;
  auto ck2 = Checkpointer::open(big).value();
  ck2->reserve();
  const auto t0 = std::chrono::steady_clock::now();
  ck2.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

// A checkpoint larger than the staging pool: with overflow allowed, save()
// copies the rest into ordinary memory instead of waiting for the writer to
// hand pool buffers back, takes no more than the pool plus the overflow,
// and later saves reuse that memory; without it, save() waits for the
// writer and never goes past the pool.
TEST(Checkpointer, OverflowStagesACheckpointLargerThanThePoolWithoutWaitingForTheDisk) {
  const auto data = pattern(40 * 4096 + 100, 41);  // 41 chunks of 4 KiB
  struct Case {
    std::uint64_t overflow;
    bool waits;
  };
  for (const Case c : {Case{0, true}, Case{64 * 4096, false}, Case{8 * 4096, true}}) {
    SCOPED_TRACE(c.overflow);
    TempDir dir("pacer-ckpt-");
    Options o = small_options(dir.path());
    o.staging_bytes = 2 * 4096;  // a pool of two chunks
    o.overflow_bytes = c.overflow;
    o.pin_staging = false;
    auto ck = Checkpointer::open(o).value();
    auto copy = data;
    auto h = ck->save(1, {view("x", copy)});
    ASSERT_TRUE(h) << h.error().message;
    std::fill(copy.begin(), copy.end(), 0);  // staged: the caller's buffer is free again
    const auto s = ck->stats();
    EXPECT_EQ(s.pool_waits > 0, c.waits);
    EXPECT_LE(s.overflow_bytes, c.overflow) << "never more than the overflow bound";
    EXPECT_LE(s.staging_bytes, o.staging_bytes + c.overflow);
    EXPECT_EQ(s.overflow_bytes > 0, c.overflow > 0);
    if (!c.waits) EXPECT_GE(s.staging_bytes, data.size()) << "everything staged at once";
    ASSERT_TRUE(h->wait());
    auto r = ck->open_reader(1).value();
    EXPECT_EQ(read_all(r, "x", data.size()), data);
    // The next save reuses the overflow buffers (handed back to the kernel lazily in between).
    ASSERT_TRUE(ck->save(2, {view("x", data)})->wait());
    EXPECT_EQ(ck->stats().staging_bytes, s.staging_bytes);
    auto r2 = ck->open_reader(2).value();
    EXPECT_EQ(read_all(r2, "x", data.size()), data);
  }
}

// What load() and the overflow staging do to memory: faulting a range in
// ahead of a read leaves its contents alone (also the bytes around it, on
// the same pages), and a buffer handed back lazily is written again as before.
TEST(Checkpointer, PrefaultKeepsContentsAndLazyReleaseKeepsTheBufferUsable) {
  HostBuffer b(1 << 20);
  ASSERT_TRUE(b);
  const auto data = pattern(b.size(), 51);
  std::memcpy(b.data(), data.data(), data.size());
  if (!prefault_for_write(b.data() + 5, 100000)) GTEST_SKIP() << "no MADV_POPULATE_WRITE (Linux < 5.14)";
  EXPECT_EQ(std::memcmp(b.data(), data.data(), data.size()), 0);
  HostBuffer fresh(3 << 20);
  ASSERT_TRUE(prefault_for_write(fresh.data(), fresh.size()));
  EXPECT_EQ(fresh.data()[fresh.size() - 1], 0) << "new memory stays zeroed";
  b.release_lazily();
  const auto again = pattern(b.size(), 52);
  std::memcpy(b.data(), again.data(), again.size());
  EXPECT_EQ(std::memcmp(b.data(), again.data(), again.size()), 0);
}

TEST(Checkpointer, RejectsBadSaves) {
  TempDir dir("pacer-ckpt-");
  auto ck = Checkpointer::open(small_options(dir.path())).value();
  const auto d = pattern(16, 1);
  auto dup = ck->save(1, {view("x", d), view("x", d)});
  ASSERT_FALSE(dup);
  EXPECT_TRUE(contains(dup.error().message, "'x' given twice"));
  auto dtype = ck->save(1, {view("x", d, "float33")});
  ASSERT_FALSE(dtype);
  EXPECT_TRUE(contains(dtype.error().message, "float33"));
  auto shape = ck->save(1, {view("x", d, "float32", {5})});
  ASSERT_FALSE(shape);
  EXPECT_TRUE(contains(shape.error().message, "20 bytes"));
  ASSERT_TRUE(ck->save(1, {view("x", d)})->wait());
  auto again = ck->save(1, {view("x", d)});
  ASSERT_FALSE(again);
  EXPECT_TRUE(contains(again.error().message, "already committed"));
  EXPECT_EQ(ck->options().root, dir.path());
  // Nothing of the rejected saves is left behind.
  for (const auto& e : list(dir.path(), false)) EXPECT_TRUE(e.committed) << e.path;
}

TEST(Checkpointer, RetentionKeepsLastNAndMultiples) {
  TempDir dir("pacer-ckpt-");
  Options o = small_options(dir.path());
  o.keep_last = 2;
  o.keep_every = 4;
  auto ck = Checkpointer::open(o).value();
  const auto d = pattern(100, 1);
  for (std::uint64_t s = 1; s <= 9; ++s) ASSERT_TRUE(ck->save(s, {view("x", d)})->wait());
  std::vector<std::uint64_t> steps;
  for (const auto& e : list(dir.path(), false)) steps.push_back(e.step);
  EXPECT_EQ(steps, (std::vector<std::uint64_t>{9, 8, 4}));
  auto pruned = prune(dir.path(), {.keep_last = 1}).value();
  EXPECT_EQ(pruned.removed, (std::vector<std::uint64_t>{8, 4}));
  EXPECT_EQ(pruned.newest_valid, std::optional<std::uint64_t>(9));
  EXPECT_EQ(list(dir.path(), false).size(), 1u);
}

TEST(Checkpointer, FastTierFlushesToPersistentAndIsPreferred) {
  TempDir dir("pacer-ckpt-");
  Options o = small_options(dir.path() + "/persistent");
  o.fast_tier = dir.path() + "/fast";
  o.keep_last = 2;
  auto ck = Checkpointer::open(o).value();
  const auto d1 = pattern(9000, 1);
  const auto d2 = pattern(9000, 2);
  auto h1 = ck->save(1, {view("x", d1)}).value();
  ASSERT_TRUE(h1.wait_persistent());
  auto h2 = ck->save(2, {view("x", d2)}).value();
  ASSERT_TRUE(h2.wait_persistent());
  for (const char* tier : {"/fast/", "/persistent/"})
    EXPECT_TRUE(fs::exists(dir.path() + tier + step_dir_name(2) + "/MANIFEST.json")) << tier;

  {
    auto r = ck->open_reader(std::nullopt).value();
    EXPECT_EQ(r.manifest().step, 2u);
    EXPECT_EQ(fs::path(r.dir()).parent_path(), fs::path(dir.path() + "/fast"));
  }
  {
    // A corrupt fast copy: the persistent copy of the same step is used.
    flip_byte(dir.path() + "/fast/" + step_dir_name(2) + "/rank-00000.bin", 100);
    auto r2 = ck->open_reader(std::nullopt).value();
    EXPECT_EQ(r2.manifest().step, 2u);
    EXPECT_EQ(fs::path(r2.dir()).parent_path(), fs::path(dir.path() + "/persistent"));
    EXPECT_EQ(read_all(r2, "x", d2.size()), d2);
  }

  // Retention ran on both tiers (the readers above are gone: a live Reader
  // keeps its step).
  for (std::uint64_t s = 3; s <= 5; ++s) ASSERT_TRUE(ck->save(s, {view("x", d1)})->wait_persistent());
  EXPECT_EQ(list(dir.path() + "/fast", false).size(), 2u);
  EXPECT_EQ(list(dir.path() + "/persistent", false).size(), 2u);
}

TEST(Checkpointer, FailedFlushKeepsTheFastCopy) {
  TempDir dir("pacer-ckpt-");
  Options o = small_options(dir.path() + "/persistent");
  o.fast_tier = dir.path() + "/fast";
  auto ck = Checkpointer::open(o).value();
  fs::remove_all(dir.path() + "/persistent");  // the shared file system went away
  const auto d = pattern(5000, 3);
  auto h = ck->save(7, {view("x", d)}).value();
  ASSERT_TRUE(h.wait()) << "committed on the fast tier";
  Status persisted = h.wait_persistent();
  ASSERT_FALSE(persisted);
  EXPECT_TRUE(contains(persisted.error().message, "persistent"));
  EXPECT_EQ(ck->latest(), 7u);
  EXPECT_TRUE(fs::exists(dir.path() + "/fast/" + step_dir_name(7)));
}

TEST(Checkpointer, OpenFailsOnAPathThatCannotBeADirectory) {
  TempDir dir("pacer-ckpt-");
  const std::string file = dir.file("not-a-dir", "x");
  auto ck = Checkpointer::open(small_options(file + "/root"));
  ASSERT_FALSE(ck);
  EXPECT_TRUE(contains(ck.error().message, file));
  Options bad = small_options(dir.path());
  bad.chunk_bytes = 10;
  EXPECT_FALSE(Checkpointer::open(bad));
}

TEST(Checkpointer, LeftoversOfDeadSaversAreRemovedOnOpen) {
  TempDir dir("pacer-ckpt-");
  // pid 1 is alive (init), a huge pid is not: only the dead saver's dir goes.
  const auto host = [] {
    char buf[256] = {};
    ::gethostname(buf, sizeof(buf) - 1);
    return std::string(buf);
  }();
  fs::create_directory(dir.path() + "/.partial-step-000000000003-" + host + "-1-0000abcd");
  fs::create_directory(dir.path() + "/.partial-step-000000000004-" + host + "-999999999-0000abcd");
  auto ck = Checkpointer::open(small_options(dir.path())).value();
  EXPECT_TRUE(fs::exists(dir.path() + "/.partial-step-000000000003-" + host + "-1-0000abcd"));
  EXPECT_FALSE(fs::exists(dir.path() + "/.partial-step-000000000004-" + host + "-999999999-0000abcd"));
  auto entries = list(dir.path(), false);
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_FALSE(entries[0].committed);
  EXPECT_TRUE(contains(entries[0].problem, "partial"));
}

// Three ranks (threads) save shards of one logical tensor plus a replicated
// blob; the checkpoint is read back whole and re-split for two ranks.
TEST(CheckpointerRanks, CollectiveCommitAndReshardedRead) {
  TempDir dir("pacer-ckpt-");
  const int kRanks = 3;
  test::ThreadWorld world(kRanks);
  const std::vector<std::uint64_t> sizes = {5000, 7000, 3000};
  const std::uint64_t total = 15000;
  const auto whole = pattern(total, 42);
  const auto rep = pattern(300, 7);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      auto comm = world.rank(r);
      Options o = small_options(dir.path());
      o.comm = comm.get();
      auto ck = Checkpointer::open(o).value();
      std::uint64_t off = std::accumulate(sizes.begin(), sizes.begin() + r, std::uint64_t{0});
      BlobView shard;
      shard.name = "w";
      shard.data = whole.data() + off;
      shard.size = sizes[static_cast<std::size_t>(r)];
      shard.layout = Layout::kShard;
      shard.shard_offset = off;
      shard.global_size = total;
      shard.global_shape = {static_cast<std::int64_t>(total)};
      // Every rank passes the replicated blob; one of them writes it.
      std::vector<BlobView> blobs = {shard, view("opt", rep)};
      auto h = ck->save(11, blobs, {{"rank0", r == 0}});
      if (!h) {
        errors[static_cast<std::size_t>(r)] = h.error().message;
        return;
      }
      Status st = h->wait();
      if (!st) errors[static_cast<std::size_t>(r)] = st.error().message;
      // A second, failing save: rank 2 gives a bad blob; nobody hangs and nothing commits.
      std::vector<BlobView> next = {shard};
      if (r == 2) next.push_back(view("bad", rep, "float33"));
      auto h2 = ck->save(12, next);
      if (h2) {
        Status st2 = h2->wait();
        if (st2) errors[static_cast<std::size_t>(r)] += "step 12 committed despite a failed rank";
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
  EXPECT_FALSE(fs::exists(dir.path() + "/" + step_dir_name(12)));

  auto reader = Reader::open(dir.path() + "/" + step_dir_name(11)).value();
  EXPECT_EQ(reader.manifest().world_size, kRanks);
  EXPECT_EQ(reader.manifest().meta["rank0"], true);
  EXPECT_TRUE(reader.verify_all());
  auto logical = reader.logical_blobs();
  ASSERT_EQ(logical.size(), 2u);
  EXPECT_EQ(logical[0].size, total);
  EXPECT_EQ(read_all(reader, "w", total), whole);
  EXPECT_EQ(read_all(reader, "opt", rep.size()), rep);
  // Two ranks now: each reads its half, crossing the saved shard boundaries.
  for (int r = 0; r < 2; ++r) {
    std::vector<unsigned char> half(total / 2);
    ASSERT_TRUE(reader.read("w", half.data(), half.size(), r * (total / 2)));
    EXPECT_TRUE(std::equal(half.begin(), half.end(), whole.begin() + r * (total / 2))) << "rank " << r;
  }
  for (const auto& e : list(dir.path(), false)) EXPECT_TRUE(e.committed) << e.path << ": " << e.problem;
}

}  // namespace
}  // namespace pacer::ckpt
