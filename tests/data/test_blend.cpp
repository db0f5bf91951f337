// Blends: the quota schedule's proportions over prefixes and windows, blend loaders over tar shards and
// token datasets, exact and elastic resume, weight changes at a resume without repeats or skips, bad
// input; SFT data: loss masks and labels through packing.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <set>

#include <fmt/format.h>

#include "data/raw_tar.hpp"
#include "pacer/data.hpp"
#include "test_util.hpp"

namespace pacer::data {
namespace {

using test::contains;
using test::TempDir;

// ---------------------------------------------------------------------------
// The schedule

// After every prefix of n draws, each count is floor or ceil of w_i n (a hair
// of slack for the rounding of the weights to 2^-32 parts).
void expect_quota(const std::vector<double>& w, std::uint64_t draws) {
  auto s = BlendSchedule::make(w, {}).value();
  double sum = 0;
  for (double x : w) sum += x;
  std::vector<std::vector<std::uint64_t>> history{s.counts()};
  for (std::uint64_t n = 1; n <= draws; ++n) {
    s.next();
    ASSERT_EQ(s.draws(), n);
    for (std::size_t i = 0; i < w.size(); ++i) {
      const double want = w[i] / sum * static_cast<double>(n);
      ASSERT_GE(static_cast<double>(s.counts()[i]), std::floor(want - 1e-6)) << "dataset " << i << " after " << n;
      ASSERT_LE(static_cast<double>(s.counts()[i]), std::ceil(want + 1e-6)) << "dataset " << i << " after " << n;
    }
    history.push_back(s.counts());
  }
  // Any window of n consecutive draws holds w_i n of dataset i, less than 2 off.
  for (std::uint64_t len : {1ull, 7ull, 64ull, 333ull})
    for (std::uint64_t a = 0; a + len <= draws; a += 13)
      for (std::size_t i = 0; i < w.size(); ++i) {
        const double got = static_cast<double>(history[a + len][i] - history[a][i]);
        ASSERT_LT(std::fabs(got - w[i] / sum * static_cast<double>(len)), 2.0) << "window " << a << "+" << len;
      }
}

TEST(BlendSchedule, EveryPrefixWithinQuotaAndWindowsWithinTwo) {
  expect_quota({0.7, 0.3}, 3000);
  expect_quota({0.5, 0.25, 0.25}, 3000);
  expect_quota({1, 2, 3, 4, 5, 6, 7}, 3000);
  expect_quota({0.001, 0.999}, 3000);
  expect_quota({0.0, 3.0, 1.0}, 1000);
  expect_quota({1.0 / 3, 1.0 / 3, 1.0 / 3}, 1000);
  // Weights where always taking the largest w_i / (c_i + 1) (D'Hondt, without
  // the upper-quota rule) overshoots the big dataset within a few draws.
  expect_quota({0.7, 0.1, 0.1, 0.1}, 1000);
  expect_quota({0.5, 0.2, 0.15, 0.1, 0.05}, 1000);
  expect_quota({0.96, 0.01, 0.01, 0.01, 0.01}, 1000);
}

TEST(BlendSchedule, ZeroWeightNeverDrawnAndCountsAreTheWholeState) {
  auto s = BlendSchedule::make({0.2, 0.0, 0.8}, {}).value();
  std::vector<std::size_t> all;
  for (int i = 0; i < 500; ++i) all.push_back(s.next());
  EXPECT_EQ(s.counts()[1], 0u);
  // Continued from the counts after 200 draws, it draws what the uninterrupted one drew.
  auto t = BlendSchedule::make({0.2, 0.0, 0.8}, {}).value();
  for (int i = 0; i < 200; ++i) t.next();
  auto u = BlendSchedule::make({0.2, 0.0, 0.8}, {}).value();
  u.set_counts(t.counts());
  for (int i = 200; i < 500; ++i) ASSERT_EQ(u.next(), all[static_cast<std::size_t>(i)]) << i;
}

TEST(BlendSchedule, BadWeightsNameTheDataset) {
  const std::vector<std::string> names{"a.tar", "b.tar"};
  auto neg = BlendSchedule::make({0.5, -1}, names);
  ASSERT_FALSE(neg);
  EXPECT_TRUE(contains(neg.error().message, "b.tar")) << neg.error().message;
  auto nan = BlendSchedule::make({std::nan(""), 1}, names);
  ASSERT_FALSE(nan);
  EXPECT_TRUE(contains(nan.error().message, "a.tar")) << nan.error().message;
  auto inf = BlendSchedule::make({std::numeric_limits<double>::infinity(), 1}, names);
  ASSERT_FALSE(inf);
  auto zero = BlendSchedule::make({0, 0}, names);
  ASSERT_FALSE(zero);
  EXPECT_TRUE(contains(zero.error().message, "not a positive number")) << zero.error().message;
  EXPECT_FALSE(BlendSchedule::make({}, {}));
}

// ---------------------------------------------------------------------------
// Blend loaders over tar shards

struct Shards {
  TempDir dir{"pacer-blend-"};
  std::shared_ptr<Dataset> ds;
  Shards(int samples, const std::string& tag) {
    test::RawTar raw;
    for (int i = 0; i < samples; ++i) raw.add(fmt::format("{}{:05d}.txt", tag, i), fmt::format("{} {}", tag, i));
    ds = Dataset::open(std::vector<std::string>{dir.file(tag + ".tar", raw.finish())}).value();
  }
};
struct Empty {
  TempDir dir{"pacer-blend-empty-"};
  std::shared_ptr<Dataset> ds;
  Empty() { ds = Dataset::open(std::vector<std::string>{dir.file("empty.tar", test::RawTar().finish())}).value(); }
};

LoaderOptions blend_opts(std::uint64_t batch, int rank, int world) {
  LoaderOptions o;
  o.batch_size = batch;
  o.seed = 11;
  o.rank = rank;
  o.world_size = world;
  o.prefetch_batches = 3;  // two reader threads, the default
  return o;
}

Blend two(const Shards& a, const Shards& b, double wa, double wb, std::uint64_t per_epoch = 40) {
  Blend bl;
  bl.datasets = {a.ds, b.ds};
  bl.weights = {wa, wb};
  bl.samples_per_epoch = per_epoch;
  return bl;
}

// (dataset, key) in blend order, the ranks' batches of each global batch laid
// end to end; `batches` global batches.
using Draws = std::vector<std::pair<int, std::string>>;
Draws read_blend(std::vector<std::unique_ptr<Loader>>& ranks, std::size_t batches) {
  Draws out;
  for (std::size_t g = 0; g < batches; ++g)
    for (auto& l : ranks) {
      auto b = l->next();
      if (!b) {
        ADD_FAILURE() << b.error().message;
        return out;
      }
      if (!*b) {
        // The end of a blend epoch: the next one follows.
        l->set_epoch(l->state()["epoch"].get<std::uint64_t>() + 1);
        b = l->next();
        if (!b || !*b) {
          ADD_FAILURE() << "no batch after the epoch";
          return out;
        }
      }
      EXPECT_EQ((*b)->datasets.size(), (*b)->keys.size());
      for (std::size_t i = 0; i < (*b)->keys.size(); ++i) out.emplace_back((*b)->datasets[i], (*b)->keys[i]);
    }
  return out;
}

std::vector<std::unique_ptr<Loader>> open_ranks(const Blend& bl, std::uint64_t batch, int world) {
  std::vector<std::unique_ptr<Loader>> out;
  for (int r = 0; r < world; ++r) out.push_back(Loader::open(bl, blend_opts(batch, r, world)).value());
  return out;
}

// Dataset d's keys as it gave them, in order.
std::vector<std::string> of(const Draws& draws, int d) {
  std::vector<std::string> out;
  for (const auto& [i, k] : draws)
    if (i == d) out.push_back(k);
  return out;
}

// Every run of `size` consecutive items of a dataset (one epoch of it) holds each key once.
void expect_epochs(const std::vector<std::string>& keys, std::size_t size) {
  for (std::size_t e = 0; e * size < keys.size(); ++e) {
    std::set<std::string> seen(keys.begin() + static_cast<long>(e * size), keys.begin() + static_cast<long>(std::min(keys.size(), (e + 1) * size)));
    EXPECT_EQ(seen.size(), std::min(keys.size(), (e + 1) * size) - e * size) << "epoch " << e << " repeats a key";
  }
}

TEST(BlendLoader, ProportionsAndEachDatasetsOwnEpochs) {
  Shards a(30, "a"), b(12, "b");
  auto ranks = open_ranks(two(a, b, 0.7, 0.3), 4, 2);
  const Draws d = read_blend(ranks, 30);  // 240 draws: 6 blend epochs of 40
  ASSERT_EQ(d.size(), 240u);
  std::uint64_t na = 0;
  for (std::size_t n = 1; n <= d.size(); ++n) {
    na += d[n - 1].first == 0;
    ASSERT_GE(static_cast<double>(na), std::floor(0.7 * static_cast<double>(n) - 1e-6)) << n;
    ASSERT_LE(static_cast<double>(na), std::ceil(0.7 * static_cast<double>(n) + 1e-6)) << n;
  }
  // b (12 items) ran out several times, each epoch of it a new permutation of all of it.
  const auto kb = of(d, 1), ka = of(d, 0);
  EXPECT_EQ(kb.size(), 72u);
  expect_epochs(kb, 12);
  expect_epochs(ka, 30);
  EXPECT_NE(std::vector<std::string>(kb.begin(), kb.begin() + 12), std::vector<std::string>(kb.begin() + 12, kb.begin() + 24));
  // Its order is its own: the same as a blend that reads only it.
  auto only_b = open_ranks(two(a, b, 0, 1), 4, 2);
  EXPECT_EQ(of(read_blend(only_b, 9), 1), kb);
}

TEST(BlendLoader, ExactResumeAndElasticResume) {
  Shards a(30, "a"), b(12, "b");
  auto full = open_ranks(two(a, b, 0.6, 0.4), 4, 2);
  const Draws want = read_blend(full, 25);  // into the third blend epoch
  for (auto [batch, world] : {std::pair<std::uint64_t, int>{4, 2}, {1, 4}, {8, 1}, {3, 1}}) {
    auto first = open_ranks(two(a, b, 0.6, 0.4), 4, 2);
    Draws got = read_blend(first, 13);  // stops inside epoch 1
    const auto state = first[0]->state();
    EXPECT_EQ(state, first[1]->state());
    ASSERT_TRUE(state.contains("blend"));
    auto rest = open_ranks(two(a, b, 0.6, 0.4), batch, world);
    for (auto& l : rest) ASSERT_TRUE(l->load_state(state)) << batch << "x" << world;
    const std::size_t global = batch * static_cast<std::uint64_t>(world);
    while (got.size() < want.size()) {
      auto more = read_blend(rest, 1);
      ASSERT_GT(more.size(), 0u);
      ASSERT_LE(more.size(), global);
      got.insert(got.end(), more.begin(), more.end());
    }
    got.resize(want.size());
    EXPECT_EQ(got, want) << "resumed at " << batch << " x " << world;
  }
}

TEST(BlendLoader, NewWeightsAtAResumeNeitherRepeatNorSkip) {
  Shards a(30, "a"), b(12, "b");
  auto first = open_ranks(two(a, b, 0.7, 0.3), 4, 2);
  Draws before = read_blend(first, 7);  // 56 draws
  const auto state = first[0]->state();
  const auto consumed = state["blend"]["consumed"].get<std::vector<std::uint64_t>>();
  EXPECT_EQ(consumed[0], of(before, 0).size());
  EXPECT_EQ(consumed[1], of(before, 1).size());

  auto second = open_ranks(two(a, b, 0.2, 0.8), 4, 2);
  for (auto& l : second) ASSERT_TRUE(l->load_state(state));
  const Draws after = read_blend(second, 20);  // 160 draws with the new weights
  std::uint64_t nb = 0;
  for (std::size_t n = 1; n <= after.size(); ++n) {
    nb += after[n - 1].first == 1;
    ASSERT_GE(static_cast<double>(nb), std::floor(0.8 * static_cast<double>(n) - 1e-6)) << n;
    ASSERT_LE(static_cast<double>(nb), std::ceil(0.8 * static_cast<double>(n) + 1e-6)) << n;
  }
  // Each dataset continues its own sequence: before + after is what reading it alone gives.
  for (int d : {0, 1}) {
    auto joined = of(before, d);
    const auto more = of(after, d);
    joined.insert(joined.end(), more.begin(), more.end());
    auto alone = open_ranks(two(a, b, d == 0 ? 1 : 0, d == 1 ? 1 : 0), 4, 2);
    const auto own = of(read_blend(alone, (joined.size() + 7) / 8), d);
    ASSERT_GE(own.size(), joined.size());
    EXPECT_EQ(joined, std::vector<std::string>(own.begin(), own.begin() + static_cast<long>(joined.size()))) << "dataset " << d;
  }
  // A state saved after the change records the new weights, and resumes exactly.
  const auto later = second[0]->state();
  EXPECT_NEAR(later["blend"]["weights"][1].get<double>(), 0.8, 1e-9);
  auto third = open_ranks(two(a, b, 0.2, 0.8), 4, 2);
  for (auto& l : third) ASSERT_TRUE(l->load_state(later));
  auto cont = read_blend(second, 3);
  EXPECT_EQ(read_blend(third, 3), cont);
}

TEST(BlendLoader, StatesOfAnotherBlendAreRefusedNamingWhatDiffers) {
  Shards a(30, "a"), b(12, "b"), c(12, "c");
  auto l = Loader::open(two(a, b, 0.5, 0.5), blend_opts(4, 0, 1)).value();
  ASSERT_TRUE(l->next());
  const auto state = l->state();

  auto other_seed_opts = blend_opts(4, 0, 1);
  other_seed_opts.seed = 12;
  auto seeded = Loader::open(two(a, b, 0.5, 0.5), other_seed_opts).value();
  auto st = seeded->load_state(state);
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.error().message, "seed")) << st.error().message;

