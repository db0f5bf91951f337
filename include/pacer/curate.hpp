// Curation of SFT data on its own storage: versioned data sets, classifier
// score columns beside the data, deduplication, decontamination, filtering
// and fastText classifiers trained from annotation sets (docs/curate.md).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"

namespace pacer::curate {

// ---------------------------------------------------------------------------
// Samples

// One input of a raw data set: a JSON-lines file, or a pacer shard set (a
// shard, a brace range, a glob or a manifest.json; data::expand_shard_spec).
struct Input {
  std::string path;  // absolute
  std::string kind;  // "jsonl" or "shards"
  std::uint64_t bytes = 0;
  std::string xxh3;  // of the file, or of the shards' checksums in order
};
// Describes (and checksums) `path`; a missing path is a kUsage error naming it.
Expected<Input> describe_input(const std::string& path);

// A sample as classifiers, dedup and annotators see it. Its id: the "id"
// field (a string, or an integer as decimal), else BASENAME:LINE for JSON
// lines and the member key for shards. `row` places it in its input: the
// 1-based line of a JSON-lines file, the 0-based sample of a shard set; the
// score columns are aligned to rows.
struct Sample {
  std::size_t input = 0;
  std::uint64_t row = 0;
  std::string id;
  std::string text;  // "text", or the messages as "role: content" lines
};

// Malformed lines (not JSON, not an object, no text or messages): counted,
// the first few named FILE:LINE, never fatal unless `strict`.
struct Malformed {
  std::uint64_t count = 0;
  std::vector<std::string> first;  // "FILE:LINE: why", at most 20
};
nlohmann::json to_json(const Malformed& m);

// The text of a parsed JSON sample, or why it has none.
Expected<std::string> sample_text(const nlohmann::json& j);
// The sample's id as the contract defines it (fallback when it has no "id").
std::string sample_id(const nlohmann::json& j, const std::string& fallback);

// Calls `fn` for each sample of `inputs`, in input and row order. Malformed
// lines go to `bad`; with `strict` the first is a kConfig error naming it.
// `rows` (when given) receives each input's row count (the length its score
// columns have).
Status for_each_sample(const std::vector<Input>& inputs, bool strict, Malformed& bad, const std::function<Status(Sample&)>& fn,
                       std::vector<std::uint64_t>* rows = nullptr);

// Lower-case ASCII, whitespace runs as one space, trimmed: what exact
// deduplication compares.
std::string normalise(const std::string& text);
// Lower-case words of letters and digits (ASCII; other bytes, UTF-8
// included, are kept inside words): what shingles and n-grams are made of.
std::vector<std::string> words(const std::string& text);

// ---------------------------------------------------------------------------
// Versions and the store

// "v" + 16 hex digits of XXH3-64 over the canonical (sorted-key) JSON of
// `description`: the same inputs and parameters give the same id.
std::string version_id(const nlohmann::json& description);
// The same id of bytes already canonical (an annotation set's, a guideline file's).
std::string version_id_of(std::string_view canonical);
bool is_version_id(const std::string& s);

// A data-set version's manifest (STORE/versions/ID/manifest.json, schema
// pacer.dataset/1). Every version carries its inputs and the score columns
// available to it, so that a version can be read without its ancestors.
struct Column {
  std::string name;
  std::string version;             // the version that computed it
  std::vector<std::string> files;  // one per input: INPUT.scores/NAME-VERSION.jsonl
  std::vector<std::string> xxh3;   // of each file
  nlohmann::json source;           // classifier model and checksum, callable, or step
};
struct Manifest {
  std::string version;
  std::string step;    // raw, classify, dedup, decontaminate, filter, import, model
  std::string parent;  // empty for raw
  nlohmann::json parameters = nlohmann::json::object();
  std::vector<Input> inputs;
  std::vector<Column> columns;
  nlohmann::json counts = nlohmann::json::object();
  std::string created;
};
nlohmann::json to_json(const Manifest& m);
Expected<Manifest> manifest_from_json(const nlohmann::json& j, const std::string& source);

// A directory of version manifests on the data's own storage:
// STORE/versions/ID/{manifest.json, dropped.jsonl}. Writes are atomic, so a
// reader sees a version whole or not at all.
class Store {
 public:
  // `dir` empty: $PACER_DATA_STORE, else ./pacer-data. Created when missing.
  static Expected<Store> open(const std::string& dir);
  const std::string& dir() const { return dir_; }
  std::string version_dir(const std::string& id) const;
  bool has(const std::string& id) const;
  Expected<Manifest> read(const std::string& id) const;
  Status write(const Manifest& m, const std::string& dropped_jsonl = {}) const;
  // The raw version of these input paths (registered when new).
  Expected<Manifest> add_raw(const std::vector<std::string>& paths) const;
  // One version id, or input paths (registered as a raw version).
  Expected<Manifest> resolve(const std::vector<std::string>& sources) const;

