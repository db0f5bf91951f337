#include "pacer/telemetry/monitor.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>

#include "pacer/core/process.hpp"
#include "pacer/hw/system.hpp"
#include "pacer/telemetry.hpp"
#include "pacer/telemetry/catalog.hpp"
#include "pacer/telemetry/sampler.hpp"

extern char** environ;

namespace pacer::telemetry {

namespace {

volatile sig_atomic_t g_child = 0;
volatile sig_atomic_t g_stop = 0;

constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};

// Signals typed at the terminal reach the whole foreground process group, the
// command included, so only signals sent to the monitor alone (kill, scancel
// --signal, a batch system) are passed on; otherwise the command would get
// each Ctrl-C twice.
void on_signal(int sig, siginfo_t* info, void*) {
  const pid_t child = g_child;
  if (child > 0) {
    if (!info || info->si_code != SI_KERNEL) ::kill(child, sig);
  } else {
    g_stop = 1;
  }
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string join_command(const std::vector<std::string>& argv) {
  std::string s;
  for (const auto& a : argv) {
    if (!s.empty()) s += ' ';
    s += a.find_first_of(" \t'\"") == std::string::npos ? a : "'" + a + "'";
  }
  return s;
}

// The live /metrics endpoint: the latest exposition text, replaced each pass.
class Exporter {
 public:
  // httplib gives each connection a worker for as long as it stays open (up
  // to the keep-alive timeout, 5 s by default, between requests), from a pool
  // of about 8: a handful of idle connections (port scanners, a load balancer's
  // probes, stuck clients) would hold every worker and delay the scrape.
  // Workers are cheap while they wait; idle connections are let go after a
  // second and a slow request after two.
  static constexpr std::size_t kWorkers = 64;
  Exporter() {
    server_.new_task_queue = [] { return new httplib::ThreadPool(kWorkers); };
    server_.set_keep_alive_timeout(1);
    server_.set_keep_alive_max_count(20);
    server_.set_read_timeout(2, 0);
    server_.set_write_timeout(2, 0);
  }

  Status start(const ListenAddress& a) {
    server_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      std::lock_guard lk(mu_);
      res.set_content(text_, "text/plain; version=0.0.4; charset=utf-8");
    });
    server_.Get("/", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("pacer monitor: metrics at /metrics\n", "text/plain");
    });
    if (a.port == 0) {
      port_ = server_.bind_to_any_port(a.host);
      if (port_ <= 0) return Error{ErrorKind::kIo, fmt::format("--prometheus {}:0: cannot bind", a.host)};
    } else {
      if (!server_.bind_to_port(a.host, a.port))
        return Error{ErrorKind::kIo, fmt::format("--prometheus {}:{}: cannot bind (in use, or not an address of this host)",
                                                 a.host, a.port)};
      port_ = a.port;
    }
    host_ = a.host;
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    return {};
  }
  void update(std::string text) {
    std::lock_guard lk(mu_);
    text_ = std::move(text);
  }
  std::string url() const {
    const bool v6 = host_.find(':') != std::string::npos;
    return fmt::format("http://{}{}{}:{}/metrics", v6 ? "[" : "", host_, v6 ? "]" : "", port_);
  }
  ~Exporter() {
    server_.stop();
    if (thread_.joinable()) thread_.join();
  }

 private:
  httplib::Server server_;
  std::mutex mu_;
  std::string text_;
  std::string host_;
  int port_ = 0;
  std::thread thread_;
};

Status check_options(const MonitorOptions& o) {
  if (o.command.empty() == (o.pid <= 0))
    return Error{ErrorKind::kUsage, "give either a command (after --) or --pid, not both"};
  if (!(o.interval_s > 0)) return Error{ErrorKind::kUsage, "--interval must be positive"};
  if (o.pid > 0 && ::kill(o.pid, 0) != 0 && errno == ESRCH)
    return Error{ErrorKind::kUsage, fmt::format("--pid {}: no such process", o.pid)};
  return {};
}

// This node (and its GPUs) and a new run in the catalog (or the run given
// by o.run_id); the run's id.
Expected<std::int64_t> begin_run(Catalog& catalog, const Sampler& sampler, const MonitorOptions& o, std::int64_t& node_id) {
  if (o.run_id > 0) {
    if (auto s = check_run(catalog, o.run_id); !s) return s.error();
    if (auto s = catalog.continue_run(o.run_id, o.interval_s); !s) return s.error();
  }
  auto node = catalog.node_id(sampler.node());
  if (!node) return node.error();
  node_id = *node;
  if (auto s = catalog.add_gpus(node_id, sampler.gpus()); !s) return s.error();
  if (o.run_id > 0) return o.run_id;
  RunInfo run;
  if (const char* job = std::getenv("SLURM_JOB_ID")) run.job_id = job;
  run.command = o.pid > 0 ? fmt::format("--pid {}", o.pid) : join_command(o.command);
  run.hostname = sampler.node().hostname;
  run.started = unix_now();
  run.interval_s = o.interval_s;
  return catalog.begin_run(run);
}

