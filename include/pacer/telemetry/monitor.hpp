// `pacer monitor` as a library call: run or attach to a process, sample it, write the catalog, serve Prometheus.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"
#include "pacer/telemetry/records.hpp"

namespace pacer::telemetry {

struct MonitorOptions {
  std::vector<std::string> command;  // run this (argv, no shell) ...
  int pid = 0;                       // ... or attach to this process
  double interval_s = 1.0;
  std::string db;                    // empty: default_catalog_name()
  std::int64_t run_id = 0;           // 0: a new run; else join this run of db (Catalog::continue_run)
  std::string steps_file;            // JSON-lines step records to ingest while running
  std::string prometheus;            // "HOST:PORT" or "PORT" (loopback); empty: none
  bool gpus = true;
  bool per_core = true;
  bool threads = true;               // the busiest thread of the command's tree (SamplerOptions::threads)
  std::string root;                  // prefixed to /proc and /sys (tests)
  std::int64_t db_max_pages = 0;     // test seam, see CatalogOptions::max_pages
  // Called with warnings as they happen (the CLI prints them to stderr).
  std::function<void(const std::string&)> warn;
};

struct MonitorResult {
  int exit_code = 0;  // the command's (128 + signal when it was killed); 0 for --pid
  std::string db;
  std::int64_t run_id = 0;
  std::uint64_t samples = 0;   // sampling passes
  std::uint64_t readings = 0;  // values written
  std::uint64_t steps = 0;     // step records in the run (steps_file and pacer.telemetry)
  std::uint64_t malformed_lines = 0;
  std::vector<std::string> malformed_examples;  // "FILE:LINE: why"
  std::uint64_t dropped = 0;   // records not written (catalog stopped, or a failed write)
  std::uint64_t nonfinite = 0;  // NaN or infinite values skipped (the rest of their pass is written)
  std::string catalog_status;  // "ok" or why writing stopped
  double wall_s = 0;
  double sampler_cpu_s = 0;    // CPU time of the monitor process over the run
  std::vector<std::string> notes;  // sources skipped and why
  std::string prometheus_url;
  // The sampler's CPU time as a share of one core over the run.
  double sampler_core_percent() const { return wall_s > 0 ? 100.0 * sampler_cpu_s / wall_s : 0; }
};

// Runs `command` (or follows `pid`) until it ends, sampling every
// interval_s. The command inherits stdin/stdout/stderr and gets
// PACER_TELEMETRY_DB and PACER_RUN_ID in its environment so that
// pacer.telemetry in it writes to the same run. SIGINT, SIGTERM, SIGHUP,
// SIGUSR1, SIGUSR2 and SIGQUIT received by the monitor are forwarded to the
// command. Catalog trouble (a full disk) never stops the command. Fails only
// when the command cannot be started or the catalog cannot be opened.
Expected<MonitorResult> run_monitor(const MonitorOptions& options);
// The record of `pacer monitor --json` (schema pacer.monitor/1, docs/telemetry.md).
nlohmann::json to_json(const MonitorResult& r);

// Prometheus text exposition (format 0.0.4) of one sample: HELP and TYPE per
// family, labels node, gpu and device; counters as NAME_total with their
// cumulative value.
std::string render_prometheus(const Sample& sample, const std::string& node);

class Catalog;

// The training metrics of /metrics, from the newest step record (by its time
// "t") of each rank of one run, whoever wrote it: pacer.telemetry in the
// command, --steps, another process of the job.
class StepGauges {
 public:
  // Reads the steps added since the last call: rows are looked at once, so a
  // pass costs the new rows, not the run's whole history.
  Status update(Catalog& catalog, std::int64_t run_id);
  // pacer_step_time_seconds, pacer_loss, pacer_tokens_per_second and
  // pacer_data_wait_ratio, labels rank and node (the host that wrote the
  // step, else `node`); a rank's value is left out when its newest step
  // lacks it.
  std::string render(const std::string& node) const;

 private:
  struct Latest {
    double t = 0;
    std::string node;
    std::optional<double> step_time_s, loss, tokens, data_wait_s;
  };
  std::map<std::int64_t, Latest> by_rank_;
  std::int64_t seen_rowid_ = 0;
};

// Parses "PORT", "HOST:PORT" or "[V6]:PORT"; a bare port binds to 127.0.0.1.
struct ListenAddress {
  std::string host;
  int port = 0;
};
Expected<ListenAddress> parse_listen_address(const std::string& text);

}  // namespace pacer::telemetry
