// Replicated blobs across ranks: each byte written once, the writing spread evenly, read back at any world size.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "blobs.hpp"
#include "checkpoint/ckpt_internal.hpp"
#include "pacer/checkpoint.hpp"
#include "test_util.hpp"
#include "thread_comm.hpp"

namespace pacer::ckpt {
namespace {

namespace fs = std::filesystem;
using test::contains;
using test::TempDir;
using test_blobs::pattern;
using test_blobs::read_all;
using test_blobs::view;

TEST(ReplicatedSplit, EveryByteOnceCutAt4KiBAndBalanced) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int ranks = 1 + trial % 7;
    std::vector<BlobView> blobs;
    const int n = 1 + static_cast<int>(rng() % 12);
    std::uint64_t largest_small = 0;
    for (int i = 0; i < n; ++i) {
      BlobView b;
      b.name = "b" + std::to_string(rng() % 1000000) + "_" + std::to_string(i);
      // Mostly small (under 64 KiB here), some large, a few empty.
      const auto kind = rng() % 4;
      b.size = kind == 0 ? 0 : kind == 1 ? (rng() % (3u << 20)) : (rng() % (64u << 10));
      if (b.size > 0 && b.size < (64u << 10)) largest_small = std::max(largest_small, b.size);
      b.layout = (rng() % 5 == 0) ? Layout::kShard : Layout::kReplicated;
      if (b.layout == Layout::kShard) b.global_size = b.size;
      blobs.push_back(b);
    }
    const auto pieces = split_replicated(blobs, ranks, 64u << 10);
    std::vector<std::uint64_t> load(static_cast<std::size_t>(ranks), 0);
    std::map<std::size_t, std::vector<ReplicatedPiece>> by_blob;
    for (const auto& p : pieces) {
      ASSERT_LT(p.blob, blobs.size());
      ASSERT_GE(p.rank, 0);
      ASSERT_LT(p.rank, ranks);
      by_blob[p.blob].push_back(p);
      load[static_cast<std::size_t>(p.rank)] += p.end - p.begin;
    }
    for (std::size_t i = 0; i < blobs.size(); ++i) {
      const auto& b = blobs[i];
      if (b.layout == Layout::kShard) {
        EXPECT_EQ(by_blob.count(i), 0u) << "shards are the caller's own";
        continue;
      }
      auto& ps = by_blob[i];
      ASSERT_FALSE(ps.empty()) << b.name << " is written by nobody";
      std::sort(ps.begin(), ps.end(), [](auto& a, auto& c) { return a.begin < c.begin; });
      std::uint64_t at = 0;
      for (const auto& p : ps) {
        EXPECT_EQ(p.begin, at) << b.name << ": a gap or an overlap";
        EXPECT_EQ(p.begin % 4096, 0u) << b.name;
        at = p.end;
      }
      EXPECT_EQ(at, b.size) << b.name;
      if (b.size < (64u << 10)) {
        EXPECT_EQ(ps.size(), 1u) << b.name << " is small: one rank writes it whole";
      }
      // A rank's range is contiguous: at most one piece of a blob per rank.
      std::set<int> owners;
      for (const auto& p : ps) EXPECT_TRUE(owners.insert(p.rank).second) << b.name;
    }
    const auto [lo, hi] = std::minmax_element(load.begin(), load.end());
    EXPECT_LE(*hi - *lo, largest_small + 2 * 4096) << "trial " << trial << ", " << ranks << " ranks";
  }
}

// What every rank of a data-parallel job holds: the same blobs.
struct Replicated {
  std::vector<std::string> names;
  std::vector<std::vector<unsigned char>> data;
  std::vector<std::string> dtypes;
  std::vector<std::vector<std::int64_t>> shapes;
  std::uint64_t total = 0;

  Replicated() {
    add("model/w0", pattern((3u << 20) + 4 * 123, 1), "float32", {(3 << 18) + 123});
    add("model/w1", pattern(2u << 20, 2), "bfloat16", {1024, 1024});
    add("optim/exp_avg", pattern((5u << 20) + 8, 3), "float64", {(5 << 17) + 1});
    for (int i = 0; i < 20; ++i) add("small/" + std::to_string(i), pattern(1000 + 15000u * i, 10 + i), "bytes", {});
    add("empty", {}, "int64", {0});
  }
  void add(std::string name, std::vector<unsigned char> d, std::string dtype, std::vector<std::int64_t> shape) {
    total += d.size();
    names.push_back(std::move(name));
    data.push_back(std::move(d));
    dtypes.push_back(std::move(dtype));
    shapes.push_back(std::move(shape));
  }
  std::vector<BlobView> views() const {
    std::vector<BlobView> out;
    for (std::size_t i = 0; i < names.size(); ++i) out.push_back(view(names[i], data[i], dtypes[i], shapes[i]));
    return out;
  }
};

Options rank_options(const std::string& root, comm::Communicator* comm) {
  Options o;
  o.root = root;
  o.chunk_bytes = 64u << 10;
  o.staging_bytes = 1u << 20;
  o.comm = comm;
  o.warn = [](const std::string&) {};
  return o;
}

// Runs `body(rank, checkpointer)` on `ranks` thread ranks; returns each rank's error text.
template <class Body>
std::vector<std::string> on_ranks(int ranks, const std::string& root, Body body) {
  return test::on_thread_ranks(ranks, [&](int r, comm::Communicator* comm) {
    auto ck = Checkpointer::open(rank_options(root, comm)).value();
    return body(r, *ck);
  });
}

