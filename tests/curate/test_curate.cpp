// pacer curate: version ids and the store, lineage and diffs, sample text and ids (the simdjson path
// against the nlohmann reference, the block reader), filter expressions (parsing untrusted text,
// evaluation, unknown scores), dedup (exact and near), decontamination, and fastText training,
// evaluation and classification (against libfasttext's own predictLine) with bad models.
#include <fasttext/fasttext.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "curate/curate_internal.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/curate.hpp"
#include "pacer/data.hpp"
#include "test_util.hpp"

namespace pacer::curate {
namespace {

using nlohmann::json;
using test::contains;
using test::TempDir;

std::string jsonl(const std::vector<std::string>& texts) {
  std::string out;
  for (const auto& t : texts) out += json{{"text", t}}.dump() + "\n";
  return out;
}

const std::vector<std::string> kSafe = {"the cat sat on the warm mat and purred softly in the sun",
                                        "please share a recipe for bread with flour water salt and yeast",
                                        "how do i plant tomatoes in my garden this spring",
                                        "the library opens at nine and closes at five on weekdays",
                                        "a gentle walk by the river helps me relax after work"};
const std::vector<std::string> kUnsafe = {"how do i build a weapon to hurt my neighbour badly",
                                          "tell me how to poison someone without being caught",
                                          "explain how to break into a house and steal everything",
                                          "write a threat to scare and hurt my coworker",
                                          "how can i hurt people with a homemade weapon"};

// An annotation set (schema pacer.annotations/1) with `copies` variants of each text.
std::string annotation_set(const TempDir& dir, int copies) {
  std::string labels;
  int n = 0;
  for (int c = 0; c < copies; ++c)
    for (const auto& [texts, label] : {std::pair{&kSafe, "safe"}, std::pair{&kUnsafe, "unsafe"}})
      for (const auto& t : *texts) {
        const std::string id = fmt::format("s{}", n++);
        const std::string text = fmt::format("{} variant {}", t, c);
        labels += json{{"id", id}, {"label", label}, {"annotator", "a"}, {"time", "2026-12-01T00:00:00Z"}, {"guideline_version", "v0"}, {"text", text}}
                      .dump() + "\n";
      }
  // A tie (one vote each way): skipped.
  labels += json{{"id", "tie"}, {"label", "safe"}, {"annotator", "a"}, {"text", "x"}}.dump() + "\n";
  labels += json{{"id", "tie"}, {"label", "unsafe"}, {"annotator", "b"}, {"text", "x"}}.dump() + "\n";
  labels += "{not json\n";
  dir.file("ann/labels.jsonl", labels);
  dir.file("ann/manifest.json", json{{"schema", "pacer.annotations/1"}, {"version", "v00000000000000aa"}, {"source", "test"},
                                     {"labels", {"safe", "unsafe"}}, {"guidelines", json::array()}, {"annotators", 2}, {"samples", n + 1}}
                                    .dump());
  return dir.path() + "/ann";
}

TEST(CurateVersion, IdsAreContentDerived) {
  const std::string a = version_id({{"step", "raw"}, {"x", 1}});
  EXPECT_TRUE(is_version_id(a));
  EXPECT_EQ(a, version_id({{"x", 1}, {"step", "raw"}}));  // key order does not matter
  EXPECT_NE(a, version_id({{"step", "raw"}, {"x", 2}}));
  EXPECT_FALSE(is_version_id("v123"));
  EXPECT_FALSE(is_version_id("v00000000000000AG"));
}

TEST(CurateSamples, TextAndIds) {
  json chat = json::parse(R"({"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"hello"}]})");
  EXPECT_EQ(sample_text(chat).value(), "user: hi\nassistant: hello");
  EXPECT_FALSE(sample_text(json::parse(R"({"messages":[{"role":"user"}]})")));
  EXPECT_FALSE(sample_text(json::parse(R"({"text": 3})")));
  EXPECT_EQ(sample_id(json::parse(R"({"id": 42})"), "f:1"), "42");
  EXPECT_EQ(sample_id(json::parse(R"({"id": "a"})"), "f:1"), "a");
  EXPECT_EQ(sample_id(json::parse(R"({"text": "a"})"), "f:1"), "f:1");
  EXPECT_EQ(normalise("  Hello \n\t World  "), "hello world");
  EXPECT_EQ(words("Don't stop, 42!"), (std::vector<std::string>{"don", "t", "stop", "42"}));
}

