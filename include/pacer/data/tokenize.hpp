// Text to Megatron-Core token datasets with real tokenizer models, in parallel, with a manifest.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pacer/core/error.hpp"
#include "pacer/data.hpp"

namespace pacer::data {

// Turns documents into token ids. encode() is called from several threads
// at once, each with its own batch, so an implementation keeps no mutable
// state between calls (or locks it).
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Appends each document's ids to `ids` and their count to `lengths`, in
  // the order of `docs`. An error names what failed; the caller adds where.
  virtual Status encode(const std::vector<std::string_view>& docs, std::vector<std::int64_t>& ids,
                        std::vector<std::uint64_t>& lengths) const = 0;
  // Every id lies in [0, vocab_size()).
  virtual std::uint64_t vocab_size() const = 0;
  // The id a document ends with by default; none when the model has none.
  virtual std::optional<std::int64_t> eos_id() const = 0;
  // The manifest's "tokenizer" object: at least "kind"; for a model file
  // its "path" and "xxh3" (XXH3-64 of its bytes, 16 hex digits).
  virtual nlohmann::json identity() const = 0;
};

// A SentencePiece model (.model) through libsentencepiece. The file is read
// once; its checksum is of the bytes that were loaded. A file that does not
// load is a kConfig error naming it.
Expected<std::unique_ptr<Tokenizer>> load_sentencepiece(const std::string& model_path);
// The line-per-token test vocabulary (Vocabulary); `path` "" for bytes only.
// Kept for small tests; it has no end-of-document id.
Expected<std::unique_ptr<Tokenizer>> load_vocabulary(const std::string& path);

// The identity of a tokenizer pacer does not load itself (a Python
// callable): {"kind": kind, "name": name}, and, when it names the model file
// it reads, that file's "path" and "xxh3". An unreadable file is an error.
Expected<nlohmann::json> external_identity(const std::string& kind, const std::string& name, const std::string& model_file);

// What to do with a document whose bytes are not valid UTF-8.
enum class BadUtf8 { kReplace, kSkip, kFail };
Expected<BadUtf8> parse_bad_utf8(const std::string& name);
const char* to_string(BadUtf8 b);

struct TokenizeOptions {
  // INPUT files, read in this order. NAME.jsonl / NAME.json: JSON lines,
  // the string field `field` of each is a document; anything else: text.
  std::vector<std::string> inputs;
  std::string prefix;  // writes PREFIX.bin, PREFIX.idx, PREFIX.manifest.json
  std::string field = "text";
  // Text inputs: a document per non-empty line (false), or per file (true);
  // JSON lines always hold one per line.
  bool document_per_file = false;
  int threads = 0;  // encoding threads; 0: every CPU this process may use
  // Appended to every document: eod_id when set, else the tokenizer's eos.
  bool append_eod = true;
  std::optional<std::int64_t> eod_id;
  BadUtf8 bad_utf8 = BadUtf8::kReplace;
  // Text per chunk handed to a thread (cut after the last whole line; a
  // longer line makes a longer chunk): at most this, and, for inputs of
  // known size, a quarter of each thread's share of what is left, down to
  // 16 KiB, so that the last chunks are small and no thread waits long.
  std::size_t chunk_bytes = 256u << 10;
};

struct TokenizeInputReport {
  std::string path;
  std::string format;  // "jsonl" or "text"
  std::uint64_t bytes = 0;
  std::uint64_t xxh3 = 0;  // of the file's bytes as read
  std::uint64_t documents = 0;  // written
  std::uint64_t tokens = 0;     // written, end-of-document tokens included
  std::uint64_t empty = 0;      // documents with no text, not written
  std::uint64_t bad_utf8 = 0;   // documents with invalid UTF-8 (replaced or skipped)
  std::uint64_t first_bad_utf8_line = 0;  // 1-based; 0: none
};

struct TokenizeReport {
  std::vector<TokenizeInputReport> inputs;
  std::string prefix, manifest;  // manifest: PREFIX.manifest.json
  nlohmann::json tokenizer;      // Tokenizer::identity()
  std::uint64_t vocab_size = 0;
  std::optional<std::int64_t> eod;
  std::string dtype;  // uint16 when every id fits, else int32
  std::string field;
  bool document_per_file = false;
  BadUtf8 bad_utf8 = BadUtf8::kReplace;
  std::uint64_t documents = 0, tokens = 0, bytes = 0, empty = 0, bad_utf8_documents = 0;
  std::uint64_t bin_bytes = 0, bin_xxh3 = 0, idx_bytes = 0, idx_xxh3 = 0;
  int threads = 0;
  double seconds = 0;
};

// Reads the inputs in chunks of whole lines, encodes the chunks on
// `threads` threads and writes them in input order: the output does not
// depend on the thread count. PREFIX.bin and PREFIX.idx are written under
// temporary names and renamed when complete and synced, then the manifest
// (schema pacer.tokens/1, docs/data.md); all three are durable when it
// returns, and a failure leaves the old files in place.
// Errors: a malformed JSON line, invalid UTF-8 under kFail, or an id outside
// the vocabulary name file:line (kConfig); no documents at all is kConfig.
Expected<TokenizeReport> tokenize(const TokenizeOptions& options, const Tokenizer& tokenizer);

// The manifest written beside the dataset (schema pacer.tokens/1).
nlohmann::json manifest_json(const TokenizeReport& report);
// The record of `pacer shard tokenize --json` (schema pacer.shard.tokenize/2):
// the manifest's fields plus where it is, the threads and the time taken.
nlohmann::json to_json(const TokenizeReport& report);

}  // namespace pacer::data
