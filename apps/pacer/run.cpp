// `pacer run`: supervise a training command inside a Slurm job (checkpoint, requeue, restart).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <algorithm>
#include <memory>

#include "commands.hpp"
#include "output.hpp"
#include "run_monitor.hpp"
#include "pacer/core/error.hpp"
#include "pacer/core/time.hpp"
#include "pacer/core/units.hpp"
#include "pacer/run.hpp"
#include "pacer/hw/system.hpp"
#include "pacer/telemetry.hpp"
#include "pacer/telemetry/catalog.hpp"
#include "pacer/vet/vet.hpp"

namespace pacer::cli {
namespace {

// --vet quick: this node's quick vet with the user's vet options, as the
// supervisor's gate before CMD.
Expected<run::VetQuickVerdict> vet_quick(vet::VetOptions vo) {
  vo.quick = true;
  auto report = vet::run_vet(vo);
  if (!report) return report.error();
  run::VetQuickVerdict v;
  for (const auto& c : report->checks)
    if (c.status == vet::CheckStatus::kFail || c.status == vet::CheckStatus::kError) v.failed.push_back(c.name);
  v.passed = report->verdict() == "pass" && !report->interrupted;
  if (report->interrupted) v.summary = "interrupted";
  else if (!v.passed) v.summary = fmt::format("failed: {}", fmt::join(v.failed, " "));
  else v.summary = fmt::format("passed ({} checks)", report->checks.size());
  return v;
}

// `pacer vet`'s options, as `pacer run --vet-X` takes them.
struct VetArgs {
  std::string profile;
  std::string baseline;
  std::vector<std::string> only, skip, inject;
  std::string timeout;
  int expect_gpus = -1;
  bool any() const {
    return !profile.empty() || !baseline.empty() || !only.empty() || !skip.empty() || !inject.empty() ||
           !timeout.empty() || expect_gpus >= 0;
  }
};

// vet's messages name its flags as `pacer vet` spells them ("--skip 'x': ...");
// here the user typed --vet-skip.
std::string vet_flag_message(const std::string& message) {
  for (const char* flag : {"--only", "--skip", "--inject"})
    if (message.starts_with(flag)) return "--vet-" + message.substr(2);
  return "--vet quick: " + message;
}

struct RunArgs {
  std::vector<std::string> argv;
  std::string ckpt_dir;
  std::string signal = "USR1";
  std::string request_signal = "none";
  std::string request_file;
  std::string before = "0";
  std::string grace = "2m";
  std::string stop_timeout = "30s";
  int max_restarts = 3;
  int give_up_after = 2;
  std::string restart_delay = "1s";
  std::string hang_timeout = "auto";
  std::string requeue = "scontrol";
  std::string end_time;
  std::string vet = "none";
  VetArgs vet_args;
  std::string log;
  bool quiet = false;
  bool monitor = false;
  std::string monitor_db;
  std::string monitor_interval = "1s";
  // Several nodes (--nodes).
  int nodes = 0;
  int min_nodes = 0;
  std::vector<std::string> node_list;
  std::string launcher;
  std::string vet_launcher;
  std::string leader_addr;
  std::string connect_timeout = "2m";
};

// The --vet-* options as `pacer vet` takes them, for the leader's per-node vets.
std::vector<std::string> vet_argv(const VetArgs& va) {
  std::vector<std::string> v;
  auto add = [&](const char* flag, const std::string& value) {
    if (!value.empty()) v.insert(v.end(), {flag, value});
  };
  add("--profile", va.profile);
  add("--baseline", va.baseline);
  add("--only", fmt::format("{}", fmt::join(va.only, ",")));
  add("--skip", fmt::format("{}", fmt::join(va.skip, ",")));
  for (const auto& i : va.inject) add("--inject", i);
  add("--timeout", va.timeout);
  if (va.expect_gpus >= 0) add("--expect-gpus", std::to_string(va.expect_gpus));
  return v;
}

// A launch prefix as words (no shell: quoting is not interpreted).
std::vector<std::string> split_words(const std::string& text) {
  std::vector<std::string> out;
  std::string w;
  for (char ch : text + ' ') {
    if (ch == ' ' || ch == '\t') {
      if (!w.empty()) out.push_back(w);
      w.clear();
    } else {
      w += ch;
    }
  }
  return out;
}

double duration_arg(const std::string& flag, const std::string& text) {
  auto d = parse_duration(text);
  if (!d) usage_error(fmt::format("{} {}: {}", flag, text, d.error().message));
  return *d;
}

// The node files of a `--nodes --monitor` job into the job's catalog: the
// runs of the leader's job key become its run. A node file that this host
// cannot read (node-local storage) of a node whose agent ran is named, to be
// merged by hand.
void merge_node_catalogs(const std::string& db, const std::vector<std::string>& allocation,
                         const std::vector<std::string>& agents) {
  std::vector<std::string> files, missing;
  for (const auto& n : allocation) {
    const std::string f = node_catalog(db, n);
    if (::access(f.c_str(), R_OK) == 0) files.push_back(f);
    else if (std::find(agents.begin(), agents.end(), n) != agents.end()) missing.push_back(f);
  }
  if (!missing.empty())
    std::fprintf(stderr, "pacer run: warning: node catalog(s) not found here (node-local storage?): %s; merge them with "
                 "`pacer catalog merge %s FILE...`\n", fmt::format("{}", fmt::join(missing, " ")).c_str(), db.c_str());
  if (files.empty()) return;
  auto m = telemetry::merge_catalogs(db, files);
  if (!m) {
    std::fprintf(stderr, "pacer run: warning: merging the node catalogs into %s: %s (the node files stay)\n", db.c_str(),
                 m.error().message.c_str());
    return;
  }
  std::fprintf(stderr, "pacer run: %zu node catalog(s) merged into %s (now %lld samples, %lld steps, %lld events)\n",
               files.size(), db.c_str(), static_cast<long long>(m->samples), static_cast<long long>(m->steps),
               static_cast<long long>(m->events));
}

int run(const RunArgs& a) {
  run::Options o;
  o.argv = a.argv;
  o.ckpt_dir = a.ckpt_dir;
  o.slurm_signal = unwrap(run::parse_signal(a.signal));
  if (a.request_signal != "none") o.request_signal = unwrap(run::parse_signal(a.request_signal));
  o.request_file = a.request_file;
  o.before_s = duration_arg("--before", a.before);
  o.grace_s = duration_arg("--grace", a.grace);
  o.stop_timeout_s = duration_arg("--stop-timeout", a.stop_timeout);
  o.restart_delay_s = duration_arg("--restart-delay", a.restart_delay);
  // "auto": derived from the heartbeats seen (docs/run.md, "Hangs"); 0: off.
  if (a.hang_timeout != "auto") o.hang_timeout_s = duration_arg("--hang-timeout", a.hang_timeout);
  o.max_restarts = a.max_restarts;
  o.give_up_after = a.give_up_after;
  if (a.requeue == "scontrol") o.requeue = run::RequeueMode::kScontrol;
  else if (a.requeue == "exit") o.requeue = run::RequeueMode::kExit;
  else usage_error(fmt::format("--requeue {}: expected scontrol or exit", a.requeue));
  if (!a.end_time.empty()) {
    // "+90s" is relative to now (testing a walltime without Slurm); a plain number is Unix seconds.
    if (a.end_time[0] == '+') o.end_time = static_cast<double>(std::time(nullptr)) + duration_arg("--end-time", a.end_time.substr(1));
    else {
      try {
        o.end_time = std::stod(a.end_time);
      } catch (const std::exception&) {
        usage_error(fmt::format("--end-time {}: expected Unix seconds or +DURATION", a.end_time));
      }
    }
  }
  if (a.vet == "quick") {
    const VetArgs& va = a.vet_args;
    vet::VetOptions vo;
    vo.quick = true;
    if (!va.profile.empty()) vo.profile = va.profile;
    if (!va.baseline.empty()) vo.baseline_path = va.baseline;
    vo.only = va.only;
    vo.skip = va.skip;
    if (!va.timeout.empty()) {
      const double t = duration_arg("--vet-timeout", va.timeout);
      if (!(t > 0)) usage_error(fmt::format("--vet-timeout {}: expected a positive duration", va.timeout));
      vo.timeout_s = t;
    }
    if (va.expect_gpus >= 0) vo.expect_gpus = static_cast<unsigned>(va.expect_gpus);
    for (const auto& s : va.inject) {
      auto inj = vet::parse_injection(s);
      if (!inj) usage_error(vet_flag_message(inj.error().message));
      vo.injections.push_back(*inj);
    }
    // Refused now, not after the vet has taken the allocation's first minutes.
    if (auto p = vet::load_profile(vo.profile); !p)
      usage_error(fmt::format("--vet-profile {}: {}", vo.profile, p.error().message));
    if (auto st = vet::check_options(vo); !st) usage_error(vet_flag_message(st.error().message));
    o.vet_quick = [vo] { return vet_quick(vo); };
    if (a.nodes > 0) o.vet_quick = nullptr;  // the leader vets every node through the vet launcher
  } else if (a.vet != "none") {
    usage_error(fmt::format("--vet {}: expected quick or none", a.vet));
  } else if (a.vet_args.any()) {
    usage_error("--vet-profile, --vet-baseline, --vet-only, --vet-skip, --vet-timeout, --vet-expect-gpus and "
                "--vet-inject need --vet quick");
  }
  if (a.nodes > 0) {
    run::ClusterOptions c;
    c.nodes = a.nodes;
    c.min_nodes = a.min_nodes;
    c.node_list = a.node_list;
    c.launcher = split_words(a.launcher);
    c.vet_launcher = split_words(a.vet_launcher);
    if (a.vet == "quick") c.vet_args = vet_argv(a.vet_args);
    c.pacer = self_exe();
    c.leader_addr = a.leader_addr;
    c.connect_timeout_s = duration_arg("--connect-timeout", a.connect_timeout);
    o.cluster = std::move(c);
  } else if (a.min_nodes || !a.node_list.empty() || !a.launcher.empty() || !a.vet_launcher.empty() ||
             !a.leader_addr.empty()) {
    usage_error("--min-nodes, --node-list, --launcher, --vet-launcher and --leader-addr need --nodes");
  }
  o.log_path = a.log;
  // --monitor: every attempt of CMD runs under `pacer monitor` (which passes
  // signals and the exit status through). The supervisor begins one catalog
  // run and every attempt's monitor joins it (--run-id), so the samples,
  // CMD's steps and the supervisor's decisions (events) are one run: the
  // latest run that `pacer report` and `pacer score` read holds them all.
  // With --nodes each agent samples into its node's own file (SQLite's WAL
  // needs every writer on one host; the path may be on a shared file
  // system), in a run of the leader's job key, and the leader merges the
  // files into its run when it ends.
  std::unique_ptr<telemetry::Catalog> catalog;
  std::unique_ptr<telemetry::Recorder> events;
  std::int64_t run_id = 0;
  std::string db;
  const char* job = std::getenv("SLURM_JOB_ID");
  if (a.monitor) {
    const double interval = duration_arg("--monitor-interval", a.monitor_interval);
    db = a.monitor_db;
    if (db.empty() && a.nodes > 0) {
      // The job's catalog, not this host's file of a multi-node job (that name is a node's).
      const char* env = std::getenv("PACER_TELEMETRY_DB");
      db = env && *env ? env : job && *job ? fmt::format("pacer-{}.db", job) : "pacer-telemetry.db";
    }
    if (db.empty()) db = telemetry::catalog_from_env();
    catalog = unwrap(telemetry::Catalog::open(db));
    telemetry::RunInfo ri;
    if (job) ri.job_id = job;
    // Runs are joined by job id when node files are merged; a bare job needs a key of its own.
    if (a.nodes > 0 && ri.job_id.empty()) ri.job_id = fmt::format("pacer-run-{}-{}", hw::hostname(), ::getpid());
    ri.command = fmt::format("pacer run{} -- {}", a.nodes > 0 ? fmt::format(" --nodes {}", a.nodes) : "",
                             fmt::join(o.argv, " "));
    ri.hostname = hw::hostname();
    ri.started = wall_now();
    ri.interval_s = interval;
    run_id = unwrap(catalog->begin_run(ri));
    if (o.cluster)
      o.cluster->agent_args = {"--monitor-db", db, "--monitor-interval", a.monitor_interval, "--monitor-job", ri.job_id};
    else
      o.argv = monitored(db, run_id, a.monitor_interval, o.argv);
    telemetry::RecorderOptions ro;
    ro.db = db;
    ro.run_id = run_id;
    events = unwrap(telemetry::Recorder::open(ro));
  }
  const bool quiet = a.quiet;
  telemetry::Recorder* rec = events.get();
  // --nodes: the allocation (whose node files are merged) and the nodes whose agents connected.
  auto allocation = std::make_shared<std::vector<std::string>>();
  auto agents = std::make_shared<std::vector<std::string>>();
  o.on_event = [quiet, rec, allocation, agents](const nlohmann::json& e) {
    if (!quiet) std::fprintf(stderr, "%s\n", run::format_event(e).c_str());
    if (!rec) return;
    // The vet before CMD is a vet result (the report lists events whose kind
    // starts with "vet"); every other decision is a run.* event.
    const std::string kind = e.value("event", std::string("decision"));
    rec->event(kind == "vet" ? "vet.quick" : "run." + kind, e.value("message", std::string()));
    const std::string host = e.value("host", std::string());
    if (kind == "agent" && std::find(agents->begin(), agents->end(), host) == agents->end()) agents->push_back(host);
    if (kind == "cluster" && e.contains("allocation") && e["allocation"].is_array())
      *allocation = e["allocation"].get<std::vector<std::string>>();
  };
  auto result = run::supervise(o);
  if (rec) {
    rec->close();
    // The supervisor's outcome is the run's (the attempts' monitors each set
    // their own exit code; a requeue or a refused start is decided here).
    const int code = result ? result->exit_code : static_cast<int>(exit_code_for(result.error().kind));
    if (auto s = catalog->end_run(run_id, wall_now(), code, 0); !s)
      std::fprintf(stderr, "pacer run: warning: %s\n", s.error().message.c_str());
    if (a.nodes > 0) merge_node_catalogs(db, *allocation, *agents);
  }
  const auto out = unwrap(std::move(result));
  // stdout belongs to CMD; the verdict goes with the decision log to stderr.
  const bool ok = out.exit_code == 0 || out.requeued;
  std::fprintf(stderr, "pacer run: %s: %s (exit %d)\n", ok ? "OK" : "FAILED", out.reason.c_str(), out.exit_code);
  return out.exit_code;
}

}  // namespace

Handler register_run(CLI::App& app) {
  auto args = std::make_shared<RunArgs>();
  auto* cmd = app.add_subcommand("run", "Run a training command under a supervisor: checkpoint before the time limit, "
                                        "requeue, restart after crashes");
  cmd->add_option("--ckpt-dir", args->ckpt_dir, "Checkpoint root CMD commits to (pacer checkpoint layout)");
  cmd->add_option("--signal", args->signal, "Signal Slurm sends before the time limit (sbatch --signal): USR1, USR2 or TERM")
      ->capture_default_str();
  cmd->add_option("--request-signal", args->request_signal,
                  "Also send this signal to CMD's process group with a checkpoint request (USR1, USR2, TERM, none)")
      ->capture_default_str();
  cmd->add_option("--request-file", args->request_file,
                  "Request file created to ask for a checkpoint (default: in a private directory made under "
                  "$XDG_RUNTIME_DIR, $SLURM_TMPDIR, $TMPDIR or /tmp)");
  cmd->add_option("--before", args->before, "Ask for a checkpoint this long before the job's end time (0: signal only)")
      ->capture_default_str();
  cmd->add_option("--grace", args->grace, "How long to wait for a new committed step after a request")->capture_default_str();
  cmd->add_option("--stop-timeout", args->stop_timeout, "SIGTERM to SIGKILL when stopping CMD")->capture_default_str();
  cmd->add_option("--max-restarts", args->max_restarts, "Restarts after crashes within one allocation")->capture_default_str();
  cmd->add_option("--give-up-after", args->give_up_after,
                  "Give up after this many consecutive attempts without a new committed step")
      ->capture_default_str();
  cmd->add_option("--restart-delay", args->restart_delay, "Pause before a restart")->capture_default_str();
  cmd->add_option("--hang-timeout", args->hang_timeout,
                  "A rank without a heartbeat for this long is a hang: stacks, GPU state, then stop and restart as "
                  "a crash (auto: max(5 x p99 heartbeat interval, 2m) once 20 were seen; 0: off)")
      ->capture_default_str();
  cmd->add_option("--requeue", args->requeue, "scontrol: scontrol requeue the job; exit: only exit 75 (singleton chains)")
      ->capture_default_str();
  cmd->add_option("--end-time", args->end_time, "Job end time, Unix seconds or +DURATION (overrides Slurm)");
  cmd->add_option("--vet", args->vet, "quick: run pacer vet --quick before starting CMD; none")->capture_default_str();
  cmd->add_option("--vet-profile", args->vet_args.profile, "--vet quick: pacer vet's --profile (built-in name or TOML file)");
  cmd->add_option("--vet-baseline", args->vet_args.baseline, "--vet quick: pacer vet's --baseline (JSON report)");
  cmd->add_option("--vet-only", args->vet_args.only, "--vet quick: run only these checks or categories (comma-separated)")
      ->delimiter(',')
      ->allow_extra_args(false);
  cmd->add_option("--vet-skip", args->vet_args.skip, "--vet quick: skip these checks or categories (comma-separated)")
      ->delimiter(',')
      ->allow_extra_args(false);
  cmd->add_option("--vet-timeout", args->vet_args.timeout, "--vet quick: timeout for every check, e.g. 30s");
  cmd->add_option("--vet-expect-gpus", args->vet_args.expect_gpus, "--vet quick: GPUs this node must have (0 = any)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--vet-inject", args->vet_args.inject,
                  "--vet quick: pacer vet's --inject [NODE:]CHECK=hang|crash|VALUE (repeatable; testing the gate)")
      ->allow_extra_args(false);
  cmd->add_option("--log", args->log, "Append every decision to this file as JSON lines (pacer.run.event/1)");
  cmd->add_flag("--quiet", args->quiet, "No decision lines on stderr (the final line stays)");
  cmd->add_flag("--monitor", args->monitor, "Run CMD under `pacer monitor` and record every decision as a catalog event");
  cmd->add_option("--monitor-db", args->monitor_db, "Catalog for --monitor (default: pacer monitor's)");
  cmd->add_option("--monitor-interval", args->monitor_interval, "Sampling interval for --monitor")->capture_default_str();
  cmd->add_option("--nodes", args->nodes,
                  "Run CMD on this many nodes of the allocation, one `pacer run-agent` each; the others are spares "
                  "(docs/run.md, \"Several nodes\")")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--min-nodes", args->min_nodes, "--nodes: relaunch on fewer nodes, down to this many, when too few good "
                                                  "ones remain (default: --nodes, no shrinking)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--node-list", args->node_list, "--nodes: the allocation's nodes (default: $SLURM_JOB_NODELIST)")
      ->delimiter(',')
      ->allow_extra_args(false);
  cmd->add_option("--launcher", args->launcher,
                  fmt::format("--nodes: launch prefix for the agents; {{nodes}} and {{count}} are the chosen nodes "
                              "(default: {})", run::kDefaultLauncher));
  cmd->add_option("--vet-launcher", args->vet_launcher,
                  fmt::format("--nodes: launch prefix for one node's vet (default: {})", run::kDefaultVetLauncher));
  cmd->add_option("--leader-addr", args->leader_addr, "--nodes: the address agents connect to (default: host name)");
  cmd->add_option("--connect-timeout", args->connect_timeout, "--nodes: from the launch to every agent's connection")
      ->capture_default_str();
  // One value per occurrence (repeat the option for more): a list option
  // must not swallow what follows it, such as `--` and CMD.
  cmd->add_option("command", args->argv, "CMD and its arguments, after --")->required();
  return [args] { return run(*args); };
}

}  // namespace pacer::cli