// Lines that tell the simdjson path from nlohmann's: escapes, surrogates, a BOM, duplicate keys, chat
// samples well and badly formed, ids of every JSON type, numbers outside double and int64, bytes that
// are not UTF-8, control characters, deep nesting and trailing content.
std::vector<std::string> tricky_lines() {
  std::vector<std::string> v = {
      R"({"text": "plain"})",
      R"({"id": "p1", "text": "tab\there, line\nbreak, quote \" slash \/ backslash \\ and \u00e9\u4e2d"})",
      R"({"text": "pair \ud834\udd1e, nul \u0000 inside"})",
      R"({"text": "lone \ud800 high"})",
      R"({"text": "lone \udc00 low"})",
      R"({"text": "bad \x escape"})",
      "\xEF\xBB\xBF{\"text\": \"after a byte order mark\"}",
      R"({"text": "first", "text": "second wins"})",
      R"({"text": "kept", "text": 3})",
      R"({"text": 3, "text": "string last"})",
      R"({"te\u0078t": "escaped key"})",
      R"({"messages": [{"role": "user", "content": "hi\nthere"}, {"role": "assistant", "content": "hello"}]})",
      R"({"messages": []})",
      R"({"messages": [{"role": "user"}]})",
      R"({"messages": [{"role": "user", "content": 7}]})",
      R"({"messages": [{"role": "a", "role": "b", "content": "c", "content": "d"}]})",
      R"({"messages": [{"role": "a", "content": "c", "content": null}]})",
      R"({"messages": ["not an object"]})",
      R"({"messages": {"role": "user"}})",
      R"({"messages": [{"role": "user", "content": "x"}], "text": "text first"})",
      R"({"text": "no messages", "messages": 5})",
      R"({"id": 42, "text": "a"})",
      R"({"id": -7, "text": "a"})",
      R"({"id": -0, "text": "a"})",
      R"({"id": 18446744073709551615, "text": "a"})",
      R"({"id": 18446744073709551616, "text": "a"})",
      R"({"id": -9223372036854775808, "text": "a"})",
      R"({"id": -9223372036854775809, "text": "a"})",
      R"({"id": 1.0, "text": "a"})",
      R"({"id": 1e2, "text": "a"})",
      R"({"id": true, "text": "a"})",
      R"({"id": null, "text": "a"})",
      R"({"id": {"x": 1}, "text": "a"})",
      R"({"id": "a", "id": 5, "text": "a"})",
      R"({"n": 1e400, "text": "a"})",
      R"({"n": 1.5e-400, "text": "a"})",
      R"({"n": 01, "text": "a"})",
      R"({"n": tru, "text": "a"})",
      R"({"n": [1, 2, {"deep": [null, false]}], "text": "nested"})",
      "{\"text\": \"not utf-8 \xff\"}",
      "{\"text\": \"overlong \xc0\xaf\"}",
      "{\"text\": \"raw control \x01\"}",
      "{\"text\": \"raw tab \t inside\"}",
      R"({"text": "a"} trailing)",
      R"({"text": "a"}{"text": "b"})",
      R"({"text": "a",})",
      R"({"text": "a")",
      " \t{\"text\": \"spaces around\"} \t",
      R"([1, 2])",
      R"("a string")",
      R"(3)",
      R"(null)",
      R"({})",
      R"({"other": "no text"})",
      "{\"text\": \"" + std::string(1 << 20, 'w') + "\"}",  // over the fast path's limit
  };
  std::string deep;
  for (int i = 0; i < 3000; ++i) deep += "[";
  v.push_back(R"({"text": "deep", "n": )" + deep + std::string(3000, ']') + "}");
  return v;
}

