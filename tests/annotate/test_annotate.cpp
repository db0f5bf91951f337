// The annotation store, its inputs, kappa and the export.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "pacer/annotate.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/data.hpp"
#include "test_util.hpp"

namespace pacer::annotate {
namespace {

using test::contains;
using test::TempDir;
namespace fs = std::filesystem;

void write(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

struct Fixture {
  TempDir dir{"pacer-annotate-"};
  std::string db = dir.path() + "/a.db";
  std::unique_ptr<Store> store;
  Guideline g1;
  Fixture() {
    store = unwrap(Store::open(db, true));
    EXPECT_TRUE(store->bind_source(dir.path() + "/data.jsonl"));
    EXPECT_TRUE(store->set_labels({{"safe", "s", ""}, {"unsafe", "u", ""}}));
    EXPECT_TRUE(store->add_samples({{"a", "text a"}, {"b", "text b"}, {"c", "text c"}}));
    write(dir.path() + "/guide.md", "v1");
    g1 = unwrap(read_guideline(dir.path() + "/guide.md"));
    EXPECT_TRUE(store->add_guideline(g1));
  }
};

TEST(AnnotateInputs, JsonLinesIdsTextsAndMalformedLines) {
  TempDir dir("pacer-annotate-");
  const std::string p = dir.path() + "/set.jsonl";
  write(p,
        "{\"id\": \"x\", \"text\": \"hello\"}\n"
        "\n"
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n"
        "{broken\n"
        "{\"id\": 12, \"text\": \"n\"}\n"
        "{\"text\": 5}\n");
  auto s = unwrap(read_samples(p));
  ASSERT_EQ(s.samples.size(), 3u);
  EXPECT_EQ(s.samples[0].id, "x");
  EXPECT_EQ(s.samples[1].id, "set.jsonl:3");
  EXPECT_EQ(s.samples[1].text, "user: hi\nassistant: yo");
  EXPECT_EQ(s.samples[2].id, "12");
  EXPECT_EQ(s.malformed, 2u);
  ASSERT_EQ(s.malformed_at.size(), 2u);
  EXPECT_TRUE(contains(s.malformed_at[0], p + ":4"));
  EXPECT_TRUE(contains(s.malformed_at[1], p + ":6"));

  write(p, "{\"id\": \"x\", \"text\": \"1\"}\n{\"id\": \"x\", \"text\": \"2\"}\n");
  auto dup = read_samples(p);
  ASSERT_FALSE(dup);
  EXPECT_TRUE(contains(dup.error().message, p + ":2: sample id 'x' again (first at " + p + ":1)"));
}

TEST(AnnotateInputs, ShardDirectoryKeysAndIds) {
  TempDir dir("pacer-annotate-");
  const std::string src = dir.path() + "/set.jsonl";
  write(src, "{\"id\": \"x1\", \"text\": \"one\"}\n{\"messages\": [{\"role\": \"user\", \"content\": \"two\"}]}\n{\"no\": 1}\n");
  data::PackOptions o;
  o.src = src;
  o.out = dir.path() + "/shards";
  o.target_bytes = 1000;  // one sample a shard: samples are read across shards
  ASSERT_TRUE(data::pack_shards(o));
  auto s = unwrap(read_samples(o.out));
  ASSERT_EQ(s.samples.size(), 2u);
  EXPECT_EQ(s.samples[0].id, "x1");
  EXPECT_EQ(s.samples[1].id, "000000002");  // the member key without an "id" field
  EXPECT_EQ(s.samples[1].text, "user: two");
  EXPECT_EQ(s.malformed, 1u);
  EXPECT_TRUE(contains(s.malformed_at.at(0), "sample '000000003'"));
}

TEST(AnnotateInputs, LabelFileErrorsNameTheLine) {
  TempDir dir("pacer-annotate-");
  const std::string p = dir.path() + "/labels.toml";
  write(p, "[[label]]\nname = \"a\"\n[[label]]\nname = \"b\"\nkey = \"1\"\n");
  auto r = read_labels(p);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(r.error().message, p + ":3")) << r.error().message;
  EXPECT_TRUE(contains(r.error().message, "taken"));
  write(p, "[[label]]\nname = \"a\"\n[[label]]\nname = \"b\"\nkey = \"x\"\n");
  auto ok = unwrap(read_labels(p));
  ASSERT_EQ(ok.size(), 2u);
  EXPECT_EQ(ok[0].key, "1");
  EXPECT_EQ(ok[1].key, "x");
}

TEST(AnnotateStore, NextSkipUndoAndProgress) {
  Fixture f;
  ASSERT_TRUE(f.store->add_annotator("alice"));
  auto n = unwrap(f.store->next("alice"));
  ASSERT_TRUE(n.sample);
  EXPECT_EQ(n.sample->id, "a");
  ASSERT_TRUE(f.store->label("alice", "a", "safe", f.g1.version));
  ASSERT_TRUE(f.store->skip("alice", "b"));
  n = unwrap(f.store->next("alice"));
  EXPECT_EQ(n.sample->id, "c");
  EXPECT_EQ(n.progress.labelled, 1);
  EXPECT_EQ(n.progress.skipped, 1);
  ASSERT_TRUE(f.store->label("alice", "c", "unsafe", f.g1.version));
  // Only the skipped one is left: it comes back, marked.
  n = unwrap(f.store->next("alice"));
  EXPECT_EQ(n.sample->id, "b");
  EXPECT_TRUE(n.skipped_before);
  // Undo takes back the last action (the label of c), then the skip of b.
  EXPECT_EQ(unwrap(f.store->undo("alice")), std::optional<std::string>("c"));
  EXPECT_EQ(unwrap(f.store->undo("alice")), std::optional<std::string>("b"));
  n = unwrap(f.store->next("alice"));
  EXPECT_EQ(n.sample->id, "b");
  EXPECT_FALSE(n.skipped_before);
  EXPECT_EQ(unwrap(f.store->undo("alice")), std::optional<std::string>("a"));
  EXPECT_EQ(unwrap(f.store->undo("alice")), std::nullopt);
  EXPECT_EQ(unwrap(f.store->all_labels()).size(), 0u);
}

TEST(AnnotateStore, RejectsUnknownSampleLabelAndGuideline) {
  Fixture f;
  auto e = f.store->label("alice", "zz", "safe", f.g1.version);
  ASSERT_FALSE(e);
  EXPECT_TRUE(contains(e.error().message, "no sample 'zz'"));
  e = f.store->label("alice", "a", "maybe", f.g1.version);
  ASSERT_FALSE(e);
  EXPECT_TRUE(contains(e.error().message, "no label 'maybe'"));
  e = f.store->label("alice", "a", "safe", "v0000000000000000");
  ASSERT_FALSE(e);
  EXPECT_TRUE(contains(e.error().message, "no guideline version"));
  EXPECT_EQ(unwrap(f.store->all_labels()).size(), 0u);
  // A label in use cannot leave the label set.
  ASSERT_TRUE(f.store->label("alice", "a", "unsafe", f.g1.version));
  auto drop = f.store->set_labels({{"safe", "s", ""}});
  ASSERT_FALSE(drop);
  EXPECT_TRUE(contains(drop.error().message, "label 'unsafe' has 1 labels"));
}

TEST(AnnotateStore, TwoAnnotatorsOnOneSampleAtOnceKeepBothLabels) {
  Fixture f;
  // Two connections, as two server processes on one store would have.
  auto other = unwrap(Store::open(f.db, false));
  constexpr int kRounds = 50;
  auto run = [&](Store& s, const std::string& who, const std::string& label) {
    for (int i = 0; i < kRounds; ++i) ASSERT_TRUE(s.label(who, "a", label, f.g1.version));
  };
  std::thread t1(run, std::ref(*f.store), "alice", "safe");
  std::thread t2(run, std::ref(*other), "bob", "unsafe");
  t1.join();
  t2.join();
  auto all = unwrap(f.store->all_labels());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].annotator, "alice");
  EXPECT_EQ(all[0].label, "safe");
  EXPECT_EQ(all[1].annotator, "bob");
  EXPECT_EQ(all[1].label, "unsafe");
}

