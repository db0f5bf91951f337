// pacer::data::tokenize with a SentencePiece model trained here on license texts Debian ships.
#include <gtest/gtest.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <xxhash.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "pacer/core/atomic_file.hpp"
#include "pacer/data/tokenize.hpp"
#include "test_util.hpp"

namespace pacer::data {
namespace {

using test::contains;
using test::TempDir;

std::string slurp(const std::string& path) { return read_file(path).value(); }
std::string hex(const std::string& bytes) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(XXH3_64bits(bytes.data(), bytes.size())));
  return b;
}

const std::string kLicenses = "/usr/share/common-licenses/";

// Trained once: byte fallback and no normalization, so every text decodes
// back to itself and a round trip can be checked byte for byte.
class TokenizeSpm : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("pacer-spm-");
    const std::string corpus = dir_->file("corpus.txt", slurp(kLicenses + "GPL-3") + slurp(kLicenses + "Apache-2.0"));
    const auto st = sentencepiece::SentencePieceTrainer::Train(
        "--input=" + corpus + " --model_prefix=" + dir_->path() + "/tok --vocab_size=400 --model_type=bpe --byte_fallback=true"
        " --character_coverage=1.0 --normalization_rule_name=identity --remove_extra_whitespaces=false --minloglevel=2");
    ASSERT_TRUE(st.ok()) << st.ToString();
    model_ = dir_->path() + "/tok.model";
  }
  static void TearDownTestSuite() { delete dir_; }

  void SetUp() override {
    tok_ = load_sentencepiece(model_).value();
    ASSERT_TRUE(sp_.Load(model_).ok());
  }
  std::string decode(const std::vector<std::int64_t>& ids) {
    std::string out;
    EXPECT_TRUE(sp_.Decode(std::vector<int>(ids.begin(), ids.end()), &out).ok());
    return out;
  }
  // Document d of PREFIX without its last token, which must be eos.
  std::string doc_text(const TokenDataset& ds, std::uint64_t d) {
    auto ids = ds.read(d).value();
    EXPECT_FALSE(ids.empty());
    EXPECT_EQ(ids.back(), sp_.eos_id()) << "document " << d << " does not end with eos";
    ids.pop_back();
    return decode(ids);
  }

  static TokenizeOptions options(std::vector<std::string> inputs, std::string prefix) {
    TokenizeOptions o;
    o.inputs = std::move(inputs);
    o.prefix = std::move(prefix);
    return o;
  }

  static TempDir* dir_;
  static std::string model_;
  std::unique_ptr<Tokenizer> tok_;
  sentencepiece::SentencePieceProcessor sp_;
};
TempDir* TokenizeSpm::dir_ = nullptr;
std::string TokenizeSpm::model_;

std::vector<std::string> nonempty_lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) out.push_back(l);
  return out;
}

