// Megatron-Core indexed datasets: reading files laid out by hand, the writer, and bad input.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <map>

#include "pacer/data.hpp"
#include "test_util.hpp"

namespace pacer::data {
namespace {

using test::contains;
using test::TempDir;

template <class T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// An index written field by field from the Megatron layout, not by pacer's writer.
std::string megatron_idx(std::uint8_t code, const std::vector<std::int32_t>& lengths, const std::vector<std::int64_t>& pointers,
                         const std::vector<std::int64_t>& docs) {
  std::string s("MMIDIDX\0\0", 9);
  put<std::uint64_t>(s, 1);
  put<std::uint8_t>(s, code);
  put<std::uint64_t>(s, lengths.size());
  put<std::uint64_t>(s, docs.size());
  for (auto v : lengths) put(s, v);
  for (auto v : pointers) put(s, v);
  for (auto v : docs) put(s, v);
  return s;
}

void write(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

TEST(TokenDataset, ReadsTheMegatronLayout) {
  TempDir dir("pacer-tokens-");
  const std::string prefix = dir.path() + "/corpus_text_document";
  std::string bin;
  const std::vector<std::uint16_t> tokens = {10, 11, 12, 65535, 7, 8, 9, 1};
  for (auto t : tokens) put(bin, t);
  write(prefix + ".bin", bin);
  // Three sequences (3, 1 and 4 tokens); documents {0} and {1, 2}.
  write(prefix + ".idx", megatron_idx(8, {3, 1, 4}, {0, 6, 8}, {0, 1, 3}));
  auto ds = TokenDataset::open(prefix);
  ASSERT_TRUE(ds) << ds.error().message;
  EXPECT_EQ((*ds)->dtype(), "uint16");
  EXPECT_EQ((*ds)->sequences(), 3u);
  EXPECT_EQ((*ds)->documents(), 2u);
  EXPECT_EQ((*ds)->tokens(), 8u);
  EXPECT_EQ((*ds)->read(0).value(), (std::vector<std::int64_t>{10, 11, 12}));
  EXPECT_EQ((*ds)->read(1).value(), (std::vector<std::int64_t>{65535}));
  EXPECT_EQ((*ds)->read(2).value(), (std::vector<std::int64_t>{7, 8, 9, 1}));
  EXPECT_EQ((*ds)->document(1), (std::pair<std::uint64_t, std::uint64_t>{1, 3}));
  EXPECT_FALSE((*ds)->read(3));
}

// Found by tests/fuzz/idx.cpp: the empty arrays were copied with memcpy(nullptr, ..., 0), undefined
// behaviour that the sanitized build (sanitize.unit.*) aborts on.
TEST(TokenDataset, AnIndexWithoutSequencesOpensEmpty) {
  TempDir dir("pacer-tokens-");
  const std::string prefix = dir.path() + "/empty";
  write(prefix + ".bin", "");
  write(prefix + ".idx", megatron_idx(8, {}, {}, {0}));
  auto ds = TokenDataset::open(prefix);
  ASSERT_TRUE(ds) << ds.error().message;
  EXPECT_EQ((*ds)->sequences(), 0u);
  EXPECT_EQ((*ds)->documents(), 0u);
  EXPECT_EQ((*ds)->tokens(), 0u);
}

TEST(TokenDataset, WriterRoundTripsAndRefusesTokensThatDoNotFit) {
  TempDir dir("pacer-tokens-");
  const std::vector<std::vector<std::int64_t>> docs = {{1, 2, 3}, {}, {70000, 5}, {42}};
  for (const char* dtype : {"int32", "int64"}) {
    const std::string prefix = dir.path() + "/ds-" + dtype;
    ASSERT_TRUE(write_token_dataset(prefix, dtype, docs));
    auto ds = TokenDataset::open(prefix).value();
    EXPECT_EQ(ds->dtype(), dtype);
    ASSERT_EQ(ds->sequences(), docs.size());
    ASSERT_EQ(ds->documents(), docs.size());
    for (std::size_t i = 0; i < docs.size(); ++i) {
      EXPECT_EQ(ds->read(i).value(), docs[i]) << dtype << " " << i;
      EXPECT_EQ(ds->document(i), (std::pair<std::uint64_t, std::uint64_t>{i, i + 1}));
    }
  }
  Status st = write_token_dataset(dir.path() + "/small", "uint16", docs);
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.error().message, "70000"));
  EXPECT_FALSE(write_token_dataset(dir.path() + "/f", "float32", docs));
}

TEST(TokenDataset, BadInputNamesTheFile) {
  TempDir dir("pacer-tokens-");
  const std::string p = dir.path() + "/x";
  std::string bin(16, '\1');
  write(p + ".bin", bin);
  struct Case {
    std::string idx;
    std::string needle;
  };
  std::string truncated = megatron_idx(4, {2, 2}, {0, 8}, {0, 2});
  truncated.resize(truncated.size() - 4);
  std::string bad_version = megatron_idx(4, {2}, {0}, {0, 1});
  bad_version[9] = 2;
  const std::vector<Case> cases = {
      {"not an index at all", "MMIDIDX"},
      {truncated, "truncated"},
      {bad_version, "version 2"},
      {megatron_idx(9, {2}, {0}, {0, 1}), "dtype code 9"},
      {megatron_idx(4, {3}, {8}, {0, 1}), "outside"},       // 12 bytes from byte 8 of a 16-byte file
      {megatron_idx(4, {1, 1}, {0, 4}, {0, 2, 1}), "not a sequence boundary"},
      {megatron_idx(4, {1, 1}, {0, 6}, {0, 2}), "not on a 4-byte int32 element"},  // every token read shifted
      {megatron_idx(4, {1, 1}, {0, 4}, {1, 2}), "do not span the 2 sequences"},     // sequence 0 in no document
      {megatron_idx(4, {1, 1}, {0, 4}, {0, 1}), "do not span the 2 sequences"},     // sequence 1 in none
      {megatron_idx(4, {1, 1}, {0, 4}, {}), "do not span the 2 sequences"},
  };
  for (const auto& c : cases) {
    write(p + ".idx", c.idx);
    auto ds = TokenDataset::open(p);
    ASSERT_FALSE(ds) << c.needle;
    EXPECT_TRUE(contains(ds.error().message, p + ".idx")) << ds.error().message;
    EXPECT_TRUE(contains(ds.error().message, c.needle)) << ds.error().message;
  }
  auto missing = TokenDataset::open(dir.path() + "/nothing");
  ASSERT_FALSE(missing);
  EXPECT_TRUE(contains(missing.error().message, "nothing.idx"));
  // A .bin shorter than the .idx claims names both files.
  write(p + ".idx", megatron_idx(4, {2, 2}, {0, 8}, {0, 2}));
  write(p + ".bin", std::string(12, '\1'));
  auto short_bin = TokenDataset::open(p);
  ASSERT_FALSE(short_bin);
  EXPECT_TRUE(contains(short_bin.error().message, p + ".bin")) << short_bin.error().message;
  EXPECT_TRUE(contains(short_bin.error().message, "truncated")) << short_bin.error().message;
}

// Every dtype widens to the same ids at every length and offset: the
// vectorized loops (8 ids a step where the CPU has AVX2) and their scalar
// tails, with each type's extremes.
TEST(TokenDataset, WidensEveryDtypeAtEveryLengthAndOffset) {
  TempDir dir("pacer-tokens-");
  const std::map<std::string, std::vector<std::int64_t>> extremes = {
      {"uint8", {0, 1, 127, 128, 255}},           {"int8", {-128, -1, 0, 1, 127}},
      {"int16", {-32768, -1, 0, 1, 32767}},       {"uint16", {0, 1, 32767, 32768, 65535}},
      {"int32", {INT32_MIN, -1, 0, 1, INT32_MAX}}, {"int64", {INT64_MIN, -1, 0, 1, INT64_MAX}}};
  for (const auto& [dtype, values] : extremes) {
    std::vector<std::vector<std::int64_t>> docs;
    std::uint64_t k = 0;
    for (std::size_t len = 0; len <= 41; ++len) {
      std::vector<std::int64_t> d(len);
      for (auto& v : d) v = values[(k++ * 7 + len) % values.size()];
      docs.push_back(d);
    }
    const std::string prefix = dir.path() + "/w-" + dtype;
    ASSERT_TRUE(write_token_dataset(prefix, dtype, docs)) << dtype;
    auto ds = TokenDataset::open(prefix).value();
    for (std::size_t d = 0; d < docs.size(); ++d) {
      ASSERT_EQ(ds->read(d).value(), docs[d]) << dtype << " document " << d;
      for (std::size_t off = 0; off < docs[d].size(); off += 3) {
        const std::size_t n = docs[d].size() - off;
        std::vector<std::int64_t> out(n + 1, 42);
        ASSERT_TRUE(ds->copy_tokens(d, off, n, out.data())) << dtype;
        EXPECT_TRUE(std::equal(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(n), docs[d].begin() + static_cast<std::ptrdiff_t>(off)))
            << dtype << " document " << d << " offset " << off;
        EXPECT_EQ(out[n], 42) << dtype << ": written past the end";
      }
    }
  }
}

// Tokens are read with pread, not through a mapping: a .bin truncated while
// the dataset (and a loader over it) is open gives errors naming the file,
// where touching a mapped page past the new end would be a SIGBUS.
TEST(TokenDataset, BinTruncatedWhileOpenIsAnErrorNotACrash) {
  TempDir dir("pacer-tokens-");
  for (const char* dtype : {"uint16", "int32", "int64"}) {
    const std::string prefix = dir.path() + "/t-" + dtype;
    std::vector<std::vector<std::int64_t>> docs;
    for (int d = 0; d < 64; ++d) docs.push_back(std::vector<std::int64_t>(3000, d + 1));
    ASSERT_TRUE(write_token_dataset(prefix, dtype, docs));
    auto ds = TokenDataset::open(prefix).value();
    ASSERT_EQ(ds->read(63).value(), docs[63]);
    LoaderOptions o;
    o.batch_size = 4;
    o.shuffle = false;
    o.prefetch_batches = 1;
    o.threads = 1;
    auto loader = Loader::open(ds, o).value();
    ASSERT_TRUE(loader->next().value());  // the first batch, read before the cut
    std::filesystem::resize_file(prefix + ".bin", std::filesystem::file_size(prefix + ".bin") / 32);  // documents 0 and 1 stay
    auto r = ds->read(40);
    ASSERT_FALSE(r) << dtype;
    EXPECT_TRUE(contains(r.error().message, prefix + ".bin")) << r.error().message;
    EXPECT_TRUE(contains(r.error().message, "truncated while open")) << r.error().message;
    EXPECT_FALSE(ds->bytes(40));
    std::vector<std::int64_t> out(3000);
    EXPECT_FALSE(ds->copy_tokens(40, 0, 3000, out.data()));
    bool failed = false;
    for (int i = 0; i < 20 && !failed; ++i) {
      auto b = loader->next();
      if (!b) {
        failed = true;
        EXPECT_TRUE(contains(b.error().message, prefix + ".bin")) << b.error().message;
      } else if (!*b) {
        break;
      }
    }
    EXPECT_TRUE(failed) << dtype << ": a batch past the cut must fail";
    // What lies before the cut still reads.
    EXPECT_EQ(ds->read(1).value(), docs[1]);
  }
}

}  // namespace
}  // namespace pacer::data