TEST(AnnotateStore, LabelsKeepTheGuidelineVersionTheyWereMadeUnder) {
  Fixture f;
  ASSERT_TRUE(f.store->label("alice", "a", "safe", f.g1.version));
  write(f.dir.path() + "/guide.md", "v2");
  const Guideline g2 = unwrap(read_guideline(f.dir.path() + "/guide.md"));
  EXPECT_NE(g2.version, f.g1.version);
  EXPECT_EQ(g2.version, version_id("v2"));
  ASSERT_TRUE(f.store->add_guideline(g2));
  ASSERT_TRUE(f.store->label("alice", "b", "safe", g2.version));
  auto all = unwrap(f.store->all_labels());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].guideline_version, f.g1.version);
  EXPECT_EQ(all[1].guideline_version, g2.version);
  EXPECT_EQ(unwrap(f.store->all_labels(g2.version)).size(), 1u);
}

TEST(AnnotateStore, TokensAndNames) {
  Fixture f;
  const std::string t = unwrap(f.store->add_annotator("alice"));
  EXPECT_EQ(t.size(), 32u);
  // The store holds the tokens: only its owner may read it.
  EXPECT_EQ(fs::status(f.db).permissions() & fs::perms::all, fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_EQ(f.store->annotator_for(t), std::optional<std::string>("alice"));
  EXPECT_EQ(f.store->annotator_for(""), std::nullopt);
  EXPECT_EQ(f.store->annotator_for(t + "0"), std::nullopt);
  EXPECT_FALSE(f.store->add_annotator("alice"));
  EXPECT_FALSE(f.store->add_annotator("no spaces"));
  EXPECT_NE(unwrap(f.store->add_annotator("bob")), t);
}

TEST(AnnotateStore, RefusesOtherFilesAndOtherSources) {
  Fixture f;
  auto other = f.store->bind_source(f.dir.path() + "/elsewhere.jsonl");
  ASSERT_FALSE(other);
  EXPECT_EQ(other.error().kind, ErrorKind::kUsage);
  const std::string junk = f.dir.path() + "/junk.db";
  write(junk, std::string(4096, 'x'));
  auto bad = Store::open(junk, false);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(bad.error().message, junk));
  EXPECT_FALSE(Store::open(f.dir.path() + "/none.db", false));
}

