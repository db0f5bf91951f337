// The loader: exact-once coverage per epoch over ranks, determinism, resume (same and other world
// sizes), looping, bad shards, option errors, stats, bounded memory and shutdown.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "data/raw_tar.hpp"
#include "pacer/data.hpp"
#include "test_util.hpp"

namespace pacer::data {
namespace {

namespace fs = std::filesystem;
using test::contains;
using test::TempDir;

// ---------------------------------------------------------------------------
// Helpers

using test::RawTar;
using Fields = std::vector<std::pair<std::string, std::string>>;

// Shards of samples "NNNNNN" with a "txt" field of varying size and a "cls" field.
struct Data {
  TempDir dir{"pacer-loader-"};
  std::vector<std::string> shards;
  std::vector<std::string> keys;  // dataset order
  std::map<std::string, Fields> expected;
  std::shared_ptr<Dataset> ds;

  explicit Data(const std::vector<int>& counts) {
    int next = 0;
    for (std::size_t s = 0; s < counts.size(); ++s) {
      RawTar raw;
      for (int i = 0; i < counts[s]; ++i, ++next) {
        const std::string key = fmt::format("{:06d}", next);
        const std::string txt = fmt::format("sample {};", next) + std::string(static_cast<std::size_t>(next % 17) * 30, 'a' + next % 26);
        const std::string cls = std::to_string(next % 10);
        raw.add(key + ".txt", txt);
        raw.add(key + ".cls", cls);
        keys.push_back(key);
        expected[key] = {{"txt", txt}, {"cls", cls}};
      }
      shards.push_back(dir.file(fmt::format("d-{:03d}.tar", s), raw.finish()));
    }
    auto opened = Dataset::open(shards);
    if (!opened) throw std::runtime_error(opened.error().message);
    ds = *opened;
  }
  std::uint64_t size() const { return keys.size(); }
};

// Spreads `n` samples over shards of up to 16.
std::vector<int> counts_for(int n) {
  std::vector<int> c;
  for (int k = 0; n > 0; ++k) {
    const int here = std::min(n, 7 + (k * 5) % 10);
    c.push_back(here);
    n -= here;
  }
  return c;
}

std::unique_ptr<Loader> open_loader(const std::shared_ptr<Dataset>& ds, const LoaderOptions& o) {
  auto l = Loader::open(ds, o);
  if (!l) {
    ADD_FAILURE() << "Loader::open: " << l.error().message;
    return nullptr;
  }
  return std::move(*l);
}

using Keys = std::vector<std::string>;

struct Taken {
  std::uint64_t epoch = 0;
  std::uint64_t global_batch = 0;
  Keys keys;
};

// Takes up to `max` batches (all, by default) and checks every sample's bytes.
std::vector<Taken> take(Loader& l, const Data& d, std::size_t max = ~std::size_t{0}) {
  std::vector<Taken> out;
  while (out.size() < max) {
    auto b = l.next();
    if (!b) {
      ADD_FAILURE() << "next: " << b.error().message;
      break;
    }
    if (!*b) break;
    Taken t;
    t.epoch = (*b)->epoch;
    t.global_batch = (*b)->global_batch;
    for (std::size_t i = 0; i < (*b)->size(); ++i) {
      const auto s = (*b)->sample(i);
      t.keys.push_back(s.key);
      auto it = d.expected.find(s.key);
      if (it == d.expected.end()) ADD_FAILURE() << "unknown key " << s.key;
      else if (s.fields != it->second) ADD_FAILURE() << "wrong bytes for " << s.key;
    }
    out.push_back(std::move(t));
  }
  return out;
}

Keys flatten(const std::vector<Taken>& bs) {
  Keys k;
  for (const auto& b : bs) k.insert(k.end(), b.keys.begin(), b.keys.end());
  return k;
}

// Every key exactly once.
::testing::AssertionResult exactly_once(Keys got, Keys all) {
  std::sort(got.begin(), got.end());
  std::sort(all.begin(), all.end());
  const auto dup = std::adjacent_find(got.begin(), got.end());
  if (dup != got.end()) return ::testing::AssertionFailure() << "key " << *dup << " read twice";
  if (got != all) return ::testing::AssertionFailure() << got.size() << " distinct keys read, expected " << all.size();
  return ::testing::AssertionSuccess();
}

// Runs `fn` on another thread; aborts the whole run if it does not finish in
// `seconds` (a deadlock would otherwise hang the suite).
void within(double seconds, const std::string& what, std::function<void()> fn) {
  auto done = std::make_shared<std::promise<void>>();
  auto fut = done->get_future();
  std::thread([fn = std::move(fn), done] {
    fn();
    done->set_value();
  }).detach();
  if (fut.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) {
    std::fprintf(stderr, "FATAL: %s did not finish in %.0f s (deadlock?)\n", what.c_str(), seconds);
    std::fflush(stderr);
    std::abort();
  }
}

LoaderOptions opts(std::uint64_t batch, int rank, int world, bool shuffle = true, std::uint64_t seed = 5) {
  LoaderOptions o;
  o.batch_size = batch;
  o.rank = rank;
  o.world_size = world;
  o.shuffle = shuffle;
  o.seed = seed;
  o.threads = 2;
  o.prefetch_batches = 3;
  return o;
}

// ---------------------------------------------------------------------------
// Coverage

TEST(LoaderCoverage, EveryKeyExactlyOncePerEpochOverRanks) {
  Data d(counts_for(103));
  for (int world : {1, 2, 4}) {
    for (bool shuffle : {false, true}) {
      for (std::uint64_t batch : {1ULL, 5ULL, 8ULL}) {
        const std::string what = fmt::format("world={} shuffle={} batch={}", world, shuffle, batch);
        Keys all;
        for (int r = 0; r < world; ++r) {
          auto l = open_loader(d.ds, opts(batch, r, world, shuffle));
          ASSERT_TRUE(l) << what;
          const auto bs = take(*l, d);
          ASSERT_EQ(bs.size(), l->batches_per_epoch()) << what << " rank " << r;
          EXPECT_EQ(l->batches_per_epoch(), (103 + batch * world - 1) / (batch * world)) << what;
          for (std::size_t g = 0; g < bs.size(); ++g) {
            EXPECT_EQ(bs[g].epoch, 0u) << what;
            EXPECT_EQ(bs[g].global_batch, g) << what;
            if (g + 1 < bs.size()) {
              EXPECT_EQ(bs[g].keys.size(), batch) << what << " full batch " << g;
            }
          }
          // After the end: nothing, again and again.
          auto end = l->next();
          ASSERT_TRUE(end);
          EXPECT_FALSE(*end) << what;
          const Keys k = flatten(bs);
          all.insert(all.end(), k.begin(), k.end());
          if (!shuffle && world == 1) {
            EXPECT_EQ(k, d.keys) << what << ": unshuffled is dataset order";
          }
        }
        EXPECT_TRUE(exactly_once(all, d.keys)) << what;
      }
    }
  }
}

TEST(LoaderCoverage, DropLastReadsOnlyFullGlobalBatches) {
  Data d(counts_for(50));
  for (int world : {1, 2, 4}) {
    for (bool shuffle : {false, true}) {
      const std::uint64_t batch = 3;
      const std::uint64_t gb = batch * static_cast<std::uint64_t>(world);
      const std::uint64_t full = 50 / gb;
      Keys all;
      for (int r = 0; r < world; ++r) {
        auto o = opts(batch, r, world, shuffle);
        o.drop_last = true;
        auto l = open_loader(d.ds, o);
        ASSERT_TRUE(l);
        EXPECT_EQ(l->batches_per_epoch(), full);
        const auto bs = take(*l, d);
        ASSERT_EQ(bs.size(), full);
        for (const auto& b : bs) EXPECT_EQ(b.keys.size(), batch);
        const Keys k = flatten(bs);
        all.insert(all.end(), k.begin(), k.end());
      }
      ASSERT_EQ(all.size(), full * gb);
      std::set<std::string> distinct(all.begin(), all.end());
      EXPECT_EQ(distinct.size(), all.size()) << "no duplicates";
      if (!shuffle) {
        // Unshuffled: exactly the first full*gb samples.
        EXPECT_TRUE(exactly_once(all, Keys(d.keys.begin(), d.keys.begin() + static_cast<std::ptrdiff_t>(full * gb))));
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Order

TEST(LoaderOrder, SameSeedSameSequenceOtherSeedOrEpochNot) {
  Data d(counts_for(120));
  auto run = [&](std::uint64_t seed, std::uint64_t epoch, int rank = 0, int world = 2) {
    auto l = open_loader(d.ds, opts(6, rank, world, true, seed));
    if (epoch) l->set_epoch(epoch);
    auto bs = take(*l, d);
    for (const auto& b : bs) EXPECT_EQ(b.epoch, epoch);
    return flatten(bs);
  };
  const Keys a = run(11, 0);
  EXPECT_EQ(run(11, 0), a);
  EXPECT_NE(run(12, 0), a);
  const Keys e1 = run(11, 1);
  EXPECT_NE(e1, a);
  EXPECT_EQ(run(11, 1), e1);
  // Both epochs cover everything, together with rank 1.
  Keys all0 = a, all1 = e1;
  const Keys a1 = run(11, 0, 1), e11 = run(11, 1, 1);
  all0.insert(all0.end(), a1.begin(), a1.end());
  all1.insert(all1.end(), e11.begin(), e11.end());
  EXPECT_TRUE(exactly_once(all0, d.keys));
  EXPECT_TRUE(exactly_once(all1, d.keys));

  // set_epoch mid-epoch restarts from that epoch's beginning.
  auto l = open_loader(d.ds, opts(6, 0, 2, true, 11));
  take(*l, d, 3);
  l->set_epoch(1);
  EXPECT_EQ(flatten(take(*l, d)), e1);
  l->set_epoch(0);
  EXPECT_EQ(flatten(take(*l, d)), a);
}

// ---------------------------------------------------------------------------
// Resume

TEST(LoaderResume, StateThenLoadStateYieldsTheRemainingBatches) {
  Data d(counts_for(77));
  for (int world : {1, 2}) {
    for (bool drop_last : {false, true}) {
      for (int rank = 0; rank < world; ++rank) {
        auto o = opts(4, rank, world, true, 99);
        o.drop_last = drop_last;
        auto full_run = open_loader(d.ds, o);
        ASSERT_TRUE(full_run);
        const auto whole = take(*full_run, d);
        for (std::size_t k = 0; k <= whole.size(); ++k) {
          const std::string what = fmt::format("world={} rank={} drop_last={} k={}", world, rank, drop_last, k);
          auto first = open_loader(d.ds, o);
          const auto before = take(*first, d, k);
          ASSERT_EQ(before.size(), k) << what;
          const nlohmann::json st = first->state();
          EXPECT_EQ(st.at("epoch"), 0u);
          EXPECT_EQ(st.at("seed"), 99u);
          EXPECT_EQ(st.at("global_batch"), 4u * static_cast<std::uint64_t>(world));
          // Through text, as a checkpoint would keep it.
          const nlohmann::json restored = nlohmann::json::parse(st.dump());
          auto o2 = o;
          o2.seed = 12345;  // the state's seed wins
          auto second = open_loader(d.ds, o2);
          const Status ls = second->load_state(restored);
          ASSERT_TRUE(ls) << ls.error().message;
          const auto after = take(*second, d);
          ASSERT_EQ(after.size(), whole.size() - k) << what;
          for (std::size_t i = 0; i < after.size(); ++i) {
            EXPECT_EQ(after[i].keys, whole[k + i].keys) << what << " batch " << k + i;
            EXPECT_EQ(after[i].epoch, whole[k + i].epoch) << what;
          }
        }
      }
    }
  }
}

TEST(LoaderResume, ElasticResumeAtTheSameGlobalBatch) {
  Data d(counts_for(101));
  for (std::size_t k : {0, 1, 5, 12, 13}) {  // 13 = every global batch of 8 over 101 samples
    const std::string what = fmt::format("k={}", k);
    Keys before;
    nlohmann::json state;
    for (int r = 0; r < 4; ++r) {
      auto l = open_loader(d.ds, opts(2, r, 4, true, 3));
      ASSERT_EQ(l->batches_per_epoch(), 13u);
      const auto bs = take(*l, d, k);
      ASSERT_EQ(bs.size(), k) << what;
      const Keys ks = flatten(bs);
      before.insert(before.end(), ks.begin(), ks.end());
      if (r == 0) state = l->state();
      else EXPECT_EQ(l->state(), state) << what << ": every rank holds the same state";
    }
    Keys after;
    for (int r = 0; r < 2; ++r) {
      auto l = open_loader(d.ds, opts(4, r, 2, true, 3));
      const Status ls = l->load_state(state);
      ASSERT_TRUE(ls) << ls.error().message;
      const Keys ks = flatten(take(*l, d));
      after.insert(after.end(), ks.begin(), ks.end());
    }
    Keys all = before;
    all.insert(all.end(), after.begin(), after.end());
    EXPECT_TRUE(exactly_once(all, d.keys)) << what << ": " << before.size() << " before, " << after.size() << " after";
  }
}

TEST(LoaderResume, OtherGlobalBatchStillReadsTheRestOnce) {
  Data d(counts_for(60));
  auto l = open_loader(d.ds, opts(5, 0, 1, true, 8));
  const Keys before = flatten(take(*l, d, 3));
  const auto st = l->state();
  EXPECT_EQ(st.at("position"), 15u);
  auto l2 = open_loader(d.ds, opts(7, 0, 1, true, 8));
  ASSERT_TRUE(l2->load_state(st));
  Keys all = before;
  const Keys after = flatten(take(*l2, d));
  all.insert(all.end(), after.begin(), after.end());
  EXPECT_TRUE(exactly_once(all, d.keys));
}

TEST(LoaderResume, StateAtEpochEndAndBadStates) {
  Data d(counts_for(30));
  auto l = open_loader(d.ds, opts(4, 0, 1));
  take(*l, d);
  const auto st = l->state();
  EXPECT_EQ(st.at("position"), 30u);
  auto l2 = open_loader(d.ds, opts(4, 0, 1));
  ASSERT_TRUE(l2->load_state(st));
  auto n = l2->next();
  ASSERT_TRUE(n);
  EXPECT_FALSE(*n) << "resumed at the end of the epoch: nothing left";

  auto good = l->state();
  auto bad = good;
  bad["schema"] = "other";
  EXPECT_FALSE(l2->load_state(bad));
  bad = good;
  bad["samples"] = 31;
  auto r = l2->load_state(bad);
  ASSERT_FALSE(r);
  EXPECT_TRUE(contains(r.error().message, "31"));
  bad = good;
  bad["position"] = 31;
  EXPECT_FALSE(l2->load_state(bad));
  bad = good;
  bad.erase("seed");
  EXPECT_FALSE(l2->load_state(bad));
  bad = good;
  bad["epoch"] = "one";
  EXPECT_FALSE(l2->load_state(bad));
  EXPECT_FALSE(l2->load_state(nlohmann::json::array()));
  // A failed load leaves the loader usable.
  ASSERT_TRUE(l2->load_state(nlohmann::json{{"schema", "pacer.loader/1"}, {"seed", 5}, {"epoch", 0}, {"position", 0}, {"samples", 30}}));
  EXPECT_TRUE(exactly_once(flatten(take(*l2, d)), d.keys));
}

// ---------------------------------------------------------------------------
// Looping

TEST(LoaderLoop, CrossesIntoTheNextEpochWithANewOrder) {
  Data d(counts_for(20));
  auto o = opts(4, 0, 1, true, 21);
  o.loop = true;
  auto l = open_loader(d.ds, o);
  ASSERT_EQ(l->batches_per_epoch(), 5u);
  const auto bs = take(*l, d, 15);
  ASSERT_EQ(bs.size(), 15u);
  std::vector<Keys> epochs(3);
  for (std::size_t i = 0; i < bs.size(); ++i) {
    EXPECT_EQ(bs[i].epoch, i / 5) << i;
    EXPECT_EQ(bs[i].global_batch, i % 5) << i;
    epochs[i / 5].insert(epochs[i / 5].end(), bs[i].keys.begin(), bs[i].keys.end());
  }
  for (const auto& e : epochs) EXPECT_TRUE(exactly_once(e, d.keys));
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_NE(epochs[1], epochs[2]);

  // The state mid-epoch 1 resumes there.
  auto l2 = open_loader(d.ds, o);
  take(*l2, d, 7);
  const auto st = l2->state();
  EXPECT_EQ(st.at("epoch"), 1u);
  EXPECT_EQ(st.at("position"), 8u);
  auto l3 = open_loader(d.ds, o);
  ASSERT_TRUE(l3->load_state(st));
  const auto rest = take(*l3, d, 8);
  for (std::size_t i = 0; i < rest.size(); ++i) {
    EXPECT_EQ(rest[i].keys, bs[7 + i].keys) << i;
    EXPECT_EQ(rest[i].epoch, bs[7 + i].epoch) << i;
  }

  // A state at the very end of an epoch goes on into the next.
  auto l4 = open_loader(d.ds, o);
  take(*l4, d, 5);
  auto l5 = open_loader(d.ds, o);
  ASSERT_TRUE(l5->load_state(l4->state()));
  const auto next_epoch = take(*l5, d, 5);
  ASSERT_EQ(next_epoch.size(), 5u);
  for (std::size_t i = 0; i < 5; ++i) EXPECT_EQ(next_epoch[i].keys, bs[5 + i].keys);
}

TEST(LoaderLoop, DropLastWithNoFullBatchDoesNotSpin) {
  Data d(counts_for(10));
  within(20, "Loader::open with loop and no full batch", [&] {
    auto o = opts(16, 0, 1);
    o.loop = true;
    o.drop_last = true;
    auto l = Loader::open(d.ds, o);
    if (l) {
      auto n = (*l)->next();
      EXPECT_FALSE(n && *n) << "no full batch exists";
    }
  });
}

// ---------------------------------------------------------------------------
// Bad shards

struct Truncated {
  Data d{std::vector<int>{10, 12, 9}};
  std::uint64_t bad = 0;  // samples of shard 1 past the cut
  Truncated() {
    // Load shard 1's entries, then cut it after its 5th sample.
    if (!d.ds->read(10)) throw std::runtime_error("read");
    auto idx = read_index(d.shards[1], false);
    if (!idx) throw std::runtime_error(idx.error().message);
    fs::resize_file(d.shards[1], idx->entries[5].fields[0].offset + 3);
    bad = 12 - 5;
  }
};

TEST(LoaderBadShard, SkipBadCountsSkippedSamples) {
  Truncated t;
  for (bool shuffle : {false, true}) {
    auto o = opts(4, 0, 1, shuffle);
    o.skip_bad = true;
    auto l = open_loader(t.d.ds, o);
    const auto bs = take(*l, t.d);
    EXPECT_EQ(bs.size(), l->batches_per_epoch());
    const Keys got = flatten(bs);
    const auto st = l->stats();
    EXPECT_EQ(st.skipped, t.bad);
    EXPECT_EQ(st.samples, t.d.size() - t.bad);
    EXPECT_EQ(got.size(), t.d.size() - t.bad);
    std::set<std::string> distinct(got.begin(), got.end());
    EXPECT_EQ(distinct.size(), got.size());
    for (int i = 15; i < 22; ++i) EXPECT_EQ(distinct.count(fmt::format("{:06d}", i)), 0u) << i;
  }
}

TEST(LoaderBadShard, WithoutSkipBadNextReturnsTheError) {
  Truncated t;
  auto l = open_loader(t.d.ds, opts(4, 0, 1, false));
  int errors = 0, batches = 0;
  std::string message;
  for (int i = 0; i < 20; ++i) {
    auto b = l->next();
    if (!b) {
      if (errors++ == 0) message = b.error().message;
      continue;
    }
    if (!*b) break;
    ++batches;
  }
  ASSERT_GT(errors, 0);
  EXPECT_TRUE(contains(message, t.d.shards[1]));
  EXPECT_TRUE(contains(message, "offset"));
  // Unshuffled batches of 4: batches 3..5 touch samples 15..21; the others still come.
  EXPECT_EQ(errors, 3);
  EXPECT_EQ(batches, 8 - 3);
  EXPECT_EQ(l->stats().skipped, 0u);
}

// ---------------------------------------------------------------------------
// Options

TEST(LoaderOpen, BadOptionsAreErrors) {
  Data d(counts_for(3));
  auto small = Loader::open(d.ds, opts(1, 0, 4));
  ASSERT_FALSE(small);
  EXPECT_TRUE(contains(small.error().message, "3 samples"));
  EXPECT_TRUE(Loader::open(d.ds, opts(1, 2, 3)));

  for (auto [rank, world] : std::vector<std::pair<int, int>>{{-1, 2}, {2, 2}, {5, 2}, {0, 0}, {0, -1}}) {
    auto r = Loader::open(d.ds, opts(1, rank, world));
    ASSERT_FALSE(r) << rank << " " << world;
    EXPECT_TRUE(contains(r.error().message, "rank")) << r.error().message;
  }
  EXPECT_FALSE(Loader::open(d.ds, opts(0, 0, 1)));
  EXPECT_FALSE(Loader::open(std::shared_ptr<Dataset>(), opts(1, 0, 1)));

  auto empty = Dataset::open(std::vector<std::string>{});
  ASSERT_TRUE(empty);
  EXPECT_FALSE(Loader::open(*empty, opts(1, 0, 1)));

  // Odd thread and prefetch counts are clamped, not fatal.
  auto o = opts(2, 0, 1);
  o.threads = -3;
  o.prefetch_batches = 0;
  auto l = open_loader(d.ds, o);
  ASSERT_TRUE(l);
  EXPECT_TRUE(exactly_once(flatten(take(*l, d)), d.keys));
}

TEST(LoaderTest, WithoutReaderThreadsNextReadsEveryBatch) {
  Data d(counts_for(45));
  auto o = opts(4, 0, 1);
  o.threads = 0;
  o.prefetch_batches = 3;
  auto l = open_loader(d.ds, o);
  ASSERT_TRUE(l);
  auto got = take(*l, d);
  EXPECT_TRUE(exactly_once(flatten(got), d.keys));
  EXPECT_EQ(l->stats().consumer_reads, l->stats().batches);
  EXPECT_EQ(l->stats().batches, got.size());
  // The order is the one reader threads give.
  auto r = open_loader(d.ds, opts(4, 0, 1));
  ASSERT_TRUE(r);
  EXPECT_EQ(flatten(take(*r, d)), flatten(got));
}

// ---------------------------------------------------------------------------
// Stats, memory bound, shutdown

TEST(LoaderStatsTest, CountsBatchesSamplesAndBytes) {
  Data d(counts_for(45));
  auto l = open_loader(d.ds, opts(4, 1, 2));
  EXPECT_EQ(l->stats().batches, 0u);
  std::uint64_t batches = 0, samples = 0, bytes = 0;
  for (;;) {
    auto b = l->next();
    ASSERT_TRUE(b) << b.error().message;
    if (!*b) break;
    ++batches;
    for (std::size_t i = 0; i < (*b)->size(); ++i) {
      ++samples;
      for (const auto& [ext, v] : (*b)->sample(i).fields) bytes += v.size();
    }
    const auto st = l->stats();
    EXPECT_EQ(st.batches, batches);
    EXPECT_EQ(st.samples, samples);
    EXPECT_EQ(st.bytes, bytes);
    EXPECT_GE(st.wait_s, st.last_wait_s);
    EXPECT_GE(st.last_wait_s, 0.0);
    EXPECT_LE(st.queue_depth, 3u);
  }
  const auto st = l->stats();
  EXPECT_EQ(st.batches, l->batches_per_epoch());
  EXPECT_EQ(st.skipped, 0u);
  EXPECT_GE(st.elapsed_s, 0.0);
  EXPECT_GE(st.elapsed_s, st.wait_s * 0.999 - 0.01);
  // Rank 1 of 2 reads 45/2 rounded down, given the even split of the last global batch.
  EXPECT_EQ(samples, 22u);
}

TEST(LoaderMemory, TinyMaxBytesStillMakesProgress) {
  Data d(counts_for(90));
  for (int threads : {1, 2, 4}) {
    within(30, "draining with max_bytes=1", [&] {
      auto o = opts(3, 0, 1);
      o.max_bytes = 1;
      o.threads = threads;
      o.prefetch_batches = 8;
      auto l = open_loader(d.ds, o);
      if (!l) return;
      EXPECT_TRUE(exactly_once(flatten(take(*l, d)), d.keys)) << threads;
      o.loop = true;
      auto l2 = open_loader(d.ds, o);
      EXPECT_EQ(take(*l2, d, 70).size(), 70u);
    });
  }
}

TEST(LoaderShutdown, DestroyingMidEpochDoesNotHang) {
  Data d(counts_for(200));
  within(30, "destroying loaders", [&] {
    for (int i = 0; i < 20; ++i) {
      auto o = opts(2, 0, 1);
      o.threads = 1 + i % 4;
      o.prefetch_batches = 1 + static_cast<std::uint64_t>(i % 5) * 4;
      o.loop = i % 2 == 0;
      if (i % 3 == 0) o.max_bytes = 1;
      auto l = open_loader(d.ds, o);
      if (!l) return;
      if (i % 4 != 0) take(*l, d, static_cast<std::size_t>(i));
      if (i % 5 == 1) l->set_epoch(3);
      if (i % 5 == 2) (void)l->load_state(l->state());
      l.reset();  // readers may be mid-batch
    }
  });
}

// The loader's per-sample path: read_fields hands back the index entry and
// where each field landed, the same bytes read() gives, and prefetch hints
// (any stage, any index, before or after a shard is first read) change
// nothing and never fail.
TEST(DatasetReadFields, SameBytesAsReadAndPrefetchIsOnlyAHint) {
  Data d(counts_for(60));
  for (int stage = 0; stage < 3; ++stage) {
    d.ds->prefetch(0, stage);  // before any shard is read: nothing to hint
    d.ds->prefetch(d.size(), stage);
    d.ds->prefetch(~std::uint64_t{0}, stage);
  }
  BatchBuffer buf;
  std::vector<std::uint64_t> at;
  Dataset::ReadCheck check;
  for (std::uint64_t i = 0; i < d.size(); ++i) {
    for (int stage = 2; stage >= 0; --stage) d.ds->prefetch((i * 7 + 3) % d.size(), stage);
    auto e = d.ds->read_fields(i, buf, &check, at);
    ASSERT_TRUE(e) << e.error().message;
    const SampleEntry entry = e->table->entry(e->row);
    ASSERT_EQ(at.size(), entry.fields.size());
    Fields got;
    for (std::size_t k = 0; k < at.size(); ++k)
      got.emplace_back(entry.fields[k].ext, std::string(reinterpret_cast<const char*>(buf.data() + at[k]), entry.fields[k].size));
    EXPECT_EQ(entry.key, d.keys[i]);
    EXPECT_EQ(got, d.expected.at(d.keys[i])) << i;
    auto r = d.ds->read(i);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->fields, got) << i;
  }
  EXPECT_TRUE(d.ds->confirm(check));
  EXPECT_FALSE(d.ds->read_fields(d.size(), buf, &check, at));
}

}  // namespace
}  // namespace pacer::data
