// The fast tier with several ranks (threads as ranks, one fast-tier directory
// per "node"), and Checkpointer::load reading a checkpoint once.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <thread>

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

// A world of `ranks` thread ranks on `nodes` nodes (ranks split evenly, in
// order), each node with its own fast-tier directory, sharing one
// persistent root. Each rank saves its shard of one logical blob "w", and
// every rank the replicated blob "note" (small: one rank, rank 0, writes it).
struct Cluster {
  TempDir dir{"pacer-ckpt-ranks-"};
  int ranks;
  int nodes;
  std::uint64_t total;
  std::vector<unsigned char> whole;
  std::vector<unsigned char> note = pattern(777, 9);

  Cluster(int r, int n, std::uint64_t per_rank = 9000)
      : ranks(r), nodes(n), total(per_rank * static_cast<std::uint64_t>(r) + 123), whole(pattern(total, 5)) {}

  std::string root() const { return dir.path() + "/persistent"; }
  std::string fast(int node) const { return dir.path() + "/node" + std::to_string(node); }
  int node_of(int rank) const { return rank * nodes / ranks; }
  std::uint64_t lo(int rank) const { return total * static_cast<std::uint64_t>(rank) / static_cast<std::uint64_t>(ranks); }

  Options options(int rank, comm::Communicator* comm) const {
    Options o;
    o.root = root();
    o.fast_tier = fast(node_of(rank));
    o.chunk_bytes = 4096;
    o.staging_bytes = 64 * 1024;
    o.comm = comm;
    o.warn = [](const std::string&) {};
    return o;
  }

  std::vector<BlobView> blobs(int rank) const {
    BlobView shard;
    shard.name = "w";
    shard.data = whole.data() + lo(rank);
    shard.size = lo(rank + 1) - lo(rank);
    shard.dtype = "uint8";
    shard.shape = {static_cast<std::int64_t>(shard.size)};
    shard.layout = Layout::kShard;
    shard.shard_offset = lo(rank);
    shard.global_size = total;
    shard.global_shape = {static_cast<std::int64_t>(total)};
    BlobView n;
    n.name = "note";
    n.data = note.data();
    n.size = note.size();
    return {shard, n};
  }

  // Runs body(rank, checkpointer) on every rank at once; returns each rank's
  // error text ("" when none).
  std::vector<std::string> run(const std::function<std::string(int, Checkpointer&)>& body, double flush_timeout_s = 600) {
    return test::on_thread_ranks(ranks, [&](int r, comm::Communicator* comm) {
      Options o = options(r, comm);
      o.flush_timeout_s = flush_timeout_s;
      auto ck = Checkpointer::open(o);
      return ck ? body(r, **ck) : ck.error().message;
    });
  }
};

std::string save_all(Cluster& c, int rank, Checkpointer& ck, std::uint64_t step, bool persistent) {
  auto h = ck.save(step, c.blobs(rank), {{"step", step}});
  if (!h) return "save: " + h.error().message;
  if (Status st = h->wait(); !st) return "wait: " + st.error().message;
  if (!persistent) return "";
  if (Status st = h->wait_persistent(); !st) return "wait_persistent: " + st.error().message;
  return "";
}