TEST_F(TokenizeSpm, TextAndJsonLinesRoundTripInOrderWhateverTheThreads) {
  TempDir dir("pacer-tokenize-");
  std::string text;
  for (const char* f : {"GPL-3", "GFDL-1.3", "LGPL-2.1", "GPL-2", "Artistic", "MPL-2.0", "Apache-2.0", "GPL-1", "MPL-1.1", "LGPL-3"})
    text += slurp(kLicenses + f);
  const std::string txt = dir.file("licenses.txt", text);
  std::string jsonl;
  const auto bsd = nonempty_lines(slurp(kLicenses + "BSD"));
  for (const auto& l : bsd) jsonl += nlohmann::json({{"id", 1}, {"text", l}}).dump() + "\n";
  const std::string js = dir.file("bsd.jsonl", jsonl);

  TokenizeOptions o;
  o.inputs = {txt, js};
  o.chunk_bytes = 4096;  // dozens of chunks, finished out of order on several threads
  o.threads = 1;
  o.prefix = dir.path() + "/one";
  const auto r1 = tokenize(o, *tok_).value();
  o.threads = 5;
  o.chunk_bytes = 1000;  // also lines longer than a chunk
  o.prefix = dir.path() + "/five";
  const auto r5 = tokenize(o, *tok_).value();
  EXPECT_EQ(slurp(dir.path() + "/one.bin"), slurp(dir.path() + "/five.bin"));
  EXPECT_EQ(slurp(dir.path() + "/one.idx"), slurp(dir.path() + "/five.idx"));
  // The default, sized to the input and the threads (16 KiB chunks here).
  o.threads = 2;
  o.chunk_bytes = TokenizeOptions{}.chunk_bytes;
  o.prefix = dir.path() + "/two";
  ASSERT_TRUE(tokenize(o, *tok_));
  EXPECT_EQ(slurp(dir.path() + "/one.bin"), slurp(dir.path() + "/two.bin"));
  EXPECT_EQ(slurp(dir.path() + "/one.idx"), slurp(dir.path() + "/two.idx"));

  const auto lines = nonempty_lines(text);
  ASSERT_EQ(r5.inputs.size(), 2u);
  EXPECT_EQ(r5.inputs[0].documents, lines.size());
  EXPECT_EQ(r5.inputs[1].documents, bsd.size());
  EXPECT_EQ(r5.documents, lines.size() + bsd.size());
  EXPECT_EQ(r5.dtype, "uint16");
  EXPECT_EQ(r5.eod, std::optional<std::int64_t>(sp_.eos_id()));
  auto ds = TokenDataset::open(dir.path() + "/five").value();
  ASSERT_EQ(ds->documents(), r5.documents);
  EXPECT_EQ(ds->tokens(), r5.tokens);
  for (std::size_t d = 0; d < lines.size(); ++d) ASSERT_EQ(doc_text(*ds, d), lines[d]) << "document " << d;
  // The ids themselves are the library's own for each line (Encode(text, &ids), as spm_encode calls it).
  for (std::size_t d = 0; d < lines.size(); d += 7) {
    std::vector<int> want;
    ASSERT_TRUE(sp_.Encode(lines[d], &want).ok());
    want.push_back(sp_.eos_id());
    const auto got = ds->read(d).value();
    ASSERT_EQ(std::vector<std::int64_t>(want.begin(), want.end()), got) << "document " << d;
  }
  for (std::size_t d = 0; d < bsd.size(); ++d) ASSERT_EQ(doc_text(*ds, lines.size() + d), bsd[d]);

  // The manifest: the model's and every file's checksum, as their bytes say.
  const auto m = nlohmann::json::parse(slurp(dir.path() + "/five.manifest.json"));
  EXPECT_EQ(m["schema"], "pacer.tokens/1");
  EXPECT_EQ(m["tokenizer"]["kind"], "sentencepiece");
  EXPECT_EQ(m["tokenizer"]["path"], model_);
  EXPECT_EQ(m["tokenizer"]["xxh3"], hex(slurp(model_)));
  EXPECT_EQ(m["tokenizer"]["vocab_size"], 400);
  EXPECT_EQ(m["eod"], sp_.eos_id());
  EXPECT_EQ(m["inputs"][0]["path"], txt);
  EXPECT_EQ(m["inputs"][0]["xxh3"], hex(text));
  EXPECT_EQ(m["inputs"][0]["bytes"], text.size());
  EXPECT_EQ(m["inputs"][1]["xxh3"], hex(jsonl));
  EXPECT_EQ(m["inputs"][1]["format"], "jsonl");
  EXPECT_EQ(m["bin"]["xxh3"], hex(slurp(dir.path() + "/five.bin")));
  EXPECT_EQ(m["idx"]["xxh3"], hex(slurp(dir.path() + "/five.idx")));
  EXPECT_EQ(m["documents"], r5.documents);
  EXPECT_EQ(r1.tokens, r5.tokens);
}

TEST_F(TokenizeSpm, EodDocumentPerFileAndEmptyDocuments) {
  TempDir dir("pacer-tokenize-");
  const std::string a = dir.file("a.txt", slurp(kLicenses + "BSD")), b = dir.file("b.txt", slurp(kLicenses + "MPL-2.0"));
  const std::string js = dir.file("two.jsonl", "{\"text\": \"Licensed\"}\n{\"text\": \"to you\"}\n");
  TokenizeOptions o = options({a, js, b}, dir.path() + "/files");
  o.document_per_file = true;
  o.eod_id = 7;
  tokenize(o, *tok_).value();
  auto ds = TokenDataset::open(o.prefix).value();
  ASSERT_EQ(ds->documents(), 4u);  // JSON lines keep a document per line
  auto ids = ds->read(3).value();
  EXPECT_EQ(ids.back(), 7);
  ids.pop_back();
  EXPECT_EQ(decode(ids), slurp(b));  // the whole file, newlines and all

  o.document_per_file = false;
  o.append_eod = false;
  o.prefix = dir.path() + "/noeod";
  const std::string e_js = dir.file("e.jsonl", "{\"text\": \"\"}\n{\"text\": \"Licensed\"}\n\n");
  o.inputs = {e_js};
  const auto r = tokenize(o, *tok_).value();
  EXPECT_EQ(r.documents, 1u);
  EXPECT_EQ(r.empty, 1u);
  EXPECT_FALSE(r.eod);
  EXPECT_EQ(decode(TokenDataset::open(o.prefix).value()->read(0).value()), "Licensed");

  o.append_eod = true;
  o.eod_id = 400;
  auto e = tokenize(o, *tok_);
  ASSERT_FALSE(e);
  EXPECT_EQ(e.error().kind, ErrorKind::kUsage);
}

