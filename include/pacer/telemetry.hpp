// Training metrics from inside a training loop: per-step records written to the job catalog without blocking.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "pacer/core/error.hpp"
#include "pacer/telemetry/records.hpp"

namespace pacer::telemetry {

// This process's rank: SLURM_PROCID, RANK, OMPI_COMM_WORLD_RANK or PMI_RANK
// (the first that is set and numeric), else 0.
int rank_from_env();

// The catalog a training process writes to: PACER_TELEMETRY_DB (set by
// `pacer monitor` for the command it runs), else default_catalog_name().
std::string catalog_from_env();

struct RecorderOptions {
  std::string db{};                    // empty: catalog_from_env()
  std::int64_t run_id = 0;             // 0: PACER_RUN_ID, else a new run
  int rank = -1;                       // -1: rank_from_env()
  std::string node{};                  // empty: this hostname
  std::size_t queue_capacity = 65536;  // records held before step() drops
  double flush_interval_s = 0.5;       // how often the writer commits
};

// Records training steps and events. step() and event() only append to a
// bounded in-memory queue (a short mutex hold, no I/O, no allocation beyond
// the record) and never wait for the disk: when the queue is full the record
// is dropped and counted. A background thread commits the queue to the
// catalog every flush_interval_s. Thread-safe. The destructor flushes.
class Recorder {
 public:
  static Expected<std::unique_ptr<Recorder>> open(RecorderOptions options = {});
  ~Recorder();
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  // False when the record was dropped (queue full or recorder closed).
  // Fills t (now), rank and node when the record leaves them unset.
  bool step(StepRecord record);
  bool event(std::string kind, std::string detail);
  // Blocks until everything queued so far is written (or dropped); returns
  // the first write error since the last flush.
  Status flush();
  void close();

  std::uint64_t written() const { return written_.load(); }
  std::uint64_t dropped() const { return dropped_.load(); }
  std::int64_t run_id() const { return run_id_; }
  int rank() const { return rank_; }
  const std::string& db_path() const { return db_; }

 private:
  Recorder() = default;
  void writer_loop();

  std::string db_;
  std::int64_t run_id_ = 0;
  int rank_ = 0;
  std::string node_;
  std::size_t capacity_ = 0;
  double flush_interval_s_ = 0.5;
  struct Catalogs;
  std::unique_ptr<Catalogs> cat_;
  std::mutex mu_;
  std::condition_variable cv_;       // wakes the writer
  std::condition_variable done_cv_;  // wakes flush()
  std::vector<StepRecord> steps_;
  std::vector<EventRecord> events_;
  std::uint64_t enqueued_ = 0, completed_ = 0;
  bool stop_ = false;
  bool flush_requested_ = false;
  Error last_error_;
  bool has_error_ = false;
  std::atomic<std::uint64_t> written_{0}, dropped_{0};
  std::thread writer_;
};

// One JSON-lines step record: {"step": 12, "loss": 2.1, "tokens": 4096,
// "data_wait_s": 0.01, "comm_s": 0.2, "step_time_s": 0.5, "t": 1764400000.1,
// "rank": 3, "node": "gpu017", ...}. "step" is required; unknown keys go to
// extra_json. The error says what is wrong (the caller adds file:line).
Expected<StepRecord> parse_step_json(std::string_view line);

// Reads step records appended to a JSON-lines file, as `tail -f` would: each
// poll() consumes complete lines written since the last one. Malformed lines
// are counted, never fatal; the first few are kept for the report.
class StepFileReader {
 public:
  explicit StepFileReader(std::string path) : path_(std::move(path)) {}
  // `final` also takes a last line without a trailing newline.
  std::vector<StepRecord> poll(bool final = false);
  std::uint64_t lines() const { return lines_; }
  std::uint64_t malformed() const { return malformed_; }
  // "FILE:LINE: why" for the first malformed lines.
  const std::vector<std::string>& errors() const { return errors_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::uint64_t offset_ = 0;
  std::string partial_;
  std::uint64_t lines_ = 0, malformed_ = 0;
  std::vector<std::string> errors_;
};

}  // namespace pacer::telemetry