 private:
  std::string dir_;
};

// The samples of a version: its inputs' samples minus those its filter
// steps dropped (ancestors included). With `with_text` false the texts are
// left empty.
struct VersionSamples {
  std::vector<Sample> samples;
  std::vector<std::uint64_t> rows;  // per input
  Malformed malformed;
};
Expected<VersionSamples> load_samples(const Store& store, const Manifest& m, bool with_text, bool strict);

// The lineage of a version back to its raw files, newest first.
Expected<std::vector<Manifest>> lineage(const Store& store, const std::string& id);

struct Diff {
  std::string a, b;
  std::uint64_t a_samples = 0, b_samples = 0;
  std::vector<std::string> added, removed;  // sample ids
  std::map<std::string, std::uint64_t> removed_by_rule;  // the filter clause (or "other") that removed each
};
Expected<Diff> diff(const Store& store, const std::string& a, const std::string& b);
nlohmann::json to_json(const Diff& d, std::size_t limit);

// Writes a version's samples as JSON lines (the original line for JSON-lines
// inputs; {"id", "text"} for shards), atomically.
Expected<std::uint64_t> export_samples(const Store& store, const Manifest& m, const std::string& out);

// Score columns: one JSON value per row (null for a row without a sample).
std::string column_path(const Input& in, const std::string& name, const std::string& version);
// Writes the columns of a new version beside its inputs and returns the
// Column (files and checksums). values[i][row] for row = 0..rows[i]-1 in the
// file's order (JSON lines: values[i][0] is line 1).
Expected<Column> write_column(const std::vector<Input>& inputs, const std::string& name, const std::string& version,
                              const std::vector<std::vector<nlohmann::json>>& values, nlohmann::json source);
// Reads a column, checking each file against its recorded checksum.
Expected<std::vector<std::vector<nlohmann::json>>> read_column(const Column& c);
// A column name: [A-Za-z_][A-Za-z0-9_]*, not a keyword of filter expressions.
Status check_column_name(const std::string& name);

// ---------------------------------------------------------------------------
// classify

struct Classifier {
  std::string name;   // the score column
  std::string model;  // fastText .bin (or .ftz)
  std::string label;  // empty: the column is the top label; else P(label)
};
// NAME=PATH or NAME=PATH:LABEL.
Expected<Classifier> parse_classifier(const std::string& spec);

struct ClassifyOptions {
  std::vector<Classifier> classifiers;
  int jobs = 0;  // 0: every CPU this process may use
  bool strict = false;
};
struct ClassifyReport {
  Manifest version;
  std::uint64_t samples = 0;
  double seconds = 0;
  int jobs = 0;
  bool reused = false;  // the version existed with its columns intact
  Malformed malformed;
};
Expected<ClassifyReport> classify(const Store& store, const Manifest& parent, const ClassifyOptions& o);
nlohmann::json to_json(const ClassifyReport& r);

// Scores computed elsewhere (pacer.curate's Python callables): JSON lines
// {"input": I, "row": R, "value": V} for each sample of `parent`.
Expected<Manifest> import_scores(const Store& store, const Manifest& parent, const std::string& name, const std::string& file,
                                 const nlohmann::json& source);

// A loaded fastText model (libfasttext). Thread-safe predictions.
class Model {
 public:
  // A file that is not a fastText model, a truncated one, or an
  // unsupervised one: a kConfig error naming it.
  static Expected<std::shared_ptr<Model>> load(const std::string& path);
  ~Model();
  // The labels with their probabilities, best first (k < 0: all).
  std::vector<std::pair<float, std::string>> predict(const std::string& text, int k) const;
  std::vector<std::string> labels() const;
  const std::string& path() const { return path_; }
  const std::string& xxh3() const { return xxh3_; }
  struct Impl;