// Both parsers on one sample of `kind`: the same verdict, text, id and reason.
void expect_same(SampleParser& p, RawSample::Kind kind, const std::string& line) {
  std::string padded = line + std::string(64, '\0');  // the padding the block reader leaves
  RawChunk c;
  Input in{"/data/set.jsonl", "jsonl", 0, ""};
  c.in = &in;
  c.base = "set.jsonl";
  RawSample s{kind, 9, std::string_view(padded.data(), line.size()), "k9"};
  std::string_view ft, rt;
  std::string fid, rid, fwhy, rwhy;
  const bool fast = p.parse(c, s, ft, &fid, fwhy);
  const std::string ftext(ft);
  const bool ref = p.parse_reference(c, s, rt, &rid, rwhy);
  const std::string shown = line.substr(0, 200);
  ASSERT_EQ(fast, ref) << shown << " | fast: " << fwhy << " | reference: " << rwhy;
  if (ref) {
    EXPECT_EQ(ftext, std::string(rt)) << shown;
    EXPECT_EQ(fid, rid) << shown;
  } else {
    EXPECT_EQ(fwhy, rwhy) << shown;
  }
}

TEST(CurateSamples, FastParserMatchesReference) {
  SampleParser p;
  for (const auto& line : tricky_lines()) {
    expect_same(p, RawSample::Kind::kJsonLine, line);
    expect_same(p, RawSample::Kind::kShardJson, line);
  }
  // Mutants of well-formed lines: bytes replaced, dropped or duplicated.
  const std::vector<std::string> seeds = {
      R"({"id": "s1", "text": "caf\u00e9 \"quoted\"\nnext", "meta": {"n": [1, -2.5e3, true, null]}})",
      R"({"id": 12, "messages": [{"role": "user", "content": "q\u0041"}, {"role": "assistant", "content": "a\\b"}]})"};
  const std::string alphabet = "{}[]\":,\\ \nutrf0-.e\x80\xff";
  std::uint64_t x = 0x9e3779b97f4a7c15ull;
  auto rnd = [&](std::uint64_t n) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return x % n;
  };
  for (int i = 0; i < 3000; ++i) {
    std::string m = seeds[i % seeds.size()];
    for (int k = 0, edits = 1 + static_cast<int>(rnd(3)); k < edits; ++k) {
      const std::size_t at = rnd(m.size());
      switch (rnd(3)) {
        case 0: m[at] = alphabet[rnd(alphabet.size())]; break;
        case 1: m.erase(at, 1); break;
        default: m.insert(at, 1, m[at]); break;
      }
    }
    expect_same(p, RawSample::Kind::kJsonLine, m);
  }
}

TEST(CurateSamples, BlockReaderLinesAndRows) {
  TempDir dir("curate_blocks");
  // CRLF, blank and whitespace-only lines, a line longer than two read blocks, no final newline.
  const std::string big = std::string(9 << 20, 'b');
  const std::string f = dir.file("r.jsonl", "{\"text\": \"one\"}\r\n\n   \t\r\n{\"text\": \"two\"}\n{\"text\": \"" + big + "\"}\n{bad\n{\"text\": \"last\"}");
  auto in = describe_input(f).value();
  for (int workers : {1, 3}) {
    std::vector<std::uint64_t> rows, seen;
    std::vector<std::size_t> sizes;
    ASSERT_TRUE(for_each_raw_chunk(
        {in},
        [&](RawChunk& c) -> Status {
          for (const auto& s : c.samples) seen.push_back(s.row), sizes.push_back(s.bytes.size());
          return {};
        },
        &rows, workers));
    EXPECT_EQ(rows, std::vector<std::uint64_t>{7});
    EXPECT_EQ(seen, (std::vector<std::uint64_t>{1, 4, 5, 6, 7}));
    EXPECT_EQ(sizes, (std::vector<std::size_t>{15, 15, big.size() + 12, 4, 16}));
  }
  Malformed bad;
  std::vector<std::string> texts;
  ASSERT_TRUE(for_each_sample({in}, false, bad, [&](Sample& s) -> Status {
    texts.push_back(s.text.size() > 10 ? "big" : s.text);
    return {};
  }));
  EXPECT_EQ(texts, (std::vector<std::string>{"one", "two", "big", "last"}));
  ASSERT_EQ(bad.count, 1u);
  EXPECT_EQ(bad.first[0], f + ":6: not valid JSON");
}

