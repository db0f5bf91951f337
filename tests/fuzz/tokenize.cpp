// Fuzzes the reading half of `pacer shard tokenize`: arbitrary bytes as a text file and as JSON
// lines, cut into tiny chunks over two threads, encoded byte by byte (the bytes tokenizer), with
// invalid UTF-8 replaced and skipped; what was written is read back and checked.
#include <optional>

#include "fuzz.hpp"
#include "pacer/data.hpp"
#include "pacer/data/tokenize.hpp"

using namespace pacer;

namespace {

// Well-formed UTF-8 by code point (no overlong forms, no surrogates, at most U+10FFFF); written
// apart from the library's table of byte ranges so that the two check each other.
bool valid_utf8(const std::string& s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    std::uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (int k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b >> 6) != 2) return false;
      cp = (cp << 6) | (b & 0x3F);
    }
    static const std::uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += static_cast<std::size_t>(n);
  }
  return true;
}

std::optional<data::TokenizeReport> run(const std::string& input, const std::string& prefix, data::BadUtf8 bad, bool per_file) {
  static const auto tok = data::load_vocabulary("").value();
  data::TokenizeOptions o;
  o.inputs = {input};
  o.prefix = prefix;
  o.threads = 2;
  o.chunk_bytes = 16;
  o.bad_utf8 = bad;
  o.document_per_file = per_file;
  o.eod_id = 10;  // '\n' never ends up inside a document, so it marks the end unambiguously
  auto r = data::tokenize(o, *tok);
  if (!r) {
    PACER_FUZZ_CHECK(r.error().message.find(input) != std::string::npos, "an error that does not name the input: %s", r.error().message.c_str());
    return std::nullopt;
  }
  auto ds = data::TokenDataset::open(prefix).value();
  PACER_FUZZ_CHECK(ds->documents() == r->documents && ds->tokens() == r->tokens, "%llu documents, %llu tokens read back",
                   (unsigned long long)ds->documents(), (unsigned long long)ds->tokens());
  for (std::uint64_t d = 0; d < ds->documents(); ++d) {
    const auto ids = ds->read(d).value();
    PACER_FUZZ_CHECK(!ids.empty() && ids.back() == 10, "document %llu does not end with the eod", (unsigned long long)d);
    std::string text;
    for (std::size_t i = 0; i + 1 < ids.size(); ++i) text.push_back(static_cast<char>(ids[i]));
    PACER_FUZZ_CHECK(bad == data::BadUtf8::kFail || valid_utf8(text), "document %llu is not valid UTF-8", (unsigned long long)d);
    PACER_FUZZ_CHECK(per_file || text.find('\n') == std::string::npos, "document %llu holds a newline", (unsigned long long)d);
  }
  return std::move(*r);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string dir = fuzz::scratch();
  const std::string text = dir + "/in.txt", jsonl = dir + "/in.jsonl";
  fuzz::write_bytes(text, data, size);
  fuzz::write_bytes(jsonl, data, size);

  const auto replaced = run(text, dir + "/r", data::BadUtf8::kReplace, false);
  const auto skipped = run(text, dir + "/s", data::BadUtf8::kSkip, false);
  if (replaced && skipped)  // (skipping every document is an error: no documents)
    PACER_FUZZ_CHECK(skipped->documents + skipped->bad_utf8_documents == replaced->documents,
                     "skip wrote %llu documents and skipped %llu, replace wrote %llu", (unsigned long long)skipped->documents,
                     (unsigned long long)skipped->bad_utf8_documents, (unsigned long long)replaced->documents);
  run(text, dir + "/f", data::BadUtf8::kFail, false);
  const auto whole = run(text, dir + "/w", data::BadUtf8::kReplace, true);
  if (whole) PACER_FUZZ_CHECK(whole->documents == 1, "a file as one document gave %llu", (unsigned long long)whole->documents);
  run(jsonl, dir + "/j", data::BadUtf8::kReplace, false);
  return 0;
}