class ReplicatedAcrossRanks : public ::testing::TestWithParam<int> {};

TEST_P(ReplicatedAcrossRanks, EachByteIsWrittenOnceAndTheWritingIsSpread) {
  const int ranks = GetParam();
  TempDir dir("pacer-ckpt-rep-");
  const Replicated rep;
  const auto errors = on_ranks(ranks, dir.path(), [&](int, Checkpointer& ck) -> std::string {
    auto h = ck.save(4, rep.views());
    if (!h) return h.error().message;
    Status st = h->wait();
    return st ? "" : st.error().message;
  });
  for (int r = 0; r < ranks; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;

  const std::string step_dir = dir.path() + "/" + step_dir_name(4);
  // Each rank's data file holds about 1/N of the bytes: one large blob's
  // worth of 4 KiB cuts and the largest small blob (301 KB) of imbalance at most.
  std::uint64_t sum = 0;
  for (int r = 0; r < ranks; ++r) {
    const auto size = fs::file_size(fmt::format("{}/rank-{:05d}.bin", step_dir, r));
    sum += size;
    const double share = static_cast<double>(rep.total) / ranks;
    EXPECT_NEAR(static_cast<double>(size), share, 301000.0 + 30 * 4096.0) << "rank " << r << " of " << ranks;
  }
  EXPECT_LT(sum, rep.total + 30 * 4096) << "no byte is written twice";
  for (const auto& e : fs::directory_iterator(step_dir))
    EXPECT_FALSE(contains(e.path().filename().string(), "replicated")) << "side files are gone: " << e.path();

  auto reader = Reader::open(step_dir).value();
  EXPECT_TRUE(reader.verify_all());
  // Read back at world size 1: every blob whole, with its dtype and shape.
  auto logical = reader.logical_blobs();
  ASSERT_EQ(logical.size(), rep.names.size());
  std::map<std::string, Reader::Logical> by_name;
  for (const auto& l : logical) by_name[l.name] = l;
  bool split = false;
  for (const auto& b : reader.manifest().blobs) split = split || b.layout == Layout::kShard;
  EXPECT_TRUE(split) << "the large blobs are spread, not written whole by one rank";
  for (std::size_t i = 0; i < rep.names.size(); ++i) {
    const auto& l = by_name[rep.names[i]];
    EXPECT_EQ(l.size, rep.data[i].size()) << rep.names[i];
    EXPECT_EQ(l.dtype, rep.dtypes[i]) << rep.names[i];
    EXPECT_EQ(l.shape, rep.shapes[i]) << rep.names[i];
    EXPECT_EQ(read_all(reader, rep.names[i], rep.data[i].size()), rep.data[i]) << rep.names[i];
  }
  // Read back at world size 3: each reader takes a third of every blob.
  for (std::size_t i = 0; i < rep.names.size(); ++i) {
    const std::uint64_t size = rep.data[i].size();
    std::vector<unsigned char> assembled(size);
    for (std::uint64_t r = 0; r < 3; ++r) {
      const std::uint64_t a = size * r / 3, b = size * (r + 1) / 3;
      ASSERT_TRUE(reader.read(rep.names[i], assembled.data() + a, b - a, a)) << rep.names[i] << " reader " << r;
    }
    EXPECT_EQ(assembled, rep.data[i]) << rep.names[i];
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ReplicatedAcrossRanks, ::testing::Values(2, 4));

TEST(ReplicatedAcrossRanksMismatch, ADifferentListCommitsNothingAndNamesTheRankAndBlob) {
  TempDir dir("pacer-ckpt-rep-");
  const Replicated rep;
  const auto other = pattern(rep.data[1].size() / 2, 99);
  struct Case {
    int rank;
    const char* blob;
  };
  for (const Case c : {Case{2, "model/w1"}, Case{3, "small/7"}}) {
    const auto errors = on_ranks(4, dir.path(), [&](int r, Checkpointer& ck) -> std::string {
      auto blobs = rep.views();
      if (r == c.rank && std::string(c.blob) == "model/w1") blobs[1] = view("model/w1", other, "bfloat16", {512, 1024});
      if (r == c.rank && std::string(c.blob) == "small/7") blobs.erase(blobs.begin() + 3 + 7);
      auto h = ck.save(9, blobs);
      if (!h) return h.error().message;
      Status st = h->wait();
      if (st) return "";
      // Nobody hangs: the next save, with the same blobs everywhere, commits.
      auto h2 = ck.save(10, rep.views());
      if (!h2 || !h2->wait()) return "the save after the mismatch failed";
      return st.error().message;
    });
    for (int r = 0; r < 4; ++r) {
      const auto& e = errors[static_cast<std::size_t>(r)];
      EXPECT_TRUE(contains(e, fmt::format("rank {}", c.rank))) << "rank " << r << ": " << e;
      EXPECT_TRUE(contains(e, fmt::format("'{}'", c.blob))) << "rank " << r << ": " << e;
      EXPECT_TRUE(contains(e, "nothing was committed")) << "rank " << r << ": " << e;
    }
    EXPECT_FALSE(fs::exists(dir.path() + "/" + step_dir_name(9)));
    for (const auto& e : list(dir.path(), false)) EXPECT_TRUE(e.committed) << "left behind: " << e.path;
    ASSERT_TRUE(fs::exists(dir.path() + "/" + step_dir_name(10)));
    fs::remove_all(dir.path() + "/" + step_dir_name(10));
  }
}

}  // namespace
}  // namespace pacer::ckpt