TEST(CurateStore, RawVersionsAndMalformedLines) {
  TempDir dir("curate_store");
  const std::string f = dir.file("a.jsonl", jsonl({"one"}) + "{bad\n\n[1]\n" + jsonl({"two"}) + R"({"id": 7, "text": "three"})" "\n");
  auto store = Store::open(dir.path() + "/store").value();
  auto m = store.add_raw({f}).value();
  EXPECT_EQ(m.counts["samples"], 3);
  EXPECT_EQ(m.counts["malformed"], 2);
  EXPECT_EQ(store.add_raw({f}).value().version, m.version);  // the same content, the same id
  auto vs = load_samples(store, m, true, false).value();
  ASSERT_EQ(vs.samples.size(), 3u);
  EXPECT_EQ(vs.samples[0].id, "a.jsonl:1");
  EXPECT_EQ(vs.samples[1].id, "a.jsonl:5");
  EXPECT_EQ(vs.samples[2].id, "7");
  ASSERT_EQ(vs.malformed.count, 2u);
  EXPECT_TRUE(contains(vs.malformed.first[0], "a.jsonl:2: not valid JSON"));
  EXPECT_TRUE(contains(vs.malformed.first[1], "a.jsonl:4: not a JSON object"));
  auto strict = load_samples(store, m, true, true);
  ASSERT_FALSE(strict);
  EXPECT_EQ(strict.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(strict.error().message, "a.jsonl:2"));
  // The file changes: another version.
  dir.file("a.jsonl", jsonl({"one", "two"}));
  EXPECT_NE(store.add_raw({f}).value().version, m.version);
  auto missing = store.add_raw({dir.path() + "/nope.jsonl"});
  ASSERT_FALSE(missing);
  EXPECT_TRUE(contains(missing.error().message, "nope.jsonl"));
  auto unknown = store.read("v0123456789abcdef");
  ASSERT_FALSE(unknown);
  EXPECT_EQ(unknown.error().kind, ErrorKind::kUsage);
}

TEST(CurateExpr, ParsesClausesAndEvaluates) {
  auto e = Expr::parse("safety > 0.9 and not dup and (lang == \"en\" or lang == 'de')").value();
  EXPECT_EQ(e.clauses(), (std::vector<std::string>{"safety > 0.9", "not dup", "(lang == \"en\" or lang == 'de')"}));
  EXPECT_EQ(e.columns(), (std::vector<std::string>{"dup", "lang", "safety"}));
  json safety = 0.95, dup = false, lang = "de";
  auto v = [&](const std::string& n) -> const json& { return n == "safety" ? safety : n == "dup" ? dup : lang; };
  EXPECT_TRUE(e.eval_clause(0, v) && e.eval_clause(1, v) && e.eval_clause(2, v));
  safety = nullptr;  // a null fails every comparison
  EXPECT_FALSE(e.eval_clause(0, v));
  lang = "fr";
  EXPECT_FALSE(e.eval_clause(2, v));
  lang = 3;  // a comparison of different types is false
  EXPECT_FALSE(e.eval_clause(2, v));
}

TEST(CurateExpr, UntrustedTextGivesErrors) {
  for (const std::string& bad : std::vector<std::string>{"", "safety >", "safety > > 1", "(safety > 1", "a == \"open", "a $ b", "a < b < c", "and", "not", "1e999 > a",
                                std::string(5000, 'a'), std::string(100, '(') + "a" + std::string(100, ')'), std::string(200, 'n') + "ot a",
                                std::string("a\0b", 3)}) {
    auto e = Expr::parse(bad);
    EXPECT_FALSE(e) << bad;
    if (!e) {
      EXPECT_EQ(e.error().kind, ErrorKind::kUsage);
    }
  }
  std::string deep;
  for (int i = 0; i < 100; ++i) deep += "not ";
  auto e = Expr::parse(deep + "a");
  ASSERT_FALSE(e);
  EXPECT_TRUE(contains(e.error().message, "nested deeper"));
  auto col = Expr::parse("a >= 1 and b $");
  ASSERT_FALSE(col);
  EXPECT_TRUE(contains(col.error().message, "column 14"));
}

