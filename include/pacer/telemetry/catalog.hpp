// The job catalog: one SQLite file (WAL) of runs, nodes, ranks, GPUs, samples, steps and events.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"
#include "pacer/telemetry/records.hpp"

struct sqlite3;

namespace pacer::telemetry {

// The schema version this pacer writes (PRAGMA user_version, and
// meta.schema = "pacer.catalog/1"). A catalog with a newer version is refused.
inline constexpr int kCatalogSchemaVersion = 1;

struct CatalogOptions {
  // Opened SQLITE_OPEN_READONLY, and query() runs only statements that
  // change no file: no writes, ATTACH, VACUUM (INTO) or PRAGMA that sets.
  bool read_only = false;
  // query() stops a statement that runs longer (a recursive CTE without end)
  // with an error naming the limit. 0: no limit.
  double query_timeout_s = 0;
  // query() stops when its result holds more (in memory). 0: no limit.
  std::uint64_t max_result_bytes = 0;
  // Milliseconds a writer waits for another writer (the monitor and the
  // training processes share one file).
  int busy_timeout_ms = 5000;
  // Test seam: caps the file at this many pages (SQLite max_page_count), so
  // that a write fails with SQLITE_FULL exactly as on a full disk (never
  // below the pages the schema already takes). 0: no cap.
  std::int64_t max_pages = 0;
};

struct RunInfo {
  std::string job_id;    // SLURM_JOB_ID or empty
  std::string command;   // what was run, for people
  std::string hostname;  // where the run was started
  double started = 0;    // Unix seconds
  double interval_s = 0; // sampling interval; 0 for a run without a sampler
};

// One cell of a query result.
using Value = std::variant<std::monostate, std::int64_t, double, std::string>;
struct QueryResult {
  std::vector<std::string> columns;
  std::vector<std::vector<Value>> rows;
};
// The record of `pacer query --json` (schema pacer.query/1, docs/telemetry.md)
// for `query` asked of the catalog `db`: a named question, or SQL.
nlohmann::json to_json(const QueryResult& r, const std::string& db, const std::string& query, bool named_question);

// An open catalog. Writes are grouped into one transaction per call. When a
// write fails for lack of space (SQLITE_FULL, or an I/O error) the catalog
// stops writing: later writes return success without writing and count as
// dropped, and the run's catalog_status says why (so the training run goes on
// and the report can say where data ends). Not thread-safe: use one per
// thread (SQLite serialises writers across connections and processes).
class Catalog {
 public:
  // Creates the file and schema if missing; fails naming the file for a
  // newer schema version or a file that is not a catalog.
  static Expected<std::unique_ptr<Catalog>> open(const std::string& path, CatalogOptions options = {});
  ~Catalog();
  Catalog(const Catalog&) = delete;
  Catalog& operator=(const Catalog&) = delete;

  const std::string& path() const { return path_; }
  int schema_version() const { return schema_version_; }

  Expected<std::int64_t> begin_run(const RunInfo& run);
  // Sets ended and exit_code; sampler_cpu_s is added, so that the monitors
  // of several attempts sharing one run (continue_run) sum their cost.
  Status end_run(std::int64_t run_id, double ended, std::optional<int> exit_code, double sampler_cpu_s);
  // Checks that the run exists, for a writer that joins a run another
  // process began (`pacer run --monitor` runs every attempt's monitor in the
  // supervisor's run); gives it interval_s when it has none yet.
  Status continue_run(std::int64_t run_id, double interval_s);
  // The node's id, inserting it (by hostname) when new.
  Expected<std::int64_t> node_id(const NodeInfo& node);
  Status add_gpus(std::int64_t node_id, const std::vector<GpuRecord>& gpus);
  Status write_sample(std::int64_t run_id, std::int64_t node_id, const Sample& sample);
  Status write_steps(std::int64_t run_id, const std::vector<StepRecord>& steps);
  Status write_event(std::int64_t run_id, std::int64_t node_id, const EventRecord& event);

  // Runs SQL: any on a writable catalog; on a read-only one only statements
  // that change no file (a refused one is a usage error naming it). Past
  // query_timeout_s or max_result_bytes: a runtime error naming the limit.
  Expected<QueryResult> query(const std::string& sql);

  // Deletes a run this writer began and nothing recorded (the monitor's
  // command could not be started), so that a failed start leaves no run.
  Status discard_run(std::int64_t run_id);

  bool writes_stopped() const { return !stop_reason_.empty(); }
  const std::string& stop_reason() const { return stop_reason_; }
  // Records of batches that were not written (disk full, or a failed
  // transaction: the batch is lost, later batches are still written).
  std::uint64_t dropped_records() const { return dropped_; }
  // Values skipped (or stored as NULL where the column allows) because they
  // were NaN or infinite; the rest of their batch is written.
  std::uint64_t nonfinite_values() const { return nonfinite_; }

  sqlite3* handle() { return db_; }

 private:
  Catalog(std::string path, sqlite3* db) : path_(std::move(path)), db_(db) {}
  // The authorizer of a read-only catalog: what it refused, for the error.
  static int authorize(void* self, int action, const char* a, const char* b, const char* db, const char* trigger);
  Status exec(const std::string& sql);
  Status create_schema();
  // Wraps a write in a transaction; turns "disk full" into the stopped state.
  template <class Fn>
  Status write(std::int64_t run_id, std::size_t records, Fn&& fn);
  Expected<std::int64_t> metric_id(const MetricDef& def);
  Expected<std::int64_t> gpu_id(std::int64_t node_id, int index);

  std::string path_;
  sqlite3* db_ = nullptr;
  int schema_version_ = 0;
  CatalogOptions options_;
  std::string refused_;  // set by authorize()
  std::string stop_reason_;
  std::uint64_t dropped_ = 0;
  std::uint64_t nonfinite_ = 0;
  std::vector<std::pair<const MetricDef*, std::int64_t>> metric_ids_;
  std::vector<std::pair<std::pair<std::int64_t, int>, std::int64_t>> gpu_ids_;
  std::vector<std::pair<std::string, std::int64_t>> node_ids_;
};

// The default catalog file name for this job: pacer-JOBID.db under Slurm
// (pacer-JOBID-HOST.db when the job spans nodes, to merge later), else
// pacer-telemetry.db.
std::string default_catalog_name();

// Merges catalogs into `out` (created, or extended when it exists): nodes are
// matched by hostname, GPUs by node and index, runs by job id (a job's
// per-node files become one run), metrics by name. The result is written to
// a temporary file and renamed into place. Nothing is merged twice: an input
// that is `out` itself is a usage error, one given twice (the same file by
// any name) is merged once, and a run already merged into `out` (the same
// job id, host, start time and command, recorded in run_sources) is skipped;
// each skip is a line in `skipped`.
struct MergeResult {
  std::size_t inputs = 0;  // files merged
  std::int64_t runs = 0, nodes = 0, samples = 0, steps = 0, events = 0;  // runs, nodes: in out; the rest: added
  std::vector<std::string> skipped;
};
Expected<MergeResult> merge_catalogs(const std::string& out, const std::vector<std::string>& inputs);
// The record of `pacer catalog merge --json` (schema pacer.catalog.merge/1).
nlohmann::json to_json(const MergeResult& r, const std::string& out, const std::vector<std::string>& inputs);

// The check behind every `--run ID` (pacer query, score, report, monitor):
// a usage error naming the id and listing the catalog's runs (newest first)
// when it holds no run `run_id`.
Status check_run(Catalog& catalog, std::int64_t run_id);

}  // namespace pacer::telemetry