TEST_F(TokenizeSpm, InvalidUtf8IsReplacedSkippedOrFailsNamingTheLine) {
  TempDir dir("pacer-tokenize-");
  const std::string in = dir.file("bad.txt", "Licensed to you\nunder the\n\xff terms\nof the \xe2\x82 License\n");
  TokenizeOptions o = options({in}, dir.path() + "/r");
  const auto r = tokenize(o, *tok_).value();
  EXPECT_EQ(r.documents, 4u);
  EXPECT_EQ(r.bad_utf8_documents, 2u);
  EXPECT_EQ(r.inputs[0].first_bad_utf8_line, 3u);
  auto ds = TokenDataset::open(o.prefix).value();
  EXPECT_EQ(doc_text(*ds, 2), "\xEF\xBF\xBD terms");
  EXPECT_EQ(doc_text(*ds, 3), "of the \xEF\xBF\xBD License");  // one U+FFFD for the truncated sequence
  const auto m = nlohmann::json::parse(slurp(o.prefix + ".manifest.json"));
  EXPECT_EQ(m["inputs"][0]["bad_utf8"], 2);
  EXPECT_EQ(m["inputs"][0]["first_bad_utf8_line"], 3);

  o.bad_utf8 = BadUtf8::kSkip;
  o.prefix = dir.path() + "/s";
  const auto s = tokenize(o, *tok_).value();
  EXPECT_EQ(s.documents, 2u);
  EXPECT_EQ(s.bad_utf8_documents, 2u);

  o.bad_utf8 = BadUtf8::kFail;
  o.prefix = dir.path() + "/f";
  auto f = tokenize(o, *tok_);
  ASSERT_FALSE(f);
  EXPECT_EQ(f.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(f.error().message, in + ":3:")) << f.error().message;
  EXPECT_FALSE(std::filesystem::exists(o.prefix + ".bin"));

  o.document_per_file = true;  // the line is still found
  f = tokenize(o, *tok_);
  ASSERT_FALSE(f);
  EXPECT_TRUE(contains(f.error().message, in + ":3: not valid UTF-8 (byte 1 of the line)")) << f.error().message;
}

TEST_F(TokenizeSpm, BadInputIsAnErrorAndLeavesTheOldDatasetInPlace) {
  TempDir dir("pacer-tokenize-");
  const std::string good = dir.file("good.txt", "Licensed\n");
  TokenizeOptions o = options({good}, dir.path() + "/ds");
  tokenize(o, *tok_).value();
  const std::string before = slurp(o.prefix + ".bin") + slurp(o.prefix + ".idx") + slurp(o.prefix + ".manifest.json");

  o.inputs = {dir.file("empty.txt", "\n\n")};
  auto e = tokenize(o, *tok_);
  ASSERT_FALSE(e);
  EXPECT_EQ(e.error().kind, ErrorKind::kConfig);
  EXPECT_TRUE(contains(e.error().message, "empty.txt: no documents")) << e.error().message;

  o.inputs = {good, dir.file("bad.jsonl", "{\"text\": \"ok\"}\n{\"body\": 1}\n")};
  e = tokenize(o, *tok_);
  ASSERT_FALSE(e);
  EXPECT_TRUE(contains(e.error().message, "bad.jsonl:2")) << e.error().message;

  o.inputs = {dir.path() + "/missing.txt"};
  e = tokenize(o, *tok_);
  ASSERT_FALSE(e);
  EXPECT_TRUE(contains(e.error().message, "missing.txt"));
  EXPECT_EQ(before, slurp(o.prefix + ".bin") + slurp(o.prefix + ".idx") + slurp(o.prefix + ".manifest.json"));

  // An output that is an input.
  o.inputs = {dir.file("ds.manifest.json", "{\"text\": \"x\"}\n")};
  e = tokenize(o, *tok_);
  ASSERT_FALSE(e);
  EXPECT_EQ(e.error().kind, ErrorKind::kUsage);

  // Models that do not load name their file.
  for (const std::string& bytes : {std::string("not a model\n"), std::string()}) {
    const std::string bad = dir.file("bad.model", bytes);
    auto m = load_sentencepiece(bad);
    ASSERT_FALSE(m);
    EXPECT_EQ(m.error().kind, ErrorKind::kConfig);
    EXPECT_TRUE(contains(m.error().message, bad)) << m.error().message;
  }
  EXPECT_FALSE(load_sentencepiece(dir.path() + "/none.model"));
}

TEST(Tokenize, TheTestVocabularyHasNoEodAndFallsBackToBytes) {
  TempDir dir("pacer-tok-");
  auto tok = load_vocabulary(dir.file("vocab.txt", "hello\nworld\n")).value();
  const std::string text = dir.file("docs.txt", "hello world\n\nworld\r\nhi\n");
  TokenizeOptions o;
  o.inputs = {text};
  o.prefix = dir.path() + "/txt";
  auto r = tokenize(o, *tok).value();
  EXPECT_EQ(r.documents, 3u);  // the blank line is not a document
  EXPECT_FALSE(r.eod);
  auto ds = TokenDataset::open(o.prefix).value();
  auto v = Vocabulary::load(dir.path() + "/vocab.txt").value();
  EXPECT_EQ(v.decode(ds->read(0).value()), "hello world");
  EXPECT_EQ(v.decode(ds->read(1).value()), "world");
  EXPECT_EQ(v.decode(ds->read(2).value()), "hi");
  EXPECT_EQ(r.tokenizer["kind"], "vocabulary");
  EXPECT_EQ(load_vocabulary("").value()->identity()["kind"], "bytes");
}

}  // namespace
}  // namespace pacer::data
