// Annotate: domain experts label samples in a small web app; labels go straight to an SQLite store,
// agreement between annotators is measured, and the labels are exported as a versioned annotation set.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"

struct sqlite3;

namespace pacer::annotate {

// ---------------------------------------------------------------------------
// Inputs

// One label of labels.toml: [[label]] name = "safe", key = "s", description = "...".
// Keys are single characters (default: 1, 2, ... 9 in file order); space and
// backspace are the page's skip and undo.
struct Label {
  std::string name;
  std::string key;
  std::string description;
};
Expected<std::vector<Label>> read_labels(const std::string& path);

// A guideline file; its version is "v" + the XXH3-64 of its bytes, so a
// changed file is a new version and an unchanged one keeps its id.
struct Guideline {
  std::string version;  // "v" + xxh3
  std::string path;
  std::string xxh3;     // 16 lower-case hex digits
  std::string text;
};
Expected<Guideline> read_guideline(const std::string& path);

// "v" + 16 lower-case hex digits of XXH3-64 over `canonical` (the id scheme
// shared with pacer curate: the same content gives the same id).
std::string version_id(std::string_view canonical);

// A sample to label: its id (the "id" field, else BASENAME:LINE for JSON
// lines, the member key for shards) and its text ("text", or the messages'
// contents joined with "\n", each prefixed with its role).
struct Sample {
  std::string id;
  std::string text;
};
struct SampleSet {
  std::string source;
  std::vector<Sample> samples;
  std::uint64_t malformed = 0;            // lines or shard samples skipped
  std::vector<std::string> malformed_at;  // the first few, as "FILE:LINE: why"
};
// A JSON-lines file or a directory of pacer shards (its manifest.json, else
// its *.tar). Malformed lines are counted, never fatal; two samples with one
// id are an error naming both places.
Expected<SampleSet> read_samples(const std::string& source);

// ---------------------------------------------------------------------------
// The store: one SQLite file (WAL, synchronous=FULL) that every write reaches
// before the request is answered. Thread-safe; several processes may share it.

struct Progress {
  std::int64_t samples = 0;   // in the store
  std::int64_t labelled = 0;  // by this annotator
  std::int64_t skipped = 0;   // by this annotator and not labelled since
};

struct LabelRecord {
  std::string sample;
  std::string label;
  std::string annotator;
  std::string time;  // ISO-8601 UTC, milliseconds
  std::string guideline_version;
  std::string text;
};

class Store {
 public:
  // Opens (create: or creates) the store. A file that is not a store, or one
  // written by a newer schema, is a kConfig error naming it.
  static Expected<std::unique_ptr<Store>> open(const std::string& path, bool create);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  const std::string& path() const { return path_; }

  // Binds the store to its source on first use; another source later is a usage error.
  Status bind_source(const std::string& source);
  std::string source();
  // Records the label set. A label that has labels in the store cannot be dropped.
  Status set_labels(const std::vector<Label>& labels);
  Expected<std::vector<std::string>> labels();
  // Adds the samples not yet in the store, after those that are (the order annotators see).
  Status add_samples(const std::vector<Sample>& samples);
  Status add_guideline(const Guideline& g);
  Expected<std::vector<Guideline>> guidelines();
  bool has_guideline(const std::string& version);

  // A new annotator: returns their token (128 random bits, hex). A name in
  // use is a usage error; names are [A-Za-z0-9_.-], 1 to 64 characters.
  Expected<std::string> add_annotator(const std::string& name);
  std::vector<std::string> annotators();
  // The annotator a token belongs to, if any.
  std::optional<std::string> annotator_for(const std::string& token);

  // The next sample for `annotator`: the first in store order they neither
  // labelled nor skipped; when only skipped ones are left, the first of those.
  struct Next {
    std::optional<Sample> sample;
    bool skipped_before = false;
    Progress progress;
  };
  Expected<Next> next(const std::string& annotator);
  Expected<std::optional<Sample>> sample(const std::string& id);
  Expected<Progress> progress(const std::string& annotator);

  // One label per annotator and sample (a second replaces theirs; another
  // annotator's is never touched), under the guideline version they read.
  Status label(const std::string& annotator, const std::string& sample, const std::string& label,
               const std::string& guideline_version);
  Status skip(const std::string& annotator, const std::string& sample);
  // Takes back the annotator's last label or skip; returns its sample (none: nothing to undo).
  Expected<std::optional<std::string>> undo(const std::string& annotator);

  // Every label, in sample order then annotator name.
  Expected<std::vector<LabelRecord>> all_labels(const std::string& guideline_version = "");

 private:
  Store() = default;
  Status exec(const char* sql);
  sqlite3* db_ = nullptr;
  std::string path_;
  std::mutex mu_;
};

// ---------------------------------------------------------------------------
// Agreement

// Cohen's kappa over pairs of labels (one annotator's, the other's) of the
// same samples; nullopt where it is undefined (no pairs, or chance agreement 1).
struct Kappa {
  std::optional<double> kappa;
  double observed = 0;  // agreement seen
  double expected = 0;  // agreement by chance
  std::int64_t samples = 0;
};
Kappa cohen_kappa(const std::vector<std::pair<std::string, std::string>>& pairs);
// Fleiss' kappa from per-sample label counts (counts[i][j]: raters who gave
// sample i label j); samples with fewer than two raters are left out, and a
// varying number of raters per sample is allowed (each sample's agreement is
// over its own raters).
Kappa fleiss_kappa(const std::vector<std::vector<std::int64_t>>& counts);

struct AgreementReport {
  std::string store;
  std::string method;  // "cohen" (2 annotators), "fleiss" (3 or more), "none"
  std::vector<std::string> annotators;
  std::vector<std::string> labels;
  std::string guideline_version;  // "" = every version
  Kappa overall;
  struct Pair {
    std::string a, b;
    Kappa kappa;
  };
  std::vector<Pair> pairs;  // Cohen's kappa of every pair of annotators
};
Expected<AgreementReport> agreement(Store& store, const std::string& guideline_version = "");
nlohmann::json to_json(const AgreementReport& r);
std::string to_text(const AgreementReport& r);

// ---------------------------------------------------------------------------
// Export: OUT/manifest.json (schema pacer.annotations/1) and OUT/labels.jsonl,
// one line per sample label (docs/annotate.md). OUT is replaced as a whole:
// a reader sees the old set or the new one.

struct ExportReport {
  std::string out;
  std::string version;
  std::string source;
  std::int64_t samples = 0;
  std::int64_t labels = 0;
  std::int64_t annotators = 0;
  std::int64_t guidelines = 0;
};
// `source`: what the manifest names as the source ("" = the store's).
Expected<ExportReport> export_set(Store& store, const std::string& out, const std::string& source = "");
nlohmann::json to_json(const ExportReport& r);

// ---------------------------------------------------------------------------
// The web app

struct ServeOptions {
  std::string source;
  std::string labels;      // labels.toml
  std::string guidelines;  // guide.md
  std::string store = "annotations.db";
  std::string bind = "127.0.0.1";
  int port = 0;  // 0: any free port
  std::vector<std::string> add_annotators;
  // Called once the server listens: its URL, and each added annotator with their token.
  std::function<void(const std::string& url, const std::vector<std::pair<std::string, std::string>>& tokens,
                     const SampleSet& samples)>
      on_ready;
};
// Serves until SIGINT or SIGTERM.
Status serve(const ServeOptions& options);

}  // namespace pacer::annotate