TEST(AnnotateKappa, CohenTextbookExample) {
  // 50 samples: both yes 20, yes/no 5, no/yes 10, both no 15: p_o 0.7, p_e 0.5, kappa 0.4.
  std::vector<std::pair<std::string, std::string>> pairs;
  for (int i = 0; i < 20; ++i) pairs.emplace_back("yes", "yes");
  for (int i = 0; i < 5; ++i) pairs.emplace_back("yes", "no");
  for (int i = 0; i < 10; ++i) pairs.emplace_back("no", "yes");
  for (int i = 0; i < 15; ++i) pairs.emplace_back("no", "no");
  const Kappa k = cohen_kappa(pairs);
  EXPECT_NEAR(k.observed, 0.7, 1e-12);
  EXPECT_NEAR(k.expected, 0.5, 1e-12);
  ASSERT_TRUE(k.kappa);
  EXPECT_NEAR(*k.kappa, 0.4, 1e-12);
  EXPECT_FALSE(cohen_kappa({}).kappa);
  EXPECT_FALSE(cohen_kappa({{"a", "a"}, {"a", "a"}}).kappa);  // chance agreement 1: undefined
}

TEST(AnnotateKappa, FleissTextbookExample) {
  // Fleiss (1971)'s worked example: 10 samples, 14 raters, 5 labels: P 0.378, P_e 0.213, kappa 0.210.
  const std::vector<std::vector<std::int64_t>> counts = {
      {0, 0, 0, 0, 14}, {0, 2, 6, 4, 2}, {0, 0, 3, 5, 6}, {0, 3, 9, 2, 0}, {2, 2, 8, 1, 1},
      {7, 7, 0, 0, 0},  {3, 2, 6, 3, 0}, {2, 5, 3, 2, 2}, {6, 5, 2, 1, 0}, {0, 2, 2, 3, 7}};
  const Kappa k = fleiss_kappa(counts);
  EXPECT_NEAR(k.observed, 0.378, 5e-4);
  EXPECT_NEAR(k.expected, 0.213, 5e-4);
  ASSERT_TRUE(k.kappa);
  EXPECT_NEAR(*k.kappa, 0.210, 5e-4);
  EXPECT_EQ(k.samples, 10);
  // A sample with one rater says nothing about agreement.
  auto more = counts;
  more.push_back({1, 0, 0, 0, 0});
  EXPECT_NEAR(*fleiss_kappa(more).kappa, *k.kappa, 1e-12);
}