  auto other = Loader::open(two(a, c, 0.5, 0.5), blend_opts(4, 0, 1)).value();
  st = other->load_state(state);
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.error().message, c.ds->name())) << st.error().message;

  auto plain = Loader::open(a.ds, blend_opts(4, 0, 1)).value();
  st = plain->load_state(state);
  ASSERT_FALSE(st);
  auto plain_state = plain->state();
  st = l->load_state(plain_state);
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.error().message, "blend")) << st.error().message;

  auto bad = state;
  bad["blend"]["scheduled"][0] = 1000000;
  st = l->load_state(bad);
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.error().message, "scheduled")) << st.error().message;
  bad = state;
  bad["blend"]["consumed"][0] = bad["blend"]["consumed"][0].get<std::uint64_t>() + 1;
  st = l->load_state(bad);
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.error().message, "consumed")) << st.error().message;
  bad = state;
  bad["blend"]["datasets"] = "a";
  st = l->load_state(bad);
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.error().message, "malformed")) << st.error().message;
  ASSERT_TRUE(l->load_state(state));
}

TEST(BlendLoader, BadBlendsAreErrorsNamingTheDataset) {
  Shards a(30, "a");
  Empty e;
  Blend bl;
  bl.datasets = {a.ds, e.ds};
  bl.weights = {1, 1};
  auto r = Loader::open(bl, blend_opts(4, 0, 1));
  ASSERT_FALSE(r);
  EXPECT_TRUE(contains(r.error().message, e.ds->name())) << r.error().message;
  EXPECT_TRUE(contains(r.error().message, "empty")) << r.error().message;

  bl.datasets = {a.ds, a.ds};
  bl.weights = {1, -1};
  r = Loader::open(bl, blend_opts(4, 0, 1));
  ASSERT_FALSE(r);
  EXPECT_TRUE(contains(r.error().message, "-1")) << r.error().message;
  bl.weights = {0, 0};
  EXPECT_FALSE(Loader::open(bl, blend_opts(4, 0, 1)));
  bl.weights = {1};
  EXPECT_FALSE(Loader::open(bl, blend_opts(4, 0, 1)));
}