TEST(CheckpointerFastTierRanks, EachNodeCommitsItsRanksThenThePersistentTierHoldsEveryPart) {
  for (int ranks : {2, 4}) {
    Cluster c(ranks, 2);
    auto errors = c.run([&](int r, Checkpointer& ck) { return save_all(c, r, ck, 10, true); });
    for (int r = 0; r < ranks; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << ranks << " ranks, rank " << r;

    // Each node's fast tier holds its own ranks' parts, and says so.
    for (int node = 0; node < 2; ++node) {
      auto fast = Reader::open(c.fast(node) + "/" + step_dir_name(10));
      ASSERT_TRUE(fast) << fast.error().message;
      EXPECT_FALSE(fast->complete());
      std::vector<int> want;
      for (int r = 0; r < ranks; ++r)
        if (c.node_of(r) == node) want.push_back(r);
      EXPECT_EQ(fast->manifest().ranks, want) << "node " << node;
      EXPECT_EQ(fast->manifest().files.size(), want.size());
      EXPECT_TRUE(fast->verify_all());
      // A node's copy reads its own ranks' bytes, not the others'.
      const int first = want.front();
      EXPECT_TRUE(fast->covers("w", c.lo(first + 1) - c.lo(first), c.lo(first)));
      EXPECT_FALSE(fast->covers("w", c.total));
      EXPECT_EQ(fast->covers("note", c.note.size()), node == 0);
      // No leftovers of the save on the node.
      for (const auto& e : fs::directory_iterator(c.fast(node))) EXPECT_EQ(e.path().filename().string(), step_dir_name(10));
    }
    // The persistent tier has the whole step, every rank's file in it.
    auto whole = Reader::open(c.root() + "/" + step_dir_name(10));
    ASSERT_TRUE(whole) << whole.error().message;
    EXPECT_TRUE(whole->complete());
    EXPECT_EQ(whole->manifest().world_size, ranks);
    EXPECT_EQ(whole->manifest().files.size(), static_cast<std::size_t>(ranks));
    EXPECT_TRUE(whole->verify_all());
    std::vector<unsigned char> got(c.total);
    ASSERT_TRUE(whole->read("w", got.data(), got.size()));
    EXPECT_EQ(got, c.whole);
    for (const auto& e : fs::directory_iterator(c.root())) EXPECT_EQ(e.path().filename().string(), step_dir_name(10)) << "leftover";
  }
}

TEST(CheckpointerFastTierRanks, ARankThatCannotSaveCommitsNothingOnAnyNode) {
  Cluster c(4, 2);
  auto errors = c.run([&](int r, Checkpointer& ck) {
    auto blobs = c.blobs(r);
    if (r == 3) blobs[0].dtype = "float33";
    auto h = ck.save(5, blobs);
    if (h && h->wait()) return std::string("step 5 committed although rank 3 failed");
    return std::string();
  });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
  for (const auto& d : {c.fast(0), c.fast(1), c.root()})
    for (const auto& e : fs::directory_iterator(d)) ADD_FAILURE() << "left behind: " << e.path();
}

TEST(CheckpointerFastTierRanks, OneNodeHoldsACompleteCopyThatReadersPrefer) {
  Cluster c(2, 1);
  auto errors = c.run([&](int r, Checkpointer& ck) {
    std::string e = save_all(c, r, ck, 3, true);
    if (!e.empty()) return e;
    auto cands = ck.candidates(3);
    if (cands.size() != 2) return "expected 2 candidates, got " + std::to_string(cands.size());
    if (fs::path(cands[0].dir()).parent_path() != fs::path(c.fast(0))) return "fast copy is not first: " + cands[0].dir();
    return std::string();
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_TRUE(Reader::open(c.fast(0) + "/" + step_dir_name(3))->complete());
}

// Each rank makes its own copy to the persistent tier fail: a directory where
// its part's data file is to be created, in the temporary directory whose name
// the save agreed (the same name as the one on the fast tier).
void block_copy(const Cluster& c, int rank) {
  for (const auto& e : fs::directory_iterator(c.fast(c.node_of(rank)))) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".partial-", 0) == 0) fs::create_directories(c.root() + "/" + name + "/rank-0000" + std::to_string(rank) + ".bin");
  }
}

TEST(CheckpointerFastTierRanks, ARankWhoseCopyFailsLeavesTheStepOnTheFastTiersAndEveryRankHearsOfIt) {
  Cluster c(4, 2);
  auto errors = c.run([&](int r, Checkpointer& ck) {
    // Every rank goes through every collective call whatever it finds, so
    // that a failed expectation cannot hang the others.
    std::string e;
    auto h = ck.save(1, c.blobs(r));
    if (!h) return "save: " + h.error().message;
    if (r == 3) block_copy(c, 3);  // before wait(): the flush starts only after the commit
    if (Status st = h->wait(); !st) e += "wait: " + st.error().message;
    Status p = h->wait_persistent();
    if (p) e += "step 1 reached the persistent tier although rank 3's copy failed; ";
    else if (!contains(p.error().message, "rank 3")) e += "the error does not name rank 3: " + p.error().message + "; ";
    if (ck.flush()) e += "flush() reports no error; ";
    // The next step goes through.
    if (auto e2 = save_all(c, r, ck, 2, true); !e2.empty()) e += "step 2: " + e2;
    return e;
  }, /*flush_timeout_s=*/30);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
  EXPECT_FALSE(fs::exists(c.root() + "/" + step_dir_name(1)));
  EXPECT_TRUE(fs::exists(c.root() + "/" + step_dir_name(2) + "/MANIFEST.json"));
  for (int node = 0; node < 2; ++node) EXPECT_TRUE(Reader::open(c.fast(node) + "/" + step_dir_name(1))) << "node " << node;
  // The abandoned temporary directory is gone from the persistent tier.
  for (const auto& e : fs::directory_iterator(c.root())) EXPECT_EQ(e.path().filename().string(), step_dir_name(2)) << "leftover";
}