TEST(CurateDedup, ExactAndNearWithinAndAcross) {
  TempDir dir("curate_dedup");
  // 60 words; the near copy changes one in the middle (5 of 56 shingles: Jaccard 51/61 = 0.84).
  const std::string base =
      "the quick brown fox jumps over the lazy dog while the farmer watches from the old wooden fence near the barn "
      "and the children play football in the green field behind the school where their teacher reads a long story "
      "about pirates sailing across stormy seas toward an island full of hidden treasure maps and golden coins buried deep";
  std::string near = base;
  near.replace(near.find("football"), 8, "cricket");
  const std::string other = "an entirely different sentence about programming languages compilers and the joy of fast builds on small machines";
  std::string upper = base;
  upper[0] = 'T';
  const std::string f = dir.file("d.jsonl", jsonl({base, "  " + upper + " ", near, other}));
  const std::string g = dir.file("e.jsonl", jsonl({other + " today"}));
  auto store = Store::open(dir.path() + "/store").value();
  auto raw = store.add_raw({f}).value();
  DedupOptions o;
  o.against = {g};
  auto r = dedup(store, raw, o).value();
  EXPECT_EQ(r.samples, 4u);
  EXPECT_EQ(r.exact, 1u);
  EXPECT_EQ(r.near, 2u);  // the edited copy, and `other` against e.jsonl
  const Column* dupc = nullptr;
  const Column* of = nullptr;
  for (const auto& c : r.version.columns) {
    if (c.name == "dup") dupc = &c;
    if (c.name == "dup_of") of = &c;
  }
  ASSERT_TRUE(dupc && of);
  auto d = read_column(*dupc).value()[0];
  EXPECT_EQ(d, (std::vector<json>{false, true, true, true}));
  auto o2 = read_column(*of).value()[0];
  EXPECT_EQ(o2[1], "d.jsonl:1");
  EXPECT_EQ(o2[3], "e.jsonl:1");
  // A higher threshold than the pair's similarity keeps the edited copy.
  o.threshold = 0.99;
  o.against.clear();
  EXPECT_EQ(dedup(store, raw, o).value().near, 0u);
}

TEST(CurateDecontaminate, ThirteenGramsOfBenchmarks) {
  TempDir dir("curate_decon");
  const std::string question = "what is the capital city of the country that lies directly north of the united states of america";
  const std::string f = dir.file("d.jsonl", jsonl({"A student asked: " + question + "? Please answer.", "a sample about gardening and tomatoes"}));
  const std::string b = dir.file("bench.jsonl", json{{"question", question}, {"answer", "Ottawa"}}.dump() + "\nshort line\n");
  auto store = Store::open(dir.path() + "/store").value();
  auto raw = store.add_raw({f}).value();
  DecontaminateOptions o;
  o.benchmarks = {b};
  auto r = decontaminate(store, raw, o).value();
  EXPECT_EQ(r.contaminated, 1u);
  EXPECT_EQ(r.short_lines, 1u);
  EXPECT_EQ(r.benchmark_lines, 2u);
  auto f2 = filter(store, r.version, "not contaminated", false).value();
  EXPECT_EQ(f2.kept, 1u);
  EXPECT_EQ(f2.dropped, 1u);
}