// ---------------------------------------------------------------------------
// Token blends and SFT data

// Document d of corpus `tag`: tokens 100000 * tag + 1000 * d + i + 1; with a
// mask, the first prompt(d) tokens are the prompt.
std::uint64_t prompt(int d) { return static_cast<std::uint64_t>(d % 5); }

struct Corpus {
  TempDir dir{"pacer-blend-tokens-"};
  std::shared_ptr<TokenDataset> ds;
  Corpus(int tag, int documents, bool sft) {
    std::vector<std::vector<std::int64_t>> docs;
    std::vector<std::vector<std::uint8_t>> masks;
    for (int d = 0; d < documents; ++d) {
      const int len = 1 + (d * 37 + 11 * tag) % 45;
      std::vector<std::int64_t> doc;
      std::vector<std::uint8_t> mask;
      for (int i = 0; i < len; ++i) {
        doc.push_back(100000 * tag + 1000 * d + i + 1);
        mask.push_back(static_cast<std::uint64_t>(i) >= prompt(d) ? 1 : 0);
      }
      docs.push_back(doc);
      masks.push_back(mask);
    }
    const std::string prefix = dir.path() + "/c" + std::to_string(tag);
    if (sft) EXPECT_TRUE(write_sft_dataset(prefix, "int32", docs, masks));
    else EXPECT_TRUE(write_token_dataset(prefix, "int32", docs));
    ds = TokenDataset::open(prefix).value();
  }
};