// Makes `rank`'s copy of the step being saved block: its data file on the
// persistent tier is a FIFO that nobody opens for reading, so creating it
// waits. Once `release` is set, `drain` opens the FIFO through a second name,
// `link` (the directory may be gone by then), and the copy fails (a FIFO
// takes no pwrite). False when the FIFO cannot be made.
bool block_copy_on_a_fifo(const Cluster& c, int rank, const std::string& link, const std::atomic<bool>& release, std::thread& drain) {
  for (const auto& d : fs::directory_iterator(c.fast(c.node_of(rank)))) {
    const std::string name = d.path().filename().string();
    if (name.rfind(".partial-", 0) != 0) continue;
    fs::create_directories(c.root() + "/" + name);
    const std::string fifo = c.root() + "/" + name + "/rank-0000" + std::to_string(rank) + ".bin";
    if (::mkfifo(fifo.c_str(), 0644) != 0 || ::link(fifo.c_str(), link.c_str()) != 0) return false;
    drain = std::thread([&release, link] {
      while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      const int fd = ::open(link.c_str(), O_RDONLY);  // meets the copy's open
      if (fd >= 0) ::close(fd);
    });
  }
  return true;
}

TEST(CheckpointerFastTierRanks, ARankThatNeverFinishesItsCopyTimesOutAndNothingIsCommitted) {
  // Rank 1's copy blocks: its data file on the persistent tier is a FIFO
  // that nobody opens for reading, so creating it waits. Rank 0 gives the
  // step up after flush_timeout_s; then the FIFO is opened (through a second
  // name: rank 0 has removed the directory), rank 1's copy fails (a FIFO
  // takes no pwrite) and it reports that.
  Cluster c(2, 2);
  std::atomic<bool> rank0_done{false};
  const std::string link = c.dir.path() + "/fifo";
  std::thread drain;
  auto errors = c.run([&](int r, Checkpointer& ck) {
    std::string e;
    auto h = ck.save(1, c.blobs(r));
    if (!h) return "save: " + h.error().message;
    if (r == 1 && !block_copy_on_a_fifo(c, 1, link, rank0_done, drain)) return std::string("mkfifo failed");
    if (Status st = h->wait(); !st) e += "wait: " + st.error().message;
    Status p = h->wait_persistent();
    if (r == 0) {
      if (p) e += "committed without rank 1's part; ";
      else if (!contains(p.error().message, "within")) e += "rank 0's error does not say it timed out: " + p.error().message;
      rank0_done = true;
    } else if (p) {
      e += "rank 1 saw a commit; ";
    }
    return e;
  }, /*flush_timeout_s=*/1);
  if (drain.joinable()) drain.join();
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
  EXPECT_FALSE(fs::exists(c.root() + "/" + step_dir_name(1)));
  for (int node = 0; node < 2; ++node) EXPECT_TRUE(Reader::open(c.fast(node) + "/" + step_dir_name(1))) << "node " << node;
}