TEST(AnnotateAgreement, MethodFollowsTheNumberOfAnnotators) {
  Fixture f;
  ASSERT_TRUE(f.store->label("alice", "a", "safe", f.g1.version));
  EXPECT_EQ(unwrap(agreement(*f.store)).method, "none");
  ASSERT_TRUE(f.store->label("bob", "a", "safe", f.g1.version));
  ASSERT_TRUE(f.store->label("alice", "b", "unsafe", f.g1.version));
  ASSERT_TRUE(f.store->label("bob", "b", "unsafe", f.g1.version));
  auto two = unwrap(agreement(*f.store));
  EXPECT_EQ(two.method, "cohen");
  ASSERT_TRUE(two.overall.kappa);
  EXPECT_NEAR(*two.overall.kappa, 1.0, 1e-12);
  ASSERT_TRUE(f.store->label("carol", "a", "unsafe", f.g1.version));
  ASSERT_TRUE(f.store->label("carol", "b", "unsafe", f.g1.version));
  auto three = unwrap(agreement(*f.store));
  EXPECT_EQ(three.method, "fleiss");
  EXPECT_EQ(three.pairs.size(), 3u);
  EXPECT_EQ(three.overall.samples, 2);
  // a: 2 safe 1 unsafe, b: 3 unsafe: P = (1/3 + 1) / 2; p = (2/6, 4/6), P_e = 5/9.
  ASSERT_TRUE(three.overall.kappa);
  EXPECT_NEAR(*three.overall.kappa, (2.0 / 3 - 5.0 / 9) / (1 - 5.0 / 9), 1e-12);
}

TEST(AnnotateExport, ManifestLinesAndAStableVersion) {
  Fixture f;
  ASSERT_TRUE(f.store->label("alice", "a", "safe", f.g1.version));
  ASSERT_TRUE(f.store->label("bob", "a", "unsafe", f.g1.version));
  const std::string out = f.dir.path() + "/set";
  auto r1 = unwrap(export_set(*f.store, out, "vdeadbeefdeadbeef"));
  EXPECT_EQ(r1.samples, 1);
  EXPECT_EQ(r1.labels, 2);
  EXPECT_EQ(r1.annotators, 2);
  auto m = nlohmann::json::parse(unwrap(read_file(out + "/manifest.json")));
  EXPECT_EQ(m["schema"], "pacer.annotations/1");
  EXPECT_EQ(m["version"], r1.version);
  EXPECT_EQ(m["source"], "vdeadbeefdeadbeef");
  EXPECT_EQ(m["labels"], nlohmann::json({"safe", "unsafe"}));
  EXPECT_EQ(m["guidelines"][0]["version"], f.g1.version);
  EXPECT_EQ(unwrap(read_file(out + "/" + m["guidelines"][0]["file"].get<std::string>())), "v1");
  const std::string lines = unwrap(read_file(out + "/labels.jsonl"));
  auto first = nlohmann::json::parse(lines.substr(0, lines.find('\n')));
  EXPECT_EQ(first["id"], "a");
  EXPECT_EQ(first["annotator"], "alice");
  EXPECT_EQ(first["text"], "text a");
  EXPECT_EQ(first["guideline_version"], f.g1.version);
  // The same labels give the same id; one more label gives another, and OUT is replaced whole.
  EXPECT_EQ(unwrap(export_set(*f.store, out, "vdeadbeefdeadbeef")).version, r1.version);
  ASSERT_TRUE(f.store->label("alice", "b", "safe", f.g1.version));
  auto r2 = unwrap(export_set(*f.store, out, "vdeadbeefdeadbeef"));
  EXPECT_NE(r2.version, r1.version);
  EXPECT_EQ(nlohmann::json::parse(unwrap(read_file(out + "/manifest.json")))["version"], r2.version);
  int entries = 0;
  for (const auto& e : fs::directory_iterator(f.dir.path())) entries += e.path().filename().string().find(".tmp-") != std::string::npos;
  EXPECT_EQ(entries, 0);
  // Some other directory is never replaced.
  fs::create_directories(f.dir.path() + "/mine");
  write(f.dir.path() + "/mine/keep.txt", "x");
  auto refused = export_set(*f.store, f.dir.path() + "/mine");
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().kind, ErrorKind::kUsage);
  EXPECT_TRUE(fs::exists(f.dir.path() + "/mine/keep.txt"));
}

}  // namespace
}  // namespace pacer::annotate