// Checks a token batch's layout (and its labels, for SFT data); returns its real tokens row by row.
std::vector<std::vector<std::int64_t>> check_rows(const Batch& b, bool sft) {
  std::vector<std::vector<std::int64_t>> rows(b.rows);
  EXPECT_EQ(b.cu_seqlens.front(), 0);
  EXPECT_EQ(static_cast<std::uint64_t>(b.cu_seqlens.back()), b.rows * b.cols);
  EXPECT_EQ(b.cu_seqlens.size(), b.documents.size() + 1);
  EXPECT_EQ(b.datasets.size(), b.rows);
  EXPECT_EQ(b.has_labels, sft);
  for (std::size_t k = 0; k + 1 < b.cu_seqlens.size(); ++k) {
    const auto lo = static_cast<std::uint64_t>(b.cu_seqlens[k]), hi = static_cast<std::uint64_t>(b.cu_seqlens[k + 1]);
    const std::uint64_t r = lo / b.cols;
    for (std::uint64_t j = lo; j < hi; ++j) {
      EXPECT_EQ(b.position_ids()[j], static_cast<std::int32_t>(j - lo));
      const std::int64_t t = b.tokens()[j];
      if (b.documents[k] < 0) {
        EXPECT_EQ(t, 0);
        if (sft) { EXPECT_EQ(b.labels()[j], kIgnoreLabel); }
        continue;
      }
      EXPECT_EQ(t / 100000, b.datasets[r] + 1) << "row " << r << " holds its dataset's tokens";
      EXPECT_EQ((t % 100000) / 1000, b.documents[k]);
      rows[r].push_back(t);
      if (!sft) continue;
      // Trained: the next token of the same segment, when it is past its document's prompt.
      const bool next_trained = j + 1 < hi && static_cast<std::uint64_t>((b.tokens()[j + 1] % 1000) - 1) >= prompt(static_cast<int>(b.documents[k]));
      EXPECT_EQ(b.labels()[j], next_trained ? b.tokens()[j + 1] : kIgnoreLabel) << "position " << j;
      EXPECT_EQ(b.loss_mask()[j], next_trained ? 1 : 0);
    }
  }
  return rows;
}