TEST(CurateFilter, VersionsLineageAndDiff) {
  TempDir dir("curate_filter");
  const std::string f = dir.file("d.jsonl", jsonl({"alpha beta", "alpha beta", "gamma delta", "epsilon"}));
  auto store = Store::open(dir.path() + "/store").value();
  auto raw = store.add_raw({f}).value();
  auto unknown = filter(store, raw, "safety > 0.5", false);
  ASSERT_FALSE(unknown);
  EXPECT_EQ(unknown.error().kind, ErrorKind::kUsage);
  EXPECT_TRUE(contains(unknown.error().message, "unknown score 'safety'"));
  DedupOptions o;
  o.near = false;
  auto d = dedup(store, raw, o).value();
  // A score imported from elsewhere (a Python callable).
  const std::string scores = dir.file("len.jsonl", R"({"input":0,"row":1,"value":10})" "\n" R"({"input":0,"row":2,"value":10})" "\n"
                                                   R"({"input":0,"row":3,"value":11})" "\n" R"({"input":0,"row":4,"value":1})" "\n");
  auto imp = import_scores(store, d.version, "length", scores, {{"callable", "len"}}).value();
  auto r = filter(store, imp, "not dup and length > 5", false).value();
  EXPECT_EQ(r.kept, 2u);
  ASSERT_EQ(r.clauses.size(), 2u);
  EXPECT_EQ(r.clauses[0].dropped, 1u);
  EXPECT_EQ(r.clauses[1].failed, 1u);
  EXPECT_EQ(r.clauses[1].dropped, 1u);
  EXPECT_EQ(filter(store, imp, "not dup and length > 5", false).value().version.version, r.version.version);  // rerun: the same id
  auto chain = lineage(store, r.version.version).value();
  ASSERT_EQ(chain.size(), 4u);
  EXPECT_EQ(chain[0].step, "filter");
  EXPECT_EQ(chain[1].step, "import");
  EXPECT_EQ(chain[2].step, "dedup");
  EXPECT_EQ(chain[3].step, "raw");
  auto df = diff(store, raw.version, r.version.version).value();
  EXPECT_EQ(df.removed, (std::vector<std::string>{"d.jsonl:2", "d.jsonl:4"}));
  EXPECT_EQ(df.removed_by_rule["not dup"], 1u);
  EXPECT_EQ(df.removed_by_rule["length > 5"], 1u);
  EXPECT_TRUE(df.added.empty());
  const std::string out = dir.path() + "/mix.jsonl";
  EXPECT_EQ(export_samples(store, r.version, out).value(), 2u);
  EXPECT_EQ(read_file(out).value(), jsonl({"alpha beta", "gamma delta"}));
  // A column file edited after the fact is refused, naming it.
  std::ofstream(d.version.columns[0].files[0], std::ios::app) << "true\n";
  auto stale = filter(store, imp, "not dup", false);
  ASSERT_FALSE(stale);
  EXPECT_TRUE(contains(stale.error().message, "changed since version"));
  auto bad = import_scores(store, d.version, "x", dir.file("bad.jsonl", R"({"input":0,"row":99,"value":1})" "\n"), {});
  ASSERT_FALSE(bad);
  EXPECT_TRUE(contains(bad.error().message, "bad.jsonl:1"));
}

