// The loader over Megatron token datasets: packed and unpacked rows, exact-once per epoch across ranks, resume and bucketing.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <thread>

#include "pacer/data.hpp"
#include "test_util.hpp"

namespace pacer::data {
namespace {

// Token t of document d is 1000 * d + t + 1 (never the pad id 0), so every
// token names its document and place.
struct Corpus {
  test::TempDir dir{"pacer-token-loader-"};
  std::shared_ptr<TokenDataset> ds;
  std::uint64_t tokens = 0;
  explicit Corpus(int documents, int max_len = 50) {
    std::vector<std::vector<std::int64_t>> docs;
    for (int d = 0; d < documents; ++d) {
      std::vector<std::int64_t> doc;
      const int len = 1 + (d * 37 + 11) % max_len;
      for (int i = 0; i < len; ++i) doc.push_back(1000 * d + i + 1);
      tokens += doc.size();
      docs.push_back(doc);
    }
    const std::string prefix = dir.path() + "/docs";
    EXPECT_TRUE(write_token_dataset(prefix, "int32", docs));
    ds = TokenDataset::open(prefix).value();
  }
};

LoaderOptions token_opts(std::uint64_t batch, int rank, int world, bool pack) {
  LoaderOptions o;
  o.batch_size = batch;
  o.seed = 7;
  o.rank = rank;
  o.world_size = world;
  o.threads = 2;
  o.prefetch_batches = 3;
  o.seq_len = 32;
  o.pack = pack;
  o.pack_window = 16;
  return o;
}

// What a rank received: per batch, every real token, checked for layout on the way.
struct Rows {
  std::vector<std::vector<std::int64_t>> batches;  // real tokens per batch, in order
  std::uint64_t padding = 0;
};

Rows drain(Loader& l, std::size_t max = ~std::size_t{0}) {
  Rows out;
  while (out.batches.size() < max) {
    auto b = l.next();
    if (!b) {
      ADD_FAILURE() << b.error().message;
      break;
    }
    if (!*b) break;
    const Batch& batch = **b;
    EXPECT_EQ(batch.cu_seqlens.front(), 0);
    EXPECT_EQ(static_cast<std::uint64_t>(batch.cu_seqlens.back()), batch.rows * batch.cols);
    EXPECT_EQ(batch.cu_seqlens.size(), batch.documents.size() + 1);
    std::vector<std::int64_t> real;
    for (std::size_t k = 0; k + 1 < batch.cu_seqlens.size(); ++k) {
      const auto lo = static_cast<std::uint64_t>(batch.cu_seqlens[k]), hi = static_cast<std::uint64_t>(batch.cu_seqlens[k + 1]);
      EXPECT_LT(lo, hi);
      EXPECT_EQ(lo / batch.cols, (hi - 1) / batch.cols) << "a segment stays in its row";
      for (std::uint64_t i = lo; i < hi; ++i) {
        EXPECT_EQ(batch.position_ids()[i], static_cast<std::int32_t>(i - lo));
        const std::int64_t t = batch.tokens()[i];
        if (batch.documents[k] < 0) {
          EXPECT_EQ(t, 0) << "padding";
          continue;
        }
        EXPECT_EQ((t - 1) / 1000, batch.documents[k]) << "a segment holds one document";
        if (i > lo) {
          EXPECT_EQ(t, batch.tokens()[i - 1] + 1) << "document order kept in a segment";
        }
        real.push_back(t);
      }
    }
    std::uint64_t sum = 0;
    for (auto n : batch.lengths) sum += static_cast<std::uint64_t>(n);
    EXPECT_EQ(sum, real.size());
    out.padding += batch.padding;
    out.batches.push_back(std::move(real));
  }
  return out;
}

std::multiset<std::int64_t> all_tokens(const std::vector<Rows>& ranks) {
  std::multiset<std::int64_t> s;
  for (const auto& r : ranks)
    for (const auto& b : r.batches) s.insert(b.begin(), b.end());
  return s;
}

std::multiset<std::int64_t> corpus_tokens(const TokenDataset& ds, std::uint64_t cut = 0) {
  std::multiset<std::int64_t> s;
  for (std::uint64_t d = 0; d < ds.documents(); ++d) {
    const std::uint64_t n = cut ? std::min(cut, ds.document_tokens(d)) : ds.document_tokens(d);
    std::vector<std::int64_t> t(n);
    EXPECT_TRUE(ds.copy_tokens(d, 0, n, t.data()));
    s.insert(t.begin(), t.end());
  }
  return s;
}

class PackedExactOnce : public ::testing::TestWithParam<int> {};

TEST_P(PackedExactOnce, EveryTokenOncePerEpochAcrossRanks) {
  const int world = GetParam();
  Corpus c(97);
  std::vector<Rows> ranks;
  for (int r = 0; r < world; ++r) {
    auto l = Loader::open(c.ds, token_opts(3, r, world, true)).value();
    ranks.push_back(drain(*l));
    const auto st = l->stats();
    EXPECT_EQ(st.padding, ranks.back().padding);
  }
  EXPECT_EQ(all_tokens(ranks), corpus_tokens(*c.ds));
}

INSTANTIATE_TEST_SUITE_P(Ranks, PackedExactOnce, ::testing::Values(1, 2, 4));

TEST(TokenLoader, PackedRowsAreFullLengthAndTight) {
  Corpus c(97);
  auto l = Loader::open(c.ds, token_opts(4, 0, 1, true)).value();
  auto b = l->next().value().value();
  EXPECT_EQ(b.cols, 32u);
  EXPECT_EQ(b.rows, 4u);
  drain(*l);
  const auto st = l->stats();
  EXPECT_EQ(st.tokens, c.tokens);
  EXPECT_LT(st.padding_fraction(), 0.2) << "best-fit decreasing packs tightly";
  EXPECT_EQ(st.truncated, 0u) << "packing splits long documents rather than cutting them";
}

TEST(TokenLoader, NewOrderEachEpochAndSameOrderForTheSameSeed) {
  Corpus c(60);
  auto o = token_opts(4, 0, 1, true);
  auto a = Loader::open(c.ds, o).value();
  auto first = drain(*a);
  a->set_epoch(1);
  auto second = drain(*a);
  auto b = Loader::open(c.ds, o).value();
  EXPECT_EQ(drain(*b).batches, first.batches);
  EXPECT_NE(second.batches, first.batches);
}

TEST(TokenLoader, ResumeReproducesTheUninterruptedRun) {
  Corpus c(80);
  for (bool pack : {true, false}) {
    auto o = token_opts(3, 0, 1, pack);
    o.loop = true;
    auto whole = Loader::open(c.ds, o).value();
    const auto expected = drain(*whole, 40).batches;  // crosses an epoch boundary
    auto first = Loader::open(c.ds, o).value();
    auto got = drain(*first, 17).batches;
    const auto state = first->state();
    first.reset();
    auto resumed = Loader::open(c.ds, o).value();
    ASSERT_TRUE(resumed->load_state(state)) << state.dump();
    auto rest = drain(*resumed, 23).batches;
    got.insert(got.end(), rest.begin(), rest.end());
    EXPECT_EQ(got, expected) << "pack=" << pack;
  }
}

TEST(TokenLoader, ElasticResumeWithAnotherWorldSizeReadsTheRestOnce) {
  Corpus c(90);
  // 4 ranks x batch 2 read 5 global batches, then 2 ranks x batch 4 (same global batch) finish the epoch.
  std::vector<Rows> before;
  nlohmann::json state;
  for (int r = 0; r < 4; ++r) {
    auto l = Loader::open(c.ds, token_opts(2, r, 4, true)).value();
    before.push_back(drain(*l, 5));
    if (r == 0) state = l->state();
  }
  std::vector<Rows> after;
  for (int r = 0; r < 2; ++r) {
    auto l = Loader::open(c.ds, token_opts(4, r, 2, true)).value();
    ASSERT_TRUE(l->load_state(state));
    after.push_back(drain(*l));
  }
  auto got = all_tokens(before);
  for (auto t : all_tokens(after)) got.insert(t);
  EXPECT_EQ(got, corpus_tokens(*c.ds));
}

TEST(TokenLoader, UnpackedRowsAreDocumentsCutToSeqLen) {
  Corpus c(50, 60);
  for (int world : {1, 2, 4}) {
    std::vector<Rows> ranks;
    std::uint64_t truncated = 0;
    for (int r = 0; r < world; ++r) {
      auto l = Loader::open(c.ds, token_opts(3, r, world, false)).value();
      ranks.push_back(drain(*l));
      truncated += l->stats().truncated;
    }
    EXPECT_EQ(all_tokens(ranks), corpus_tokens(*c.ds, 32)) << world << " ranks";
    EXPECT_EQ(truncated, c.tokens - corpus_tokens(*c.ds, 32).size());
  }
}

TEST(TokenLoader, BucketingCutsPaddingAndKeepsExactOnce) {
  Corpus c(400, 200);
  auto plain = token_opts(8, 0, 1, false);
  plain.seq_len = 0;  // rows as long as the longest document of the batch
  auto bucketed = plain;
  bucketed.bucket_window = 8;
  auto a = Loader::open(c.ds, plain).value();
  auto ra = drain(*a);
  auto b = Loader::open(c.ds, bucketed).value();
  auto rb = drain(*b);
  EXPECT_EQ(all_tokens({rb}), corpus_tokens(*c.ds));
  EXPECT_EQ(all_tokens({ra}), corpus_tokens(*c.ds));
  EXPECT_LT(b->stats().padding_fraction(), a->stats().padding_fraction() / 2)
      << "bucketed " << b->stats().padding_fraction() << " vs plain " << a->stats().padding_fraction();
  EXPECT_NE(rb.batches, ra.batches);
}

TEST(TokenLoader, BadOptionsAndStatesAreErrors) {
  Corpus c(10);
  auto o = token_opts(2, 0, 1, true);
  o.seq_len = 0;
  EXPECT_TRUE(test::contains(Loader::open(c.ds, o).error().message, "seq_len"));
  o = token_opts(2, 0, 1, true);
  o.bucket_window = 2;
  EXPECT_FALSE(Loader::open(c.ds, o));
  o = token_opts(2, 0, 16, false);
  EXPECT_TRUE(test::contains(Loader::open(c.ds, o).error().message, "fewer than the 16 ranks"));
  EXPECT_TRUE(test::contains(Loader::open(c.ds, o).error().message, c.ds->prefix() + ": "));
  // A state from a loader that packs differently does not silently apply.
  auto packed = Loader::open(c.ds, token_opts(2, 0, 1, true)).value();
  auto unpacked = Loader::open(c.ds, token_opts(2, 0, 1, false)).value();
  auto st = unpacked->load_state(packed->state());
  ASSERT_FALSE(st);
  EXPECT_TRUE(test::contains(st.error().message, "packed seq_len=32"));
}

// Bucket windows are whole global batches, so a bucketed order depends on the
// global batch: a state saved at another global batch is refused (it would
// read some documents twice and others never); at the same global batch any
// world size resumes exactly.
TEST(TokenLoader, BucketedResumeNeedsTheSameGlobalBatch) {
  Corpus c(120, 80);
  auto bucketed = [](std::uint64_t batch, int rank, int world) {
    auto o = token_opts(batch, rank, world, false);
    o.bucket_window = 2;
    return o;
  };
  nlohmann::json state;
  std::vector<Rows> before;
  for (int r = 0; r < 2; ++r) {
    auto l = Loader::open(c.ds, bucketed(4, r, 2)).value();
    before.push_back(drain(*l, 4));
    if (r == 0) state = l->state();
  }
  EXPECT_TRUE(test::contains(state.at("order").get<std::string>(), "global_batch=8"));
  auto other = Loader::open(c.ds, bucketed(3, 0, 2)).value();
  auto st = other->load_state(state);
  ASSERT_FALSE(st) << "global batch 6 cannot continue a global-batch-8 bucketed order";
  EXPECT_TRUE(test::contains(st.error().message, "global batch 8")) << st.error().message;
  EXPECT_TRUE(test::contains(st.error().message, "is 6")) << st.error().message;

  // Same global batch, another world size: exactly the rest of the epoch.
  std::vector<Rows> after;
  for (int r = 0; r < 4; ++r) {
    auto l = Loader::open(c.ds, bucketed(2, r, 4)).value();
    ASSERT_TRUE(l->load_state(state));
    after.push_back(drain(*l));
  }
  auto got = all_tokens(before);
  for (auto t : all_tokens(after)) got.insert(t);
  EXPECT_EQ(got, corpus_tokens(*c.ds, 32));

  // A state saved before the order named the global batch applies when its global_batch matches.
  nlohmann::json legacy = state;
  legacy["order"] = "documents bucketed window=2 seq_len=32";
  auto same = Loader::open(c.ds, bucketed(8, 0, 1)).value();
  EXPECT_TRUE(same->load_state(legacy));
  auto differs = Loader::open(c.ds, bucketed(6, 0, 1)).value();
  EXPECT_FALSE(differs->load_state(legacy));
}

TEST(TokenLoader, MessagesNameTheDataset) {
  test::TempDir dir("pacer-token-loader-");
  const std::string prefix = dir.path() + "/floats";
  ASSERT_TRUE(write_token_dataset(prefix, "int32", {{1, 2}, {3}}));
  // The same layout with dtype code 7 (float32, also 4 bytes).
  std::string idx;
  {
    std::ifstream in(prefix + ".idx", std::ios::binary);
    idx.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  idx[17] = 7;
  std::ofstream(prefix + ".idx", std::ios::binary) << idx;
  auto ds = TokenDataset::open(prefix).value();
  EXPECT_EQ(ds->dtype(), "float32");
  auto l = Loader::open(ds, token_opts(1, 0, 1, false));
  ASSERT_FALSE(l);
  EXPECT_TRUE(test::contains(l.error().message, prefix + ": dtype float32 holds no token ids")) << l.error().message;

  const std::string empty = dir.path() + "/empty";
  ASSERT_TRUE(write_token_dataset(empty, "int32", {}));
  auto e = Loader::open(TokenDataset::open(empty).value(), token_opts(1, 0, 1, false));
  ASSERT_FALSE(e);
  EXPECT_TRUE(test::contains(e.error().message, empty + ": the dataset has 0 documents, fewer than the 1 ranks")) << e.error().message;
}

// Prefetch hints for any document, offset and stage are harmless and leave
// the tokens as they are.
TEST(TokenLoader, PrefetchHintsChangeNothing) {
  Corpus c(20);
  for (int stage = 0; stage < 3; ++stage)
    for (std::uint64_t d : {std::uint64_t{0}, std::uint64_t{7}, c.ds->documents(), c.ds->documents() + 5, ~std::uint64_t{0}})
      for (std::uint64_t off : {std::uint64_t{0}, std::uint64_t{3}, std::uint64_t{1} << 40}) c.ds->prefetch(d, off, stage);
  for (std::uint64_t d = 0; d < c.ds->documents(); ++d) {
    const std::uint64_t n = c.ds->document_tokens(d);
    std::vector<std::int64_t> out(n);
    ASSERT_TRUE(c.ds->copy_tokens(d, 0, n, out.data()));
    for (std::uint64_t t = 0; t < n; ++t) ASSERT_EQ(out[t], static_cast<std::int64_t>(1000 * d + t + 1)) << d << " " << t;
  }
}

// Enough documents for a loader's plan to be made on several threads (the
// order and the packing windows split between them): the batches are those
// of a plan made on one, token for token.
TEST(TokenLoader, PlanOnSeveralThreadsIsThePlanOnOne) {
  Corpus c(40000, 6);
  std::vector<std::vector<std::vector<std::int64_t>>> got;
  for (int threads : {1, 3}) {
    auto o = token_opts(64, 0, 1, true);
    o.threads = threads;
    auto l = Loader::open(c.ds, o).value();
    Rows r = drain(*l);
    std::multiset<std::int64_t> seen;
    for (const auto& b : r.batches) seen.insert(b.begin(), b.end());
    EXPECT_EQ(seen, corpus_tokens(*c.ds)) << threads << " threads";
    got.push_back(std::move(r.batches));
  }
  EXPECT_EQ(got[0], got[1]);
}

// Batch buffers outlive the loader that filled them: the next loader reads
// into memory that is already mapped (a first touch per 4 KiB page costs
// tens of microseconds on a VM).
TEST(TokenLoader, ANewLoaderReusesTheBuffersOfAClosedOne) {
  Corpus c(97);
  std::set<const unsigned char*> used;
  {
    auto l = Loader::open(c.ds, token_opts(3, 0, 1, true)).value();
    for (;;) {
      auto b = l->next().value();
      if (!b) break;
      used.insert(b->buffer->data());
    }
  }
  auto l = Loader::open(c.ds, token_opts(3, 0, 1, true)).value();
  auto b = l->next().value();
  ASSERT_TRUE(b);
  EXPECT_TRUE(used.count(b->buffer->data())) << "a new buffer, though " << used.size() << " were given back";
  EXPECT_EQ(drain(*l).batches.size() + 1, l->batches_per_epoch());
}

// A loader that went on to another epoch plans the next one on an idle
// reader once the current one is scheduled: the epoch read after it is the
// one a fresh loader reads there, with one reader or two, whether or not the
// plan was done before the next epoch was asked for.
TEST(TokenLoader, NextEpochPlannedAheadIsTheSameEpoch) {
  Corpus c(90);
  for (int threads : {1, 2})
    for (bool pack : {true, false}) {
      auto o = token_opts(4, 0, 1, pack);
      o.threads = threads;
      auto fresh = Loader::open(c.ds, o).value();
      fresh->set_epoch(2);
      const auto want = drain(*fresh).batches;
      for (int wait_ms : {0, 50}) {
        auto l = Loader::open(c.ds, o).value();
        drain(*l);
        l->set_epoch(1);
        drain(*l);
        std::this_thread::sleep_for(std::chrono::milliseconds(wait_ms));
        l->set_epoch(2);
        EXPECT_EQ(drain(*l).batches, want) << threads << " " << pack << " " << wait_ms;
      }
    }
}

}  // namespace
}  // namespace pacer::data