std::vector<std::vector<std::int64_t>> drain_tokens(Loader& l, std::size_t batches, bool sft) {
  std::vector<std::vector<std::int64_t>> out;
  for (std::size_t i = 0; i < batches; ++i) {
    auto b = l.next();
    if (!b) {
      ADD_FAILURE() << b.error().message;
      break;
    }
    if (!*b) {
      l.set_epoch(l.state()["epoch"].get<std::uint64_t>() + 1);
      --i;
      continue;
    }
    for (auto& r : check_rows(**b, sft)) out.push_back(std::move(r));
  }
  return out;
}

TEST(BlendTokens, PackedAndUnpackedRowsWithResume) {
  for (bool pack : {false, true})
    for (bool sft : {false, true}) {
      Corpus a(1, 40, sft), b(2, 15, sft);
      Blend bl;
      bl.token_datasets = {a.ds, b.ds};
      bl.weights = {0.5, 0.5};
      bl.samples_per_epoch = 24;
      auto o = blend_opts(4, 0, 1);
      o.seq_len = 32;
      o.pack = pack;
      o.pack_window = 8;
      auto full = Loader::open(bl, o).value();
      const auto want = drain_tokens(*full, 15, sft);
      auto first = Loader::open(bl, o).value();
      auto got = drain_tokens(*first, 7, sft);
      const auto state = first->state();
      auto o2 = o;
      o2.batch_size = 2;
      o2.world_size = 1;
      auto rest = Loader::open(bl, o2).value();
      ASSERT_TRUE(rest->load_state(state));
      const auto more = drain_tokens(*rest, 16, sft);
      got.insert(got.end(), more.begin(), more.end());
      ASSERT_GE(got.size(), want.size());
      got.resize(want.size());
      EXPECT_EQ(got, want) << "pack " << pack << " sft " << sft;
    }
}