// The monitor's signal set-up for as long as it watches: SIGCHLD blocked (it
// is taken with sigtimedwait), and kForwarded passed on to the command.
// Constructed before any thread (the HTTP server's) exists, so that every
// thread inherits the mask; restore() (or the destructor) puts the caller's
// handlers and mask back.
class SignalForwarding {
 public:
  SignalForwarding() {
    sigemptyset(&chld_);
    sigaddset(&chld_, SIGCHLD);
    ::pthread_sigmask(SIG_BLOCK, &chld_, &old_mask_);
    struct sigaction sa {};
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    g_child = 0;
    g_stop = 0;
    for (std::size_t i = 0; i < std::size(kForwarded); ++i) ::sigaction(kForwarded[i], &sa, &old_sa_[i]);
  }
  ~SignalForwarding() { restore(); }
  SignalForwarding(const SignalForwarding&) = delete;
  SignalForwarding& operator=(const SignalForwarding&) = delete;

  void restore() {
    if (restored_) return;
    restored_ = true;
    g_child = 0;
    for (std::size_t i = 0; i < std::size(kForwarded); ++i) ::sigaction(kForwarded[i], &old_sa_[i], nullptr);
    ::pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
  }
  // Sleeps for `left`, or less when a SIGCHLD arrives.
  void wait_for_child(std::chrono::steady_clock::duration left) const {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    ::sigtimedwait(&chld_, nullptr, &ts);
  }

 private:
  sigset_t chld_;
  sigset_t old_mask_;
  struct sigaction old_sa_[std::size(kForwarded)];
  bool restored_ = false;
};

// One sampling pass and what it writes: the sample to the catalog and the
// exporter, and the step lines that arrived since the last pass. Only the
// first failed write is warned about: a full disk would otherwise warn once
// per interval.
class Recording {
 public:
  Recording(const MonitorOptions& o, Catalog& catalog, Sampler& sampler, Exporter* exporter, std::int64_t node_id,
            MonitorResult& res)
      : o_(o), catalog_(catalog), sampler_(sampler), exporter_(exporter), node_id_(node_id), res_(res) {
    if (!o.steps_file.empty()) steps_ = std::make_unique<StepFileReader>(o.steps_file);
  }

  void pass(bool final) {
    Sample smp = sampler_.sample(unix_now(), hw::process_cpu_seconds());
    ++res_.samples;
    const std::uint64_t dropped_before = catalog_.dropped_records();
    const std::uint64_t nonfinite_before = catalog_.nonfinite_values();
    check(catalog_.write_sample(res_.run_id, node_id_, smp));
    // Values written: none of a dropped batch, and not the non-finite ones.
    if (catalog_.dropped_records() == dropped_before)
      res_.readings += smp.readings.size() - std::min<std::uint64_t>(catalog_.nonfinite_values() - nonfinite_before,
                                                                     smp.readings.size());
    if (steps_) {
      auto recs = steps_->poll(final);
      // A line without "t" ended when it was read (at worst one interval late);
      // one without "rank" comes from a single process.
      for (auto& r : recs) {
        if (r.t <= 0) r.t = smp.t;
        if (r.rank < 0) r.rank = 0;
      }
      if (!recs.empty()) {
        res_.steps += recs.size();
        check(catalog_.write_steps(res_.run_id, recs));
      }
    }
    if (exporter_) {
      // After this pass's step lines, so that a scrape sees them at once.
      check(step_gauges_.update(catalog_, res_.run_id));
      exporter_->update(render_prometheus(smp, sampler_.node().hostname) + step_gauges_.render(sampler_.node().hostname));
    }
  }

  // The steps file's malformed lines, counted in the result and recorded as
  // one event (not one per line: a wrong file would flood the catalog).
  void note_malformed_steps() {
    if (!steps_) return;
    res_.malformed_lines = steps_->malformed();
    res_.malformed_examples = steps_->errors();
    if (steps_->malformed() == 0) return;
    EventRecord e{unix_now(), "steps.malformed",
                  fmt::format("{} malformed line(s) of {} in {}; first: {}", steps_->malformed(), steps_->lines(),
                              steps_->path(), steps_->errors().empty() ? "" : steps_->errors().front()),
                  -1, -1};
    check(catalog_.write_event(res_.run_id, node_id_, e));
  }

  void check(const Status& s) {
    if (!s && !warned_write_) {
      if (o_.warn) o_.warn(s.error().message);
      warned_write_ = true;
    }
  }

 private:
  const MonitorOptions& o_;
  Catalog& catalog_;
  Sampler& sampler_;
  Exporter* exporter_;
  std::int64_t node_id_;
  MonitorResult& res_;
  std::unique_ptr<StepFileReader> steps_;
  StepGauges step_gauges_;
  bool warned_write_ = false;
};