TEST(CheckpointerFastTierRanks, RetentionOnAFastTierKeepsWhatThePersistentTierLacks) {
  Cluster c(2, 2);
  auto errors = c.run([&](int r, Checkpointer& ck) {
    // Step 1's copy fails; steps 2..4 go through (keep_last is 3).
    std::string e;
    auto h = ck.save(1, c.blobs(r));
    if (!h) return "save: " + h.error().message;
    block_copy(c, r);
    if (!h->wait()) e += "wait failed; ";
    if (h->wait_persistent()) e += "step 1 persisted; ";
    for (std::uint64_t s = 2; s <= 4; ++s) e += save_all(c, r, ck, s, true);
    return e;
  }, 30);
  for (const auto& e : errors) EXPECT_EQ(e, "");
  for (int node = 0; node < 2; ++node) {
    std::set<std::uint64_t> steps;
    for (const auto& e : list(c.fast(node), false))
      if (e.committed) steps.insert(e.step);
    // keep_last 3: 2, 3, 4; and 1, which only the fast tiers hold.
    EXPECT_EQ(steps, (std::set<std::uint64_t>{1, 2, 3, 4})) << "node " << node;
  }
}

TEST(CheckpointerFastTierRanks, ARestartOnOtherNodesReadsThePersistentTier) {
  Cluster c(4, 2);
  auto errors = c.run([&](int r, Checkpointer& ck) { return save_all(c, r, ck, 20, true); });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  // The nodes are gone; the restart runs on three new ranks, two new nodes.
  fs::remove_all(c.fast(0));
  fs::remove_all(c.fast(1));
  Cluster again(3, 2);
  for (int r = 0; r < 3; ++r) {
    Options o;
    o.root = c.root();
    o.fast_tier = again.fast(again.node_of(r));
    o.warn = [](const std::string&) {};
    auto ck = Checkpointer::open(o).value();
    EXPECT_EQ(ck->latest(), 20u);
    // Each new rank reads its third of "w", and the note.
    const std::uint64_t a = c.total * static_cast<std::uint64_t>(r) / 3, b = c.total * static_cast<std::uint64_t>(r + 1) / 3;
    std::vector<unsigned char> part(b - a), note(c.note.size());
    auto got = ck->load([&](const Reader::Logical& l) -> LoadTarget {
      if (l.name == "w") return {part.data(), a, b - a};
      if (l.name == "note") return {note.data(), 0, note.size()};
      return {};
    });
    ASSERT_TRUE(got) << got.error().message;
    EXPECT_EQ(got->manifest().step, 20u);
    EXPECT_EQ(fs::path(got->dir()).parent_path(), fs::path(c.root()));
    EXPECT_TRUE(std::equal(part.begin(), part.end(), c.whole.begin() + static_cast<long>(a))) << "rank " << r;
    EXPECT_EQ(note, c.note);
  }
}

TEST(CheckpointerFastTierRanks, LoadUsesANodesPartialCopyOnlyForWhatItHolds) {
  Cluster c(4, 2);
  auto errors = c.run([&](int r, Checkpointer& ck) -> std::string {
    if (auto e = save_all(c, r, ck, 30, true); !e.empty()) return e;  // no collective call follows
    // Its own shard: the node's copy has it.
    std::vector<unsigned char> mine(c.lo(r + 1) - c.lo(r));
    auto own = ck.load([&](const Reader::Logical& l) -> LoadTarget {
      if (l.name == "w") return {mine.data(), c.lo(r), mine.size()};
      return {};
    });
    if (!own) return "own shard: " + own.error().message;
    if (fs::path(own->dir()).parent_path() != fs::path(c.fast(c.node_of(r)))) return "own shard not read from the fast tier: " + own->dir();
    if (!std::equal(mine.begin(), mine.end(), c.whole.begin() + static_cast<long>(c.lo(r)))) return std::string("own shard differs");
    // The whole blob: only the persistent copy has it.
    std::vector<unsigned char> all(c.total);
    auto whole = ck.load([&](const Reader::Logical& l) -> LoadTarget {
      if (l.name == "w") return {all.data(), 0, all.size()};
      return {};
    });
    if (!whole) return "whole: " + whole.error().message;
    if (fs::path(whole->dir()).parent_path() != fs::path(c.root())) return "whole blob read from " + whole->dir();
    if (all != c.whole) return std::string("whole blob differs");
    // candidates() offers complete copies only.
    for (const auto& cand : ck.candidates(30))
      if (!cand.complete()) return "a partial copy among candidates: " + cand.dir();
    return std::string();
  });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
}

