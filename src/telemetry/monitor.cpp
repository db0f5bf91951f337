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

}  // namespace

Expected<MonitorResult> run_monitor(const MonitorOptions& o) {
  if (o.command.empty() == (o.pid <= 0))
    return Error{ErrorKind::kUsage, "give either a command (after --) or --pid, not both"};
  if (!(o.interval_s > 0)) return Error{ErrorKind::kUsage, "--interval must be positive"};
  if (o.pid > 0 && ::kill(o.pid, 0) != 0 && errno == ESRCH)
    return Error{ErrorKind::kUsage, fmt::format("--pid {}: no such process", o.pid)};
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
  Sampler sampler(sopt);
  auto node_id = catalog.node_id(sampler.node());
  if (!node_id) return node_id.error();
  if (auto s = catalog.add_gpus(*node_id, sampler.gpus()); !s) return s.error();
  RunInfo run;
  if (const char* job = std::getenv("SLURM_JOB_ID")) run.job_id = job;
  run.command = o.pid > 0 ? fmt::format("--pid {}", o.pid) : join_command(o.command);
  run.hostname = sampler.node().hostname;
  run.started = unix_now();
  run.interval_s = o.interval_s;
  auto run_id = catalog.begin_run(run);
  if (!run_id) return run_id.error();
  res.run_id = *run_id;

  // SIGCHLD is taken with sigtimedwait, so it is blocked before any thread
  // (the HTTP server's) exists and inherits the mask.
  sigset_t chld;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  sigset_t old_mask;
  ::pthread_sigmask(SIG_BLOCK, &chld, &old_mask);
  struct sigaction sa {}, old_sa[std::size(kForwarded)];
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  g_child = 0;
  g_stop = 0;
  for (std::size_t i = 0; i < std::size(kForwarded); ++i) ::sigaction(kForwarded[i], &sa, &old_sa[i]);
  const auto restore = [&] {
    g_child = 0;
    for (std::size_t i = 0; i < std::size(kForwarded); ++i) ::sigaction(kForwarded[i], &old_sa[i], nullptr);
    ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  };

  if (exporter) {
    if (auto s = exporter->start(*parse_listen_address(o.prometheus)); !s) {
      restore();
      return s.error();
    }
    res.prometheus_url = exporter->url();
    warn("prometheus metrics at " + res.prometheus_url);
  }

  pid_t child = 0;
  if (!o.command.empty()) {
    SpawnOptions so;
    so.env = {{"PACER_TELEMETRY_DB", res.db}, {"PACER_RUN_ID", std::to_string(res.run_id)}};
    auto pid = spawn_process(o.command, so);
    if (!pid) {
      restore();
      (void)catalog.end_run(res.run_id, unix_now(), std::nullopt, hw::process_cpu_seconds());
      return pid.error();
    }
    child = *pid;
    g_child = child;
  }
  if (child > 0) sampler.follow(child);

  const double cpu_at_start = hw::process_cpu_seconds();
  const auto wall_start = std::chrono::steady_clock::now();
  std::unique_ptr<StepFileReader> steps;
  if (!o.steps_file.empty()) steps = std::make_unique<StepFileReader>(o.steps_file);
  bool warned_write = false;
  const auto check = [&](const Status& s) {
    if (!s && !warned_write) {
      warn(s.error().message);
      warned_write = true;
    }
  };
  const auto pass = [&](bool final) {
    Sample smp = sampler.sample(unix_now(), hw::process_cpu_seconds());
    ++res.samples;
    const std::uint64_t dropped_before = catalog.dropped_records();
    const std::uint64_t nonfinite_before = catalog.nonfinite_values();
    check(catalog.write_sample(res.run_id, *node_id, smp));
    // Values written: none of a dropped batch, and not the non-finite ones.
    if (catalog.dropped_records() == dropped_before)
      res.readings += smp.readings.size() - std::min<std::uint64_t>(catalog.nonfinite_values() - nonfinite_before,
                                                                    smp.readings.size());
    if (exporter) exporter->update(render_prometheus(smp, sampler.node().hostname));
    if (steps) {
      auto recs = steps->poll(final);
      // A line without "t" ended when it was read (at worst one interval late);
      // one without "rank" comes from a single process.
      for (auto& r : recs) {
        if (r.t <= 0) r.t = smp.t;
        if (r.rank < 0) r.rank = 0;
      }
      if (!recs.empty()) {
        res.steps += recs.size();
        check(catalog.write_steps(res.run_id, recs));
      }
    }
  };

  int status = 0;
  bool exited = false;
  const auto period = std::chrono::duration<double>(o.interval_s);
  auto next = std::chrono::steady_clock::now();
  for (;;) {
    pass(false);
    next += std::chrono::duration_cast<std::chrono::steady_clock::duration>(period);
    const auto now = std::chrono::steady_clock::now();
    if (next < now) next = now;  // a slow pass skips ticks rather than bursting
    // Sleep until the next tick, waking early when the command exits.
    for (;;) {
      if (child > 0) {
        const pid_t w = ::waitpid(child, &status, WNOHANG);
        if (w == child) {
          exited = true;
          break;
        }
      } else if (g_stop || !sampler.process_alive() || (::kill(o.pid, 0) != 0 && errno == ESRCH)) {
        exited = true;
        break;
      }
      const auto left = next - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) break;
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
      timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      ::sigtimedwait(&chld, nullptr, &ts);
    }
    if (exited) break;
  }
  restore();
  pass(true);  // the last interval, and step lines written just before the exit

  if (child > 0) {
    if (WIFEXITED(status)) res.exit_code = WEXITSTATUS(status);
    else if (WIFSIGNALED(status)) res.exit_code = 128 + WTERMSIG(status);
  } else {
    res.exit_code = g_stop ? static_cast<int>(ExitCode::kInterrupted) : 0;
  }
  res.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  res.sampler_cpu_s = hw::process_cpu_seconds() - cpu_at_start;
  if (steps) {
    res.malformed_lines = steps->malformed();
    res.malformed_examples = steps->errors();
    if (steps->malformed() > 0) {
      EventRecord e{unix_now(), "steps.malformed",
                    fmt::format("{} malformed line(s) of {} in {}; first: {}", steps->malformed(), steps->lines(),
                                steps->path(), steps->errors().empty() ? "" : steps->errors().front()),
                    -1, -1};
      check(catalog.write_event(res.run_id, *node_id, e));
    }
  }
  check(catalog.end_run(res.run_id, unix_now(), o.pid > 0 ? std::optional<int>{} : std::optional<int>{res.exit_code},
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