// Samples every interval until the command (or --pid) ends, or the monitor
// is told to stop; the command's wait status in `status`.
void sample_until_exit(const MonitorOptions& o, pid_t child, Sampler& sampler, Recording& rec,
                       const SignalForwarding& signals, int& status) {
  const auto period = std::chrono::duration<double>(o.interval_s);
  auto next = std::chrono::steady_clock::now();
  for (;;) {
    rec.pass(false);
    next += std::chrono::duration_cast<std::chrono::steady_clock::duration>(period);
    const auto now = std::chrono::steady_clock::now();
    if (next < now) next = now;  // a slow pass skips ticks rather than bursting
    // Sleep until the next tick, waking early when the command exits.
    for (;;) {
      if (child > 0) {
        if (::waitpid(child, &status, WNOHANG) == child) return;
      } else if (g_stop || !sampler.process_alive() || (::kill(o.pid, 0) != 0 && errno == ESRCH)) {
        return;
      }
      const auto left = next - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) break;
      signals.wait_for_child(left);
    }
  }
}

}  // namespace

Expected<MonitorResult> run_monitor(const MonitorOptions& o) {
  if (Status s = check_options(o); !s) return s.error();
  const auto warn = [&](const std::string& w) {
    if (o.warn) o.warn(w);
  };
  MonitorResult res;
  res.db = std::filesystem::absolute(o.db.empty() ? default_catalog_name() : o.db).string();
  CatalogOptions copt;
  copt.max_pages = o.db_max_pages;
  auto cat = Catalog::open(res.db, copt);
  if (!cat) return cat.error();
  Catalog& catalog = **cat;

  std::unique_ptr<Exporter> exporter;
  if (!o.prometheus.empty()) {
    auto addr = parse_listen_address(o.prometheus);
    if (!addr) return Error{ErrorKind::kUsage, "--prometheus " + addr.error().message};
    exporter = std::make_unique<Exporter>();
  }

  SamplerOptions sopt;
  sopt.root = o.root;
  sopt.pid = o.pid;
  sopt.gpus = o.gpus;
  sopt.per_core = o.per_core;
  sopt.threads = o.threads;
  Sampler sampler(sopt);
  std::int64_t node_id = 0;
  auto run_id = begin_run(catalog, sampler, o, node_id);
  if (!run_id) return run_id.error();
  res.run_id = *run_id;

  SignalForwarding signals;
  if (exporter) {
    if (auto s = exporter->start(*parse_listen_address(o.prometheus)); !s) return s.error();
    res.prometheus_url = exporter->url();
    warn("prometheus metrics at " + res.prometheus_url);
  }

  pid_t child = 0;
  if (!o.command.empty()) {
    SpawnOptions so;
    so.env = {{"PACER_TELEMETRY_DB", res.db}, {"PACER_RUN_ID", std::to_string(res.run_id)}};
    auto pid = spawn_process(o.command, so);
    if (!pid) {
      signals.restore();
      // A command that never started (not found, not executable) leaves no
      // new run behind: there is nothing to score or report, and the run list
      // would fill with typos. A joined run (o.run_id) belongs to its supervisor.
      if (o.run_id > 0) (void)catalog.end_run(res.run_id, unix_now(), std::nullopt, hw::process_cpu_seconds());
      else if (auto s = catalog.discard_run(res.run_id); !s) warn(s.error().message);
      return pid.error();
    }
    child = *pid;
    g_child = child;
    sampler.follow(child);
  }

  const double cpu_at_start = hw::process_cpu_seconds();
  const auto wall_start = std::chrono::steady_clock::now();
  Recording rec(o, catalog, sampler, exporter.get(), node_id, res);
  int status = 0;
  sample_until_exit(o, child, sampler, rec, signals, status);
  signals.restore();
  rec.pass(true);  // the last interval, and step lines written just before the exit

  if (child > 0) {
    if (WIFEXITED(status)) res.exit_code = WEXITSTATUS(status);
    else if (WIFSIGNALED(status)) res.exit_code = 128 + WTERMSIG(status);
  } else {
    res.exit_code = g_stop ? static_cast<int>(ExitCode::kInterrupted) : 0;
  }
  res.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  res.sampler_cpu_s = hw::process_cpu_seconds() - cpu_at_start;
  rec.note_malformed_steps();
  rec.check(catalog.end_run(res.run_id, unix_now(), o.pid > 0 ? std::optional<int>{} : std::optional<int>{res.exit_code},
                            res.sampler_cpu_s));
  // Steps from every source (the file above and pacer.telemetry in the command).
  if (auto n = catalog.query(fmt::format("SELECT count(*) FROM steps WHERE run_id={}", res.run_id));
      n && !n->rows.empty() && std::holds_alternative<std::int64_t>(n->rows[0][0]))
    res.steps = static_cast<std::uint64_t>(std::get<std::int64_t>(n->rows[0][0]));
  res.dropped = catalog.dropped_records();
  res.nonfinite = catalog.nonfinite_values();
  res.catalog_status = catalog.writes_stopped() ? catalog.stop_reason() : "ok";
  res.notes = sampler.notes();
  return res;
}

}  // namespace pacer::telemetry
