// `pacer monitor`: sample a command (or a running process) into the job catalog (the work is in pacer/telemetry/monitor.hpp).
#include <fmt/format.h>

#include <cstdio>
#include <string_view>

#include "commands.hpp"
#include "output.hpp"
#include "pacer/core/units.hpp"
#include "pacer/telemetry/monitor.hpp"

namespace pacer::cli {
namespace {

struct MonitorArgs {
  std::vector<std::string> command;
  int pid = 0;
  std::string interval = "1s";
  std::string db, steps, prometheus;
  bool no_gpu = false, no_per_core = false, no_threads = false, json = false, quiet = false;
  std::int64_t db_max_pages = 0;
  std::int64_t run_id = 0;
};

// How run_monitor announces the /metrics address once it listens.
constexpr std::string_view kPrometheusAt = "prometheus metrics at ";

int monitor(const MonitorArgs& a) {
  if (a.command.empty() && a.pid <= 0) usage_error("give a command after -- (pacer monitor -- python train.py) or --pid N");
  if (!a.command.empty() && a.pid > 0) usage_error("give either a command or --pid, not both");
  auto interval = parse_duration(a.interval);
  if (!interval || *interval < 0.01)
    usage_error(fmt::format("--interval '{}': expected a duration of at least 10ms, such as 1s or 100ms", a.interval));
  telemetry::MonitorOptions o;
  o.command = a.command;
  o.pid = a.pid;
  o.interval_s = *interval;
  o.db = a.db;
  if (a.run_id < 0) usage_error(fmt::format("--run {}: expected a run id of the catalog (1 or more)", a.run_id));
  o.run_id = a.run_id;
  o.steps_file = a.steps;
  o.prometheus = a.prometheus;
  o.gpus = !a.no_gpu;
  o.per_core = !a.no_per_core;
  o.threads = !a.no_threads;
  o.db_max_pages = a.db_max_pages;
  o.warn = [&](const std::string& w) {
    // --prometheus 0 picks a free port: its address is the one way to find
    // the endpoint, so it is printed (one line) even with --quiet.
    if (!a.quiet || w.starts_with(kPrometheusAt)) std::fprintf(stderr, "pacer monitor: %s\n", w.c_str());
  };
  const auto r = unwrap(telemetry::run_monitor(o));
  const double overhead = r.sampler_core_percent();
  if (a.json) {
    print(telemetry::to_json(r), true, "");
  } else if (!a.quiet) {
    // stdout belongs to the command; the summary goes to stderr.
    for (const auto& n : r.notes) std::fprintf(stderr, "pacer monitor: note: %s\n", n.c_str());
    for (const auto& m : r.malformed_examples) std::fprintf(stderr, "pacer monitor: malformed step line: %s\n", m.c_str());
    const bool ok = r.catalog_status == "ok";
    std::fprintf(stderr, "%s: %llu samples (%llu values), %llu steps, %llu malformed lines, %llu dropped -> %s (run %lld); "
                 "sampler %.2f%% of one core over %s; command exit code %d%s%s\n",
                 ok ? "OK" : "FAILED", static_cast<unsigned long long>(r.samples), static_cast<unsigned long long>(r.readings),
                 static_cast<unsigned long long>(r.steps), static_cast<unsigned long long>(r.malformed_lines),
                 static_cast<unsigned long long>(r.dropped), r.db.c_str(), static_cast<long long>(r.run_id), overhead,
                 format_duration(r.wall_s).c_str(), r.exit_code, ok ? "" : "; catalog ", ok ? "" : r.catalog_status.c_str());
  }
  return r.exit_code;
}

}  // namespace

Handler register_monitor(CLI::App& app) {
  auto args = std::make_shared<MonitorArgs>();
  CLI::App* cmd = app.add_subcommand("monitor", "Run a command (or attach to a process) and record system and training metrics");
  cmd->add_option("command", args->command, "The command to run, after --");
  cmd->add_option("--pid", args->pid, "Attach to this running process instead of starting one");
  cmd->add_option("--interval", args->interval, "Sampling interval (default 1s)");
  cmd->add_option("--db", args->db, "Catalog file (default pacer-$SLURM_JOB_ID.db, or pacer-telemetry.db)");
  cmd->add_option("--run,--run-id", args->run_id,
                  "Record into this existing run of the catalog instead of a new one (pacer run --monitor uses it)");
  cmd->add_option("--steps", args->steps, "JSON-lines file of step records to ingest while the command runs");
  cmd->add_option("--prometheus", args->prometheus, "Serve /metrics on [HOST:]PORT (HOST defaults to 127.0.0.1)");
  cmd->add_flag("--no-gpu", args->no_gpu, "Do not query NVML");
  cmd->add_flag("--no-per-core", args->no_per_core, "Record CPU busy for all CPUs only, not per core");
  cmd->add_flag("--no-threads", args->no_threads, "Do not read the command's threads (/proc/PID/task) for its busiest thread");
  cmd->add_flag("--json", args->json, "Print the summary as JSON (pacer.monitor/1) on stdout");
  cmd->add_flag("-q,--quiet", args->quiet, "No summary or warnings on stderr (the --prometheus address is still printed)");
  // A test seam: caps the catalog's size so that writing fails as on a full disk.
  cmd->add_option("--db-max-pages", args->db_max_pages)->group("");
  cmd->footer("Exit code: the command's (128+N when killed by signal N); 2 usage error, 3 runtime error. "
              "See docs/telemetry.md.");
  return [args] { return monitor(*args); };
}

}  // namespace pacer::cli
