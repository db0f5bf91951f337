// What the curate steps share inside src/curate.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/curate.hpp"

namespace pacer::curate {

// A new version derived from `parent` by `step`: its id is over the parent,
// the step and `identity` (the parameters that decide its content: checksums,
// not paths); `parameters` is what the manifest records. Inputs and columns
// are the parent's.
Manifest derive(const Manifest& parent, const std::string& step, const nlohmann::json& identity, nlohmann::json parameters);

// The (input, row) of every sample the filter steps in m's lineage dropped.
Expected<std::set<std::pair<std::size_t, std::uint64_t>>> dropped_rows(const Store& store, const Manifest& m);

// Where a row's value sits in a column: JSON-lines rows are 1-based lines.
inline std::size_t row_index(const Input& in, std::uint64_t row) { return in.kind == "jsonl" ? static_cast<std::size_t>(row - 1) : row; }

// Empty columns (null per row) for every input.
std::vector<std::vector<nlohmann::json>> null_columns(const std::vector<std::uint64_t>& rows);

// write_column with each input's file already rendered: one JSON value a
// line, a line per row.
Expected<Column> write_column_text(const std::vector<Input>& inputs, const std::string& name, const std::string& version,
                                   const std::vector<std::string>& texts, nlohmann::json source);

// Adds (or replaces, by name) a column of `m`.
void set_column(Manifest& m, Column c);

// The number of worker threads for `jobs` (0: every CPU this process may use).
int worker_count(int jobs);

// Runs fn(worker, begin, end) over [0, n) in blocks on `threads` threads;
// worker (0 .. threads-1) names the calling thread, for per-thread state.
void parallel_blocks(std::size_t n, int threads, std::size_t block, const std::function<void(int, std::size_t, std::size_t)>& fn);

// ---------------------------------------------------------------------------
// Reading samples: unparsed chunks, then a parser per thread

// One sample as read, before parsing: a JSON line (line break and trailing
// CRs removed; blank lines are never handed out), or a shard sample's json or
// txt field.
struct RawSample {
  enum class Kind : std::uint8_t { kJsonLine, kShardJson, kShardText, kShardNoText };
  Kind kind = Kind::kJsonLine;
  std::uint64_t row = 0;   // as Sample::row
  std::string_view bytes;  // valid while the chunk is
  std::string_view key;    // the shard member's key; empty for JSON lines
};
// Consecutive samples of one input. Its views point into the reader's
// buffers: valid only inside the callback that receives the chunk.
struct RawChunk {
  std::size_t input = 0;
  const Input* in = nullptr;
  std::string base;  // the input's file name: the fallback id of a JSON line is BASE:LINE
  std::vector<RawSample> samples;
};

// Reads `inputs` in order, in chunks: JSON lines in large blocks (no copy
// per line), shard samples one by one. `rows` (when given) receives each
// input's row count. Read errors name the file and line (or shard sample).
// `workers`: the threads `fn` hands each chunk to. With more than one, a
// thread reads a JSON-lines file's next block while `fn` runs on this one,
// and blocks grow with the workers (1 MiB each, 4 to 32 MiB).
Status for_each_raw_chunk(const std::vector<Input>& inputs, const std::function<Status(RawChunk&)>& fn, std::vector<std::uint64_t>* rows = nullptr,
                          int workers = 1);

// Turns raw samples into texts (and ids). simdjson parses and validates each
// line; every line it refuses, every sample whose fields are not the plain
// case, and every line over 1 MiB go through nlohmann::json and
// sample_text/sample_id (the reference), so the result and the reason a line
// is malformed are the reference's. Not thread-safe: one per thread.
class SampleParser {
 public:
  SampleParser();
  ~SampleParser();
  SampleParser(const SampleParser&) = delete;
  SampleParser& operator=(const SampleParser&) = delete;
  // The sample's text (a view valid until the next call) and, when `id` is
  // given, its id; or false with `why` set to why it is malformed.
  bool parse(const RawChunk& c, const RawSample& s, std::string_view& text, std::string* id, std::string& why);
  // Only the reference path (nlohmann), for tests that compare the two.
  bool parse_reference(const RawChunk& c, const RawSample& s, std::string_view& text, std::string* id, std::string& why);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Counts a malformed sample in `bad` with its place ("FILE:LINE: why" or
// "SHARDS: sample I (KEY): why"); with `strict` returns it as a kConfig error.
Status note_malformed(const RawChunk& c, const RawSample& s, const std::string& why, bool strict, Malformed& bad);

}  // namespace pacer::curate