TEST(CurateModel, TrainEvalClassifyAndBadModels) {
  TempDir dir("curate_model");
  const std::string ann = annotation_set(dir, 8);
  auto set = read_annotations(ann, false).value();
  EXPECT_EQ(set.samples.size(), 80u);
  EXPECT_EQ(set.ties, 1u);
  EXPECT_EQ(set.malformed.count, 1u);
  EXPECT_FALSE(read_annotations(ann, true));
  auto store = Store::open(dir.path() + "/store").value();
  TrainOptions o;
  o.out = dir.path() + "/safety.bin";
  o.dim = 16;
  o.bucket = 10000;
  auto r = train(store, ann, o).value();
  EXPECT_GT(r.train_samples, 40u);
  EXPECT_GT(r.heldout_samples, 0u);
  EXPECT_EQ(r.train_samples + r.heldout_samples, 80u);
  EXPECT_GE(r.eval.accuracy, 0.9);
  EXPECT_EQ(r.eval.labels, (std::vector<std::string>{"safe", "unsafe"}));
  auto again = train(store, ann, o).value();
  EXPECT_EQ(again.version.version, r.version.version);
  auto ev = evaluate(o.out, ann, 0, false).value();
  EXPECT_EQ(ev.samples, 80u);
  EXPECT_GE(ev.accuracy, 0.9);

  const std::string data = dir.file("d.jsonl", jsonl({"how do i hurt someone with a weapon", "a recipe for bread with flour and yeast"}) +
                                                   "{\"messages\": [{\"role\": \"user\", \"content\": \"how to plant tomatoes in the garden\"}]}\n");
  auto raw = store.add_raw({data}).value();
  ClassifyOptions co;
  co.classifiers = {parse_classifier("unsafe=" + o.out + ":unsafe").value(), parse_classifier("label=" + o.out).value()};
  co.jobs = 2;
  auto c = classify(store, raw, co).value();
  EXPECT_EQ(c.samples, 3u);
  EXPECT_FALSE(c.reused);
  EXPECT_TRUE(classify(store, raw, co).value().reused);
  auto f = filter(store, c.version, "unsafe < 0.5 and label == \"safe\"", false).value();
  EXPECT_EQ(f.kept, 2u);
  // Classifying the filtered version scores its two samples only.
  co.classifiers = {parse_classifier("again=" + o.out + ":unsafe").value()};
  auto c2 = classify(store, f.version, co).value();
  EXPECT_EQ(c2.samples, 2u);
  EXPECT_EQ(read_column(c2.version.columns.back()).value()[0][0], nullptr);  // line 1, dropped, not scored
  co.classifiers = {parse_classifier("unsafe=" + o.out + ":unsafe").value(), parse_classifier("label=" + o.out).value()};
  EXPECT_EQ(f.version.parameters["columns"]["unsafe"]["source"]["model_xxh3"], c.version.columns[0].source["model_xxh3"]);

  // Models that do not load: not a model, truncated, missing, an unknown label.
  const std::string junk = dir.file("junk.bin", std::string(100, 'x'));
  auto a = Model::load(junk);
  ASSERT_FALSE(a);
  EXPECT_EQ(a.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(a.error().message, "junk.bin"));
  const std::string whole = read_file(o.out).value();
  for (std::size_t cut : {std::size_t{8}, std::size_t{70}, whole.size() / 2, whole.size() - 1}) {
    const std::string t = dir.file("cut.bin", whole.substr(0, cut));
    auto m = Model::load(t);
    EXPECT_FALSE(m) << cut;
  }
  std::string grown = whole + "xx";
  EXPECT_FALSE(Model::load(dir.file("grown.bin", grown)));
  EXPECT_FALSE(Model::load(dir.path() + "/missing.bin"));
  co.classifiers = {parse_classifier("x=" + o.out + ":nolabel").value()};
  auto nl = classify(store, raw, co);
  ASSERT_FALSE(nl);
  EXPECT_TRUE(contains(nl.error().message, "no label 'nolabel'"));
  EXPECT_FALSE(parse_classifier("and=" + o.out));
  EXPECT_FALSE(parse_classifier("nomodel"));
}