TEST(BlendTokens, MixedMasksAndKindsAreRefused) {
  Corpus a(1, 10, true), b(2, 10, false);
  Blend bl;
  bl.token_datasets = {a.ds, b.ds};
  bl.weights = {1, 1};
  auto r = Loader::open(bl, blend_opts(2, 0, 1));
  ASSERT_FALSE(r);
  EXPECT_TRUE(contains(r.error().message, "loss mask")) << r.error().message;
  Shards s(5, "s");
  bl.datasets = {s.ds, s.ds};
  r = Loader::open(bl, blend_opts(2, 0, 1));
  ASSERT_FALSE(r);
  EXPECT_TRUE(contains(r.error().message, "not both")) << r.error().message;
}

TEST(SftData, LabelsFollowTheMaskThroughPackingAndCuts) {
  Corpus c(1, 60, true);
  ASSERT_NE(c.ds->loss_mask(), nullptr);
  for (bool pack : {false, true}) {
    LoaderOptions o = blend_opts(4, 0, 1);
    o.seq_len = 16;  // documents up to 45 tokens: packed ones are split, unpacked ones cut
    o.pack = pack;
    auto l = Loader::open(c.ds, o).value();
    std::uint64_t trained = 0;
    while (auto b = l->next().value()) {
      // A plain loader has no blend datasets; check_rows wants one per row, all of corpus 1 (index 0).
      b->datasets.assign(b->rows, 0);
      check_rows(*b, true);
      for (std::uint64_t j = 0; j < b->rows * b->cols; ++j) trained += b->loss_mask()[j];
    }
    EXPECT_GT(trained, 0u);
  }
}

TEST(SftData, MaskOfAnotherShapeIsAnErrorNamingIt) {
  TempDir dir("pacer-sft-");
  const std::string prefix = dir.path() + "/sft";
  ASSERT_TRUE(write_sft_dataset(prefix, "int32", {{1, 2, 3}, {4, 5}}, {{0, 1, 1}, {0, 1}}));
  ASSERT_TRUE(TokenDataset::open(prefix));
  ASSERT_TRUE(write_token_dataset(sft_mask_prefix(prefix), "uint8", {{0, 1}, {0, 1}}));
  auto r = TokenDataset::open(prefix);
  ASSERT_FALSE(r);
  EXPECT_TRUE(contains(r.error().message, prefix + ".mask.idx")) << r.error().message;
  EXPECT_FALSE(write_sft_dataset(prefix, "int32", {{1, 2, 3}}, {{0, 1}}));
  EXPECT_FALSE(write_sft_dataset(prefix, "int32", {{1, 2}}, {{0, 2}}));
}

}  // namespace
}  // namespace pacer::data