TEST(CheckpointerLoad, ReadsOnceAndFallsBackPastACorruptCopy) {
  TempDir dir("pacer-ckpt-load-");
  Options o;
  o.root = dir.path() + "/root";
  o.chunk_bytes = 4096;
  o.staging_bytes = 64 * 1024;
  std::vector<std::string> warnings;
  o.warn = [&](const std::string& w) { warnings.push_back(w); };
  o.keep_last = 0;
  auto ck = Checkpointer::open(o).value();
  const auto a1 = pattern(50000, 1), a2 = pattern(50000, 2), b = pattern(3000, 3);
  auto blob = [](const std::string& name, const std::vector<unsigned char>& d) {
    BlobView v;
    v.name = name;
    v.data = d.data();
    v.size = d.size();
    return v;
  };
  ASSERT_TRUE(ck->save(1, {blob("a", a1), blob("b", b)})->wait());
  ASSERT_TRUE(ck->save(2, {blob("a", a2), blob("b", b)})->wait());
  std::map<std::string, std::vector<unsigned char>> out;
  int asked = 0;
  auto dest = [&](const Reader::Logical& l) -> LoadTarget {
    ++asked;
    out[l.name].assign(l.size, 0);
    return {out[l.name].data(), 0, l.size};
  };
  auto r = ck->load(dest);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->manifest().step, 2u);
  EXPECT_EQ(out["a"], a2);
  EXPECT_EQ(out["b"], b);
  EXPECT_EQ(asked, 2);

  // The newest step damaged: load falls back to step 1, with a warning naming step 2.
  flip_byte(dir.path() + "/root/" + step_dir_name(2) + "/rank-00000.bin", 40000);
  warnings.clear();
  asked = 0;
  r = ck->load(dest);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->manifest().step, 1u);
  EXPECT_EQ(out["a"], a1);
  EXPECT_EQ(asked, 4);
  ASSERT_FALSE(warnings.empty());
  EXPECT_TRUE(contains(warnings.front(), "step 2"));
  EXPECT_EQ(ck->latest(), 1u);
  // A step asked for by number that does not verify: an error, no fallback.
  auto bad = ck->load(dest, 2);
  ASSERT_FALSE(bad);
  EXPECT_TRUE(contains(bad.error().message, "checksum mismatch"));
  // A target outside the blob is the caller's error.
  auto outside = ck->load([&](const Reader::Logical& l) -> LoadTarget { return {out[l.name].data(), 1, l.size}; }, 1);
  ASSERT_FALSE(outside);
  EXPECT_TRUE(contains(outside.error().message, "load target"));
}

TEST(CheckpointerLoad, LargeChunksAlignedAndNotReadBackWhole) {
  // Chunks of 1 MiB and more are read ahead on a helper thread and, into
  // 4 KiB-aligned memory, with O_DIRECT: the bytes must come out the same,
  // including a blob whose size is not a multiple of the page size and reads
  // of unaligned sub-ranges.
  TempDir dir("pacer-ckpt-load-");
  Options o;
  o.root = dir.path();
  o.chunk_bytes = 1 << 20;
  o.staging_bytes = 4 << 20;
  o.warn = [](const std::string&) {};
  auto ck = Checkpointer::open(o).value();
  const auto big = pattern((3 << 20) + 1234, 11);
  BlobView v;
  v.name = "big";
  v.data = big.data();
  v.size = big.size();
  ASSERT_TRUE(ck->save(1, {v})->wait());
  HostBuffer aligned_buf(big.size());
  auto r = ck->load([&](const Reader::Logical&) -> LoadTarget { return {aligned_buf.data(), 0, big.size()}; });
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_TRUE(std::equal(big.begin(), big.end(), aligned_buf.data()));
  std::vector<unsigned char> mid(2 << 20);
  ASSERT_TRUE(r->read("big", mid.data(), mid.size(), 777));
  EXPECT_TRUE(std::equal(mid.begin(), mid.end(), big.begin() + 777));
  EXPECT_TRUE(r->verify_all());
  flip_byte(r->dir() + "/rank-00000.bin", (3 << 20) + 1000);  // in the sub-page tail of the last chunk
  EXPECT_FALSE(r->verify_all());
  EXPECT_FALSE(r->read("big", aligned_buf.data(), big.size()));
}

}  // namespace
}  // namespace pacer::ckpt