 private:
  // classify scores through Impl: label ids, no strings per sample.
  friend Expected<ClassifyReport> classify(const Store& store, const Manifest& parent, const ClassifyOptions& o);
  Model() = default;
  std::unique_ptr<Impl> impl_;
  std::string path_, xxh3_;
};
// fastText reads a line of whitespace-separated tokens: newlines become spaces.
std::string fasttext_line(const std::string& text);

// ---------------------------------------------------------------------------
// dedup and decontaminate

// MinHash over word shingles with LSH banding: candidates share all `rows`
// values of at least one of `bands` bands; a candidate pair is a duplicate
// when the exact Jaccard similarity of its shingle sets reaches `threshold`.
struct DedupOptions {
  std::vector<std::string> against;  // other versions or inputs whose samples count as earlier
  int shingle = 5;
  int bands = 32;
  int rows = 4;
  double threshold = 0.8;
  bool near = true;  // false: exact (normalised) duplicates only
  int jobs = 0;
  bool strict = false;
};
struct DedupReport {
  Manifest version;
  std::uint64_t samples = 0, exact = 0, near = 0, candidates = 0, against_samples = 0;
  Malformed malformed;
};
Expected<DedupReport> dedup(const Store& store, const Manifest& parent, const DedupOptions& o);
nlohmann::json to_json(const DedupReport& r);

struct DecontaminateOptions {
  std::vector<std::string> benchmarks;  // text (a line each) or JSON-lines files
  int n = 13;
  std::uint64_t min_overlap = 1;  // n-grams a sample must share to be contaminated
  bool strict = false;
};
struct DecontaminateReport {
  Manifest version;
  std::uint64_t samples = 0, contaminated = 0, benchmark_lines = 0, benchmark_ngrams = 0, short_lines = 0;
  Malformed malformed;
};
Expected<DecontaminateReport> decontaminate(const Store& store, const Manifest& parent, const DecontaminateOptions& o);
nlohmann::json to_json(const DecontaminateReport& r);

// ---------------------------------------------------------------------------
// filter

// An expression over score columns: comparisons (== != < <= > >=) of
// columns, numbers, "strings", true and false; and, or, not, parentheses; a
// column alone is true when it is true (a boolean) or non-zero. A row whose
// column is null fails every comparison of it. Top-level `and` terms are the
// clauses counted one by one.
class Expr {
 public:
  // Syntax errors name the column (byte offset) of the expression; at most
  // 4096 bytes and 64 levels of nesting.
  static Expected<Expr> parse(const std::string& text);
  ~Expr();
  Expr(Expr&&) noexcept;
  Expr& operator=(Expr&&) noexcept;
  std::vector<std::string> clauses() const;      // the clauses' texts
  std::vector<std::string> columns() const;      // every column named, sorted
  // Evaluates clause k with `value(column)` giving the row's values.
  bool eval_clause(std::size_t k, const std::function<const nlohmann::json&(const std::string&)>& value) const;
  struct Node;

 private:
  Expr() = default;
  std::string text_;
  std::vector<std::unique_ptr<Node>> clauses_;
  std::vector<std::string> clause_text_;
};

struct FilterReport {
  Manifest version;
  std::uint64_t samples = 0, kept = 0, dropped = 0;
  struct Clause {
    std::string text;
    std::uint64_t failed = 0;   // samples failing it, whatever the others say
    std::uint64_t dropped = 0;  // samples it is the first failing clause of
  };
  std::vector<Clause> clauses;
  Malformed malformed;
};
// An unknown column is a kUsage error naming it and the columns there are.
Expected<FilterReport> filter(const Store& store, const Manifest& parent, const std::string& expression, bool strict);
nlohmann::json to_json(const FilterReport& r);

// ---------------------------------------------------------------------------
// train and eval (annotation sets: schema pacer.annotations/1)

struct Annotated {
  std::string id, text, label;
};
struct AnnotationSet {
  std::string dir, version, source;
  std::vector<std::string> labels;
  std::vector<Annotated> samples;  // majority label per sample, in first-seen order
  std::uint64_t ties = 0;          // samples whose annotators tied: skipped
  std::uint64_t lines = 0;
  Malformed malformed;
};
Expected<AnnotationSet> read_annotations(const std::string& dir, bool strict);
// Whether a sample is held out: a hash of its id, so the split is the same
// for train and eval and does not move when samples are added.
bool held_out(const std::string& id, double fraction);

struct TrainOptions {
  std::string out;  // the model file
  double holdout = 0.2;
  int epoch = 25, dim = 32, word_ngrams = 2, bucket = 100000, seed = 1, threads = 1;
  double lr = 0.5;
  bool strict = false;
};
struct EvalReport {
  std::string model, annotations;
  std::uint64_t samples = 0;
  std::vector<std::string> labels;
  std::vector<std::vector<std::uint64_t>> confusion;  // [true][predicted]
  struct PerLabel {
    std::string label;
    double precision = 0, recall = 0, f1 = 0;
    std::uint64_t support = 0;
  };
  std::vector<PerLabel> per_label;
  double accuracy = 0;
  std::uint64_t unknown_labels = 0;  // held-out samples whose label the model does not know
};
struct TrainReport {
  Manifest version;  // step "model"
  std::uint64_t train_samples = 0, heldout_samples = 0, ties = 0;
  EvalReport eval;
};
Expected<TrainReport> train(const Store& store, const std::string& annotations, const TrainOptions& o);
// `holdout` 0: every annotated sample.
Expected<EvalReport> evaluate(const std::string& model, const std::string& annotations, double holdout, bool strict);
nlohmann::json to_json(const EvalReport& r);
nlohmann::json to_json(const TrainReport& r);

}  // namespace pacer::curate