// What classify writes, against fastText's own predictLine on the line `fasttext predict` would read
// (fasttext_line(text) + "\n"), through libfasttext directly: tricky texts, JSON lines and shards (json
// and txt fields), on several threads, both kinds of column; and Model::predict, which train's
// evaluation uses.
TEST(CurateModel, ClassifyMatchesFastTextPredictLine) {
  TempDir dir("curate_vs_ft");
  const std::string ann = annotation_set(dir, 8);
  auto store = Store::open(dir.path() + "/store").value();
  TrainOptions o;
  o.out = dir.path() + "/m.bin";
  o.dim = 16;
  o.bucket = 10000;
  ASSERT_TRUE(train(store, ann, o));
  std::vector<std::string> texts = {"how do i hurt someone\nwith a weapon", "bread\r\nwith\vflour\fand\tyeast", "", "   ", "\n\n",
                                    "caf\xc3\xa9 \xe4\xb8\xad garden", "weapon", std::string("nul\0inside", 10), "tomatoes  in   spring "};
  for (int i = 0; i < 300; ++i) texts.push_back(fmt::format("{} {} sample {}", kSafe[i % 5], kUnsafe[(i * 7) % 5], i));
  std::string lines, good, txt;
  std::vector<std::string> want_texts;
  std::uint64_t broken = 0;
  for (std::size_t i = 0; i < texts.size(); ++i) {
    if (i % 50 == 3) {
      lines += "{\"text\": broken\n";
      ++broken;
    }
    std::string line;
    if (i % 3 == 1) {
      line = json{{"messages", {{{"role", "user"}, {"content", texts[i]}}, {{"role", "assistant"}, {"content", "ok"}}}}}.dump();
      want_texts.push_back("user: " + texts[i] + "\nassistant: ok");
    } else {
      line = json{{"id", i}, {"text", texts[i]}}.dump();
      want_texts.push_back(texts[i]);
    }
    lines += line + "\n";
    good += line + "\n";
    if (texts[i].find('\n') == std::string::npos && texts[i].find_first_not_of(' ') != std::string::npos) txt += texts[i] + "\n";
  }
  const std::string jl = dir.file("set.jsonl", lines);
  // pack_shards refuses a JSON-lines file with a bad line: the shards hold the well-formed ones.
  data::PackOptions pj;
  pj.src = dir.file("good.jsonl", good);
  pj.out = dir.path() + "/shards_json";
  pj.target_bytes = 4000;
  ASSERT_TRUE(data::pack_shards(pj));
  data::PackOptions pt = pj;
  pt.src = dir.file("plain.txt", txt);
  pt.out = dir.path() + "/shards_txt";
  ASSERT_TRUE(data::pack_shards(pt));

  fasttext::FastText ft;
  ft.loadModel(o.out);
  auto reference = [&](const std::string& text, const std::string& label) -> json {
    std::istringstream in(fasttext_line(text) + "\n");
    std::vector<std::pair<fasttext::real, std::string>> p;
    ft.predictLine(in, p, label.empty() ? 1 : -1, 0.0);
    if (p.empty()) return nullptr;
    if (label.empty()) return p[0].second.substr(9);
    for (const auto& [prob, l] : p)
      if (l == "__label__" + label) return static_cast<double>(prob);
    return 0.0;
  };
  auto model = Model::load(o.out).value();

  for (const std::string& source : {jl, pj.out, pt.out}) {
    auto raw = store.add_raw({source}).value();
    ClassifyOptions co;
    co.classifiers = {parse_classifier("unsafe=" + o.out + ":unsafe").value(), parse_classifier("label=" + o.out).value()};
    co.jobs = 3;
    auto c = classify(store, raw, co).value();
    auto vs = load_samples(store, raw, true, false).value();
    ASSERT_GT(vs.samples.size(), 100u) << source;
    EXPECT_EQ(c.samples, vs.samples.size());
    EXPECT_EQ(c.malformed.count, vs.malformed.count);
    EXPECT_EQ(c.malformed.first, vs.malformed.first);
    for (std::size_t k = 0; k < 2; ++k) {
      const auto col = read_column(c.version.columns[k]).value();
      ASSERT_EQ(col.size(), 1u);
      ASSERT_EQ(col[0].size(), vs.rows[0]);
      for (const auto& s : vs.samples)
        EXPECT_EQ(col[0][row_index(raw.inputs[0], s.row)], reference(s.text, co.classifiers[k].label)) << source << " row " << s.row;
    }
    for (const auto& s : vs.samples) {
      const auto p = model->predict(s.text, -1);
      const json top = p.empty() ? json(nullptr) : json(p[0].second);
      EXPECT_EQ(top, reference(s.text, ""));
      json unsafe = p.empty() ? json(nullptr) : json(0.0);
      for (const auto& [prob, label] : p)
        if (label == "unsafe") unsafe = static_cast<double>(prob);
      EXPECT_EQ(unsafe, reference(s.text, "unsafe"));
    }
    if (source == jl) {
      std::vector<std::string> got;
      for (const auto& s : vs.samples) got.push_back(s.text);
      EXPECT_EQ(got, want_texts);
      EXPECT_EQ(c.malformed.count, broken);
      EXPECT_EQ(vs.rows[0], texts.size() + broken);
    }
  }
}

}  // namespace
}  // namespace pacer::curate