namespace pacer::data {
namespace {

TEST(SequencePacking, EveryTokenOnceWithinBoundsAndDeterministic) {
  test::TempDir dir("pacer-pack-");
  std::vector<std::vector<std::int64_t>> docs;
  std::uint64_t total = 0;
  for (int d = 0; d < 40; ++d) {
    std::vector<std::int64_t> doc;
    const int len = 1 + (d * 37) % 23 + (d % 7 == 0 ? 40 : 0);  // some longer than seq_len
    for (int i = 0; i < len; ++i) doc.push_back(1000 * d + i);
    total += doc.size();
    docs.push_back(doc);
  }
  const std::string prefix = dir.path() + "/docs";
  ASSERT_TRUE(write_token_dataset(prefix, "int32", docs));
  auto ds = TokenDataset::open(prefix).value();
  std::vector<std::uint64_t> order(docs.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = (i * 17) % docs.size();  // a permutation
  const std::uint64_t seq_len = 32;
  PackStats stats;
  auto packed = pack_documents(*ds, order, seq_len, 8, -1, &stats).value();

  std::map<std::int64_t, int> seen;
  for (const auto& s : packed) {
    ASSERT_EQ(s.tokens.size(), seq_len);
    ASSERT_EQ(s.position_ids.size(), seq_len);
    ASSERT_EQ(s.cu_seqlens.front(), 0);
    ASSERT_EQ(s.cu_seqlens.size(), s.documents.size() + 1);
    for (std::size_t p = 0; p + 1 < s.cu_seqlens.size(); ++p) {
      const auto lo = s.cu_seqlens[p], hi = s.cu_seqlens[p + 1];
      ASSERT_LT(lo, hi);
      for (auto i = lo; i < hi; ++i) {
        EXPECT_EQ(s.position_ids[static_cast<std::size_t>(i)], i - lo);
        const std::int64_t t = s.tokens[static_cast<std::size_t>(i)];
        EXPECT_EQ(static_cast<std::uint64_t>(t / 1000), s.documents[p]) << "a piece holds one document";
        if (i > lo) {
          EXPECT_EQ(t, s.tokens[static_cast<std::size_t>(i - 1)] + 1) << "document order kept inside a piece";
        }
        ++seen[t];
      }
    }
    for (std::size_t i = static_cast<std::size_t>(s.cu_seqlens.back()); i < seq_len; ++i) EXPECT_EQ(s.tokens[i], -1);
  }
  EXPECT_EQ(seen.size(), total);
  for (const auto& [t, n] : seen) EXPECT_EQ(n, 1) << "token " << t;
  EXPECT_EQ(stats.tokens, total);
  EXPECT_EQ(stats.sequences, packed.size());
  EXPECT_EQ(stats.padding, packed.size() * seq_len - total);
  EXPECT_LT(stats.padding_fraction(), 0.2) << "best-fit should pack tightly";

  auto again = pack_documents(*ds, order, seq_len, 8, -1).value();
  ASSERT_EQ(again.size(), packed.size());
  for (std::size_t i = 0; i < packed.size(); ++i) EXPECT_EQ(again[i].tokens, packed[i].tokens);
  EXPECT_FALSE(pack_documents(*ds, {999}, seq_len, 8, -1));
  EXPECT_FALSE(pack_documents(*ds, order, 0, 8, -1));
}

// Best-fit decreasing as the docs state it, written the plain way (a list of
// rows, each searched for the tightest fit): the plan must match it exactly,
// on one thread or several.
PackPlan reference_plan(const TokenDataset& ds, const std::vector<std::uint64_t>& order, std::uint64_t seq_len, std::uint64_t window) {
  PackPlan plan;
  plan.seq_len = seq_len;
  for (std::size_t w = 0; w < order.size(); w += window) {
    std::vector<PackPiece> pieces;
    for (std::size_t k = w; k < std::min<std::size_t>(order.size(), w + window); ++k) {
      const std::uint64_t n = ds.document_tokens(order[k]);
      for (std::uint64_t off = 0; off < n; off += seq_len) pieces.push_back({order[k], off, std::min(seq_len, n - off)});
    }
    std::stable_sort(pieces.begin(), pieces.end(), [](const PackPiece& a, const PackPiece& b) { return a.length > b.length; });
    std::vector<std::vector<PackPiece>> rows;
    std::vector<std::uint64_t> room;
    for (const auto& p : pieces) {
      std::size_t best = rows.size();
      for (std::size_t r = 0; r < rows.size(); ++r)
        if (room[r] >= p.length && (best == rows.size() || room[r] < room[best])) best = r;
      if (best == rows.size()) {
        rows.emplace_back();
        room.push_back(seq_len);
      }
      rows[best].push_back(p);
      room[best] -= p.length;
      plan.stats.tokens += p.length;
    }
    for (std::size_t r = 0; r < rows.size(); ++r) {
      plan.pieces.insert(plan.pieces.end(), rows[r].begin(), rows[r].end());
      plan.first_piece.push_back(plan.pieces.size());
      plan.stats.padding += room[r];
    }
  }
  plan.stats.sequences = plan.rows();
  return plan;
}

TEST(SequencePacking, PlanIsBestFitDecreasingOnAnyNumberOfThreads) {
  test::TempDir dir("pacer-plan-");
  std::vector<std::vector<std::int64_t>> docs;
  std::uint64_t x = 12345;
  for (int d = 0; d < 3000; ++d) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    const std::uint64_t len = 1 + (x >> 33) % 90 + ((x >> 20) % 13 == 0 ? 150 : 0);  // some longer than seq_len
    docs.emplace_back(len, d % 1000 + 1);
  }
  const std::string prefix = dir.path() + "/docs";
  ASSERT_TRUE(write_token_dataset(prefix, "uint16", docs));
  auto ds = TokenDataset::open(prefix).value();
  const Permutation perm(docs.size(), 5, 1);
  std::vector<std::uint64_t> order(docs.size());
  perm.fill(0, order.size(), order.data());
  const std::uint64_t seq_len = 128, window = 40;  // 75 windows: enough for 4 threads
  const PackPlan want = reference_plan(*ds, order, seq_len, window);
  for (int threads : {1, 2, 4}) {
    const PackPlan got = plan_packing(*ds, order, seq_len, window, threads).value();
    ASSERT_EQ(got.first_piece, want.first_piece) << threads << " threads";
    ASSERT_EQ(got.pieces.size(), want.pieces.size());
    for (std::size_t k = 0; k < want.pieces.size(); ++k) {
      ASSERT_EQ(got.pieces[k].document, want.pieces[k].document) << threads << " threads, piece " << k;
      ASSERT_EQ(got.pieces[k].offset, want.pieces[k].offset);
      ASSERT_EQ(got.pieces[k].length, want.pieces[k].length);
    }
    EXPECT_EQ(got.stats.tokens, want.stats.tokens);
    EXPECT_EQ(got.stats.padding, want.stats.padding);
    EXPECT_EQ(got.stats.sequences, want.stats.sequences);
  }
  // A document out of range is an error from whichever thread finds it: the last run's, or the
  // first run's (which packs into the plan itself).
  order[order.size() - 3] = docs.size();
  EXPECT_FALSE(plan_packing(*ds, order, seq_len, window, 4));
  order[order.size() - 3] = 0;
  order[2] = docs.size();
  EXPECT_FALSE(plan_packing(*ds, order, seq_len, window, 4));
  EXPECT_FALSE(plan_packing(*ds, order, seq_len, window, 2));
}

}  // namespace
}  // namespace pacer::data

namespace pacer::data {
namespace {

TEST(Tokenize, GreedyLongestMatchWithByteFallbackIsLossless) {
  test::TempDir dir("pacer-tok-");
  const std::string vocab_path = dir.file("vocab.txt", "the\nth\n \ncat\nc\n");
  auto vocab = Vocabulary::load(vocab_path).value();
  EXPECT_EQ(vocab.size(), 5u);
  const auto ids = vocab.encode("the cat thé");
  // "the" " " "cat" " " "th" then the two UTF-8 bytes of é by fallback.
  EXPECT_EQ(ids, (std::vector<std::int64_t>{0, 2, 3, 2, 1, 5 + 0xC3, 5 + 0xA9}));
  EXPECT_EQ(vocab.decode(ids), "the cat thé");
  EXPECT_EQ(Vocabulary::bytes_only().encode("ab"), (std::vector<std::int64_t>{'a', 'b'}));

  auto dup = Vocabulary::load(dir.file("dup.txt", "a\nb\na\n"));
  ASSERT_FALSE(dup);
  EXPECT_TRUE(test::contains(dup.error().message, "dup.txt:3"));
}

}  // namespace
}  // namespace pacer::data