namespace pacer::ckpt {
namespace {

// A load of 64 MiB and more runs a thread that faults the destinations in
// ahead of the readers: the bytes still come out the same, in several pieces
// and into new memory, and a corrupt copy still fails the load.
TEST(CheckpointerLoad, ALargeLoadFaultsItsDestinationsInAheadAndReadsTheSameBytes) {
  TempDir dir("pacer-ckpt-load-");
  Options o;
  o.root = dir.path();
  o.chunk_bytes = 4 << 20;
  o.staging_bytes = 16 << 20;
  o.warn = [](const std::string&) {};
  auto ck = Checkpointer::open(o).value();
  const auto a = pattern((48 << 20) + 4096 + 7, 61), b = pattern(20 << 20, 62);
  BlobView va, vb;
  va.name = "a", va.data = a.data(), va.size = a.size();
  vb.name = "b", vb.data = b.data(), vb.size = b.size();
  ASSERT_TRUE(ck->save(1, {va, vb})->wait());
  HostBuffer ba(a.size()), bb(b.size());
  auto dest = [&](const Reader::Logical& l) -> LoadTarget {
    return l.name == "a" ? LoadTarget{ba.data(), 0, a.size()} : LoadTarget{bb.data(), 0, b.size()};
  };
  auto r = ck->load(dest);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(std::memcmp(ba.data(), a.data(), a.size()), 0);
  EXPECT_EQ(std::memcmp(bb.data(), b.data(), b.size()), 0);
  const std::string file = r->dir() + "/rank-00000.bin";
  flip_byte(file, 30 << 20);
  EXPECT_FALSE(ck->load(dest)) << "a checksum fails in the faulted-in memory";
}

// Ranks on different nodes merge their parts on different fast tiers: a rank
// given another replicated list must still fail the step everywhere, before
// any node commits a copy whose replicated bytes were cut differently.
TEST(CheckpointerFastTierRanks, OtherReplicatedBlobsOnAnotherNodeCommitNothing) {
  Cluster c(2, 2);
  const std::vector<unsigned char> other = pattern(555, 11);
  auto errors = c.run([&](int r, Checkpointer& ck) {
    auto blobs = c.blobs(r);
    if (r == 1) {
      blobs[1].data = other.data();
      blobs[1].size = other.size();
    }
    auto h = ck.save(3, blobs);
    if (!h) return "save: " + h.error().message;
    Status st = h->wait();
    return st ? std::string("committed") : st.error().message;
  });
  EXPECT_TRUE(contains(errors[1], "rank 1 was given other replicated blobs than rank 0")) << errors[1];
  EXPECT_NE(errors[0], "committed");
  for (int node = 0; node < 2; ++node) EXPECT_FALSE(fs::exists(c.fast(node) + "/" + step_dir_name(3))) << "node " << node;
  EXPECT_FALSE(fs::exists(c.root() + "/" + step_dir_name(3)));
}


// A step damaged on every tier that holds it (the persistent copy and each
// node's copy): training that fell back past it and came back to it saves it
// anew. Each node's damaged copy is moved aside on its own node, not only
// what rank 0 can see, or the ranks on the other node refuse the step as
// "already committed" and every rank's save fails, again at every restart.
TEST(CheckpointerFastTierRanks, AStepDamagedOnEveryNodeIsSavedAnew) {
  for (int ranks : {2, 4}) {  // 4: two ranks of each node check its copy
    SCOPED_TRACE(ranks);
    Cluster c(ranks, 2);
    auto first = c.run([&](int r, Checkpointer& ck) { return save_all(c, r, ck, 5, true); });
    for (const auto& e : first) ASSERT_EQ(e, "");
    for (const auto& d : {c.root(), c.fast(0), c.fast(1)})
      for (const auto& f : fs::directory_iterator(d + "/" + step_dir_name(5)))
        if (f.path().extension() == ".bin") flip_byte(f.path().string(), 100);
    auto again = c.run([&](int r, Checkpointer& ck) { return save_all(c, r, ck, 5, true); });
    for (int r = 0; r < ranks; ++r) EXPECT_EQ(again[static_cast<std::size_t>(r)], "") << "rank " << r;
    for (const auto& d : {c.root(), c.fast(0), c.fast(1)}) {
      auto r = Reader::open(d + "/" + step_dir_name(5));
      ASSERT_TRUE(r) << d << ": " << r.error().message;
      EXPECT_TRUE(r->verify_all()) << d;
    }
  }
}

// Steps that a killed job of several ranks committed on its nodes' fast tiers
// but never copied to the persistent tier: a restart reads the persistent
// tier, may save those steps again, and does not keep the stale copies.
TEST(CheckpointerFastTierRanks, FastTierStepsThatNeverReachedThePersistentTierDoNotOutliveARestart) {
  Cluster c(2, 2);
  auto first = c.run([&](int r, Checkpointer& ck) {
    std::string e = save_all(c, r, ck, 6, true);
    auto h = ck.save(7, c.blobs(r));
    if (!h) return e + "save 7: " + h.error().message;
    block_copy(c, r);  // the job "dies" before step 7 reaches the persistent tier
    if (!h->wait()) e += "step 7 not committed on the fast tiers; ";
    if (h->wait_persistent()) e += "step 7 persisted; ";
    return e;
  }, 30);
  for (const auto& e : first) ASSERT_EQ(e, "");
  for (int node = 0; node < 2; ++node) ASSERT_TRUE(fs::exists(c.fast(node) + "/" + step_dir_name(7)));
  for (const auto& e : fs::directory_iterator(c.root()))
    if (e.path().filename().string().rfind(".partial-", 0) == 0) fs::remove_all(e.path());  // block_copy's directories
  auto again = c.run([&](int r, Checkpointer& ck) -> std::string {
    std::string e;
    if (ck.latest() != 6u) e += "latest is not 6; ";
    if (auto e7 = save_all(c, r, ck, 7, true); !e7.empty()) e += "step 7 again: " + e7;
    return e;
  }, 30);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(again[static_cast<std::size_t>(r)], "") << "rank " << r;
  auto whole = Reader::open(c.root() + "/" + step_dir_name(7));
  ASSERT_TRUE(whole) << whole.error().message;
  EXPECT_TRUE(whole->verify_all());
  // Each node holds the new save's copy of step 7, and nothing else of it.
  for (int node = 0; node < 2; ++node) {
    auto fast = Reader::open(c.fast(node) + "/" + step_dir_name(7));
    ASSERT_TRUE(fast) << fast.error().message;
    EXPECT_TRUE(fast->verify_all()) << "node " << node;
    for (const auto& e : fs::directory_iterator(c.fast(node)))
      EXPECT_EQ(e.path().filename().string().rfind(".", 0), std::string::npos) << "left behind: " << e.path();
  }
}

// A rank whose copy to the persistent tier starts after rank 0 has given the
// step up (it was still busy with the previous step's copy) must not
// re-create the abandoned temporary directory there and leave it behind.
TEST(CheckpointerFastTierRanks, ARankLateForThePersistentCommitLeavesNoPartialDirectory) {
  Cluster c(2, 2);
  std::atomic<bool> rank0_done{false};
  const std::string link = c.dir.path() + "/fifo";
  std::thread drain;
  auto errors = c.run([&](int r, Checkpointer& ck) {
    std::string e;
    auto h1 = ck.save(1, c.blobs(r));
    if (!h1) return "save 1: " + h1.error().message;
    // Rank 1's copy of step 1 blocks until rank 0 is done with both steps.
    if (r == 1 && !block_copy_on_a_fifo(c, 1, link, rank0_done, drain)) return std::string("mkfifo failed");
    if (!h1->wait()) e += "step 1 not committed on the fast tiers; ";
    auto h2 = ck.save(2, c.blobs(r));
    if (!h2) return e + "save 2: " + h2.error().message;
    if (!h2->wait()) e += "step 2 not committed on the fast tiers; ";
    const bool p1 = h1->wait_persistent().ok();
    const bool p2 = h2->wait_persistent().ok();
    if (r == 0) rank0_done = true;
    if (p1 || p2) e += "a step persisted without rank 1's part; ";
    return e;
  }, /*flush_timeout_s=*/1);
  if (drain.joinable()) drain.join();
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
  for (const auto& e : fs::directory_iterator(c.root())) ADD_FAILURE() << "left behind on the persistent tier: " << e.path();
}

}  // namespace
}  // namespace pacer::ckpt
