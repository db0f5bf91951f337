// The supervisor behind `pacer run`: start CMD, watch it, checkpoint before the end, restart or requeue.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "pacer/checkpoint.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/run.hpp"
#include "pacer/core/process.hpp"
#include "pacer/core/time.hpp"
#include "pacer/hw/nvml.hpp"
#include "pacer/hw/system.hpp"
#include "run/hang_naming.hpp"
#include "run_internal.hpp"

namespace pacer::run {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& a : v) s += (s.empty() ? "" : " ") + a;
  return s;
}

int status_code(int st) { return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st); }

std::string describe_status(int st) {
  if (WIFEXITED(st)) return fmt::format("exited with status {}", WEXITSTATUS(st));
  return fmt::format("was killed by {} (status {})", signal_name(WTERMSIG(st)), 128 + WTERMSIG(st));
}

// A directory where files appear only by this user's hand: owned by the user
// (or root), and not writable by others unless sticky (others can then add
// names but not remove or replace this user's).
Status check_base_dir(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return Error{ErrorKind::kIo, fmt::format("{}: {}", dir, std::strerror(errno))};
  if (!S_ISDIR(st.st_mode)) return Error{ErrorKind::kIo, fmt::format("{}: not a directory", dir)};
  if (st.st_uid != geteuid() && st.st_uid != 0)
    return Error{ErrorKind::kIo, fmt::format("{}: owned by uid {}, not by this user", dir, st.st_uid)};
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) && !(st.st_mode & S_ISVTX))
    return Error{ErrorKind::kIo, fmt::format("{}: writable by other users and not sticky", dir)};
  return {};
}

// The checks on Options that need nothing else.
Status check_options(const Options& o) {
  if (o.argv.empty()) return Error{ErrorKind::kUsage, "no command to run (pacer run [options] -- CMD ...)"};
  if (o.grace_s < 0 || o.stop_timeout_s < 0 || o.before_s < 0 || o.restart_delay_s < 0)
    return Error{ErrorKind::kUsage, "durations (--grace, --stop-timeout, --before, --restart-delay) must not be negative"};
  if (o.max_restarts < 0) return Error{ErrorKind::kUsage, "--max-restarts must be 0 or more"};
  if (o.give_up_after < 1) return Error{ErrorKind::kUsage, "--give-up-after must be at least 1"};
  if (o.hang_timeout_s && !(*o.hang_timeout_s >= 0 && std::isfinite(*o.hang_timeout_s)))
    return Error{ErrorKind::kUsage, "--hang-timeout must be 0 (off) or a positive duration"};
  return {};
}

// `--vet quick`: an Outcome when the node fails and CMD must not start.
Expected<std::optional<Outcome>> vet_node(const Options& o, Log& log) {
  if (!o.vet_quick) return std::optional<Outcome>();
  auto v = o.vet_quick();
  if (!v) return v.error();
  if (!v->passed) {
    log("vet", fmt::format("pacer vet --quick {}; CMD not started", v->summary), {{"verdict", "fail"}, {"failed", v->failed}});
    Outcome out;
    out.exit_code = static_cast<int>(ExitCode::kCheckFailed);
    out.reason = fmt::format("vet --quick {} on this node; CMD not started", v->summary);
    return std::optional<Outcome>(out);
  }
  log("vet", fmt::format("pacer vet --quick {}", v->summary), {{"verdict", "pass"}});
  return std::optional<Outcome>();
}

// The private directory made for the request file (removed at the end), or
// "" when --request-file names one, whose directory is checked.
Expected<std::string> prepare_request_dir(const Options& o) {
  if (o.request_file.empty()) return make_request_dir();
  // A directory that does not exist is let through: the request file then
  // cannot be created (logged at the request) and only a signal asks.
  const std::string parent = std::filesystem::path(o.request_file).parent_path().string();
  std::error_code ec;
  if (auto s = check_base_dir(parent.empty() ? "." : parent); !s && std::filesystem::exists(parent.empty() ? "." : parent, ec))
    return Error{ErrorKind::kUsage, fmt::format("--request-file {}: {} (anyone could plant a request there)",
                                                o.request_file, s.error().message)};
  return std::string();
}

// One attempt of CMD, from its start to its exit.
struct Attempt {
  enum class Phase { kRunning, kCheckpointing, kStopping };
  int number = 0;
  pid_t pid = 0;
  Phase phase = Phase::kRunning;
  double grace_deadline = 0;
  double kill_deadline = 0;
  bool killed = false;
  bool asked = false;  // a checkpoint was requested in this attempt
  int forwarded_stop = 0;
  bool hung = false;  // stopped because a rank made no progress
  std::optional<std::uint64_t> baseline;
  std::optional<double> trigger;  // monotonic time of the walltime checkpoint
  bool trigger_at_start = false;  // the job was inside the --before window when this attempt started
  int status = 0;                 // from waitpid
};

// The state of one supervised run, shared by its phases. A phase that
// returns an Outcome ends the run.
struct Supervisor {
  const Options& o;
  Log& log;
  const std::string& job;
  bool in_slurm;
  const Walltime& wt;
  const std::string& request_file;
  const sigset_t& set;
  const MaskGuard& mask;
  const std::string state_path;
  std::optional<std::uint64_t> best;
  int no_progress = 0;
  Outcome out;
  int restarts = 0;
  bool walltime_fired = false;
  // Hang detection (off: hang_timeout_s == 0). One board and watch per attempt.
  std::string progress_dir;
  std::optional<HeartbeatBoard> board;
  std::optional<HangWatch> hangs;
  std::vector<int> reported_slots;

  bool hang_watch_on() const { return !o.hang_timeout_s || *o.hang_timeout_s > 0; }

  // A fresh heartbeat file for the attempt, and CMD's environment for it.
  void prepare_progress(std::vector<std::pair<std::string, std::string>>& env) {
    board.reset();
    hangs.reset();
    reported_slots.clear();
    if (!hang_watch_on() || progress_dir.empty()) return;
    clear_progress_files(progress_dir);
    auto b = HeartbeatBoard::create(progress_dir + "/heartbeat");
    if (!b) {
      log("hang-watch", fmt::format("no hang detection in this attempt: {}", b.error().message));
      return;
    }
    board.emplace(std::move(*b));
    hangs.emplace(o.hang_timeout_s);
    env.emplace_back(kHeartbeatFileEnv, board->path());
    env.emplace_back(kStacksDirEnv, progress_dir);
    env.emplace_back(kStacksSignalEnv, "URG");  // kStacksSignal
  }

  // How often the heartbeat file is read: a twentieth of the timeout, within [50 ms, 1 s].
  double poll_s() const {
    const auto t = hangs ? hangs->timeout() : std::nullopt;
    return t ? std::clamp(*t / 20, 0.05, 1.0) : 1.0;
  }

  void check_progress(Attempt& a) {
    auto readings = board->read();
    for (const auto& r : readings)
      if (!r.problem.empty() && std::find(reported_slots.begin(), reported_slots.end(), r.local_rank) == reported_slots.end()) {
        reported_slots.push_back(r.local_rank);
        log("heartbeat-invalid", r.problem, {{"local_rank", r.local_rank}});
      }
    if (auto h = hangs->observe(readings, mono_now())) on_hang(a, *h);
  }

  // Stacks from every rank (the faulthandler signal to CMD's process group,
  // then a moment for the files), the GPUs, one event, then the stop.
  void on_hang(Attempt& a, const Hang& h) {
    kill(-a.pid, kStacksSignal);
    auto stack_path = [&](int pid) { return fmt::format("{}/stacks-{}.txt", progress_dir, pid); };
    const double until = mono_now() + 2;
    for (;;) {
      bool all = true;
      for (const auto& r : h.ranks) {
        struct stat st {};
        all = all && ::stat(stack_path(r.pid).c_str(), &st) == 0 && st.st_size > 0;
      }
      if (all || mono_now() >= until) break;
      ::usleep(50000);
    }
    // A moment more for the other threads' stacks behind the first.
    ::usleep(100000);
    json ranks = json::array(), stacks = json::array();
    const double now = mono_now();
    for (const auto& r : h.ranks) {
      ranks.push_back({{"rank", r.rank}, {"local_rank", r.local_rank}, {"pid", r.pid}, {"heartbeats", r.count},
                       {"step", r.step ? json(*r.step) : json(nullptr)}, {"idle_s", now - r.last_change}});
      stacks.push_back(read_stacks(stack_path(r.pid), r.rank, r.pid));
    }
    // Which rank to name is decided with the stacks (hang_naming.cpp).
    std::vector<Suspect> suspects;
    for (const auto& r : h.ranks) suspects.push_back({r.rank, "", r.step, now - r.last_change, std::nullopt});
    attach_stacks(suspects, stacks);
    const Naming named = name_hung_rank(suspects, naming_window(h.timeout_s, poll_s()));
    const auto& f = h.ranks.at(named.index);
    const double idle_s = h.first.last_change + h.idle_s - f.last_change;
    const std::string source = o.hang_timeout_s ? "--hang-timeout"
                                                : fmt::format("derived from {} heartbeat intervals", hangs->intervals_seen());
    const std::string msg = fmt::format(
        "rank {} (local rank {}, pid {}) made no progress for {:.1f} s ({} {:.1f} s; {}), last step {}; "
        "{} rank(s) watched, stacks of {} captured; named: {}",
        f.rank, f.local_rank, f.pid, idle_s, source, h.timeout_s,
        h.all_stalled ? "no rank progressed" : "the other ranks did", f.step ? std::to_string(*f.step) : "none",
        h.ranks.size(), std::count_if(stacks.begin(), stacks.end(), [](const json& x) { return x["text"].is_string(); }),
        named.reason);
    log("hang", msg,
        {{"attempt", a.number}, {"rank", f.rank}, {"local_rank", f.local_rank}, {"pid", f.pid},
         {"step", f.step ? json(*f.step) : json(nullptr)}, {"idle_s", idle_s}, {"hang_timeout_s", h.timeout_s},
         {"timeout_source", o.hang_timeout_s ? "option" : "derived"}, {"all_stalled", h.all_stalled},
         {"host", hw::hostname()}, {"named", naming_json(suspects, named)}, {"ranks", ranks}, {"stacks", stacks},
         {"gpu", gpu_state()}});
    a.hung = true;
    stop(a, fmt::format("hang of rank {}", f.rank));
  }

  void save_state(const std::optional<std::uint64_t>& latest) { save_no_progress(state_path, no_progress, latest, log); }
  void forget_state() { forget_no_progress(state_path); }

  void requeue(const std::string& why) {
    requeue_job(o, [this](const std::string& e, const std::string& m) { log(e, m); }, job, in_slurm, &mask.old(), out,
                why);
  }

  Outcome give_up(int exit_code, const std::string& why) {
    forget_state();
    out.exit_code = exit_code;
    out.reason = "giving up: " + why;
    log("give-up", out.reason);
    return out;
  }

  Outcome finish(int exit_code, const std::string& reason, const std::string& event = "done") {
    out.exit_code = exit_code;
    out.reason = reason;
    log(event, out.reason);
    return out;
  }

  // Fills a.pid, or returns the Outcome of a CMD that could not start.
  std::optional<Outcome> start(Attempt& a) {
    unlink(request_file.c_str());  // a request belongs to one attempt (and one allocation)
    if (struct stat st {}; lstat(request_file.c_str(), &st) == 0) {
      out.exit_code = static_cast<int>(ExitCode::kRuntime);
      out.reason = fmt::format("request file {} exists and cannot be removed (owned by uid {}): CMD would see a "
                               "request nobody made; CMD not started", request_file, st.st_uid);
      log("not-started", out.reason, {{"exit_code", out.exit_code}});
      return out;
    }
    std::vector<std::pair<std::string, std::string>> env = {{kRequestFileEnv, request_file},
                                                            {kAttemptEnv, std::to_string(a.number)}};
    if (!o.ckpt_dir.empty()) env.emplace_back(kCkptDirEnv, o.ckpt_dir);
    if (o.request_signal) env.emplace_back(kRequestSignalEnv, signal_name(*o.request_signal).substr(3));
    prepare_progress(env);
    // Its own process group, so that signals reach everything CMD starts
    // and stopping it stops its workers.
    SpawnOptions so;
    so.env = env;
    so.signal_mask = &mask.old();
    so.new_process_group = true;
    int exec_errno = 0;
    const auto spawned = spawn_process(o.argv, so, &exec_errno);
    ++out.attempts;
    if (!spawned) {
      const bool missing = exec_errno == ENOENT || exec_errno == ENOTDIR;
      out.exit_code = missing ? kExitNotFound : kExitNotExecutable;
      out.reason = exec_errno ? fmt::format("{}: {}", o.argv[0], missing ? "command not found" : std::strerror(exec_errno))
                              : spawned.error().message;
      log("not-started", out.reason, {{"exit_code", out.exit_code}});
      return out;
    }
    a.pid = *spawned;
    log("started", fmt::format("attempt {} (pid {}), resuming from {}", a.number, a.pid, step_text(best)),
        {{"attempt", a.number}, {"pid", a.pid}});
    if (wt.end_time && o.before_s > 0 && !walltime_fired) {
      a.trigger = mono_now() + (*wt.end_time - o.before_s - wall_now());
      a.trigger_at_start = *a.trigger <= mono_now();
    }
    return std::nullopt;
  }

  void stop(Attempt& a, const std::string& why) {
    kill(-a.pid, SIGTERM);
    a.phase = Attempt::Phase::kStopping;
    a.kill_deadline = mono_now() + o.stop_timeout_s;
    log("stop", fmt::format("{}; SIGTERM to CMD's process group, SIGKILL after {} s", why, o.stop_timeout_s));
  }

  void request(Attempt& a, const std::string& why) {
    a.asked = true;
    a.baseline = latest_committed_step(o.ckpt_dir);
    const json body = {{"schema", "pacer.run.request/1"}, {"reason", why}, {"time", utc_iso(wall_now(), true)},
                       {"deadline", wall_now() + o.grace_s}, {"committed_step", a.baseline ? json(*a.baseline) : json(nullptr)}};
    const auto s = create_request(request_file, body.dump() + "\n");
    if (o.request_signal) kill(-a.pid, *o.request_signal);
    a.phase = Attempt::Phase::kCheckpointing;
    a.grace_deadline = mono_now() + o.grace_s;
    log("checkpoint-request",
        fmt::format("{}: asking CMD to checkpoint ({}{}); waiting up to {} s for a step newer than {}", why,
                    s ? "request file " + request_file : "request file FAILED: " + s.error().message,
                    o.request_signal ? " and " + signal_name(*o.request_signal) : "", o.grace_s, step_text(a.baseline)),
        {{"request_file", request_file}, {"committed_step", a.baseline ? json(*a.baseline) : json(nullptr)}});
  }

  // Waits for CMD to exit, answering signals, the walltime trigger, commits
  // and deadlines; fills a.status.
  void watch(Attempt& a) {
    using Phase = Attempt::Phase;
    for (;;) {
      double wait_s = 3600;
      const double now = mono_now();
      if (a.phase == Phase::kRunning && a.trigger) wait_s = std::min(wait_s, *a.trigger - now);
      if (a.phase == Phase::kCheckpointing) wait_s = std::min({wait_s, 0.2, a.grace_deadline - now});
      if (a.phase == Phase::kStopping && !a.killed) wait_s = std::min(wait_s, a.kill_deadline - now);
      if (a.phase == Phase::kRunning && hangs) wait_s = std::min(wait_s, poll_s());
      wait_s = std::max(wait_s, 0.0);
      timespec ts{static_cast<time_t>(wait_s), static_cast<long>((wait_s - std::floor(wait_s)) * 1e9)};
      siginfo_t info{};
      const int sig = sigtimedwait(&set, &info, &ts);
      if (waitpid(a.pid, &a.status, WNOHANG) == a.pid) break;
      if (sig > 0 && sig != SIGCHLD) {
        if (sig == o.slurm_signal && !a.asked) {
          request(a, fmt::format("{} received (Slurm's warning before the time limit)", signal_name(sig)));
        } else {
          kill(-a.pid, sig);
          if (sig != SIGUSR1 && sig != SIGUSR2) a.forwarded_stop = sig;
          log("signal", fmt::format("{} forwarded to CMD's process group", signal_name(sig)), {{"signal", sig}});
        }
      }
      const double t = mono_now();
      if (a.phase == Phase::kRunning && a.trigger && t >= *a.trigger) {
        walltime_fired = true;
        request(a, fmt::format("job ends in {} s (--before {} s{})", static_cast<long long>(*wt.end_time - wall_now()),
                               o.before_s, a.trigger_at_start ? "; inside the window when CMD started" : ""));
      }
      if (a.phase == Phase::kRunning && hangs) check_progress(a);
      if (a.phase == Phase::kCheckpointing) {
        const auto cur = latest_committed_step(o.ckpt_dir);
        if (newer(cur, a.baseline)) {
          log("committed", fmt::format("CMD committed step {} in {}", *cur, o.ckpt_dir), {{"committed_step", *cur}});
          stop(a, fmt::format("checkpoint at step {} is committed", *cur));
        } else if (t >= a.grace_deadline) {
          stop(a, fmt::format("no new committed step within the grace period of {} s (latest: {}); stopping anyway",
                              o.grace_s, step_text(cur)));
        }
      }
      if (a.phase == Phase::kStopping && !a.killed && t >= a.kill_deadline) {
        kill(-a.pid, SIGKILL);
        a.killed = true;
        log("kill", fmt::format("CMD still running {} s after SIGTERM: SIGKILL to its process group", o.stop_timeout_s));
      }
    }
    // Workers CMD left behind in its group hold GPUs and ports. The group id
    // cannot be taken by another process while any member is alive.
    kill(-a.pid, SIGKILL);
  }

  // Decides what follows CMD's exit: an Outcome, or nothing for a restart.
  std::optional<Outcome> decide(const Attempt& a) {
    const int st = a.status;
    const int code = status_code(st);
    const auto latest = latest_committed_step(o.ckpt_dir);
    log("exited", fmt::format("CMD {} (attempt {}); latest committed: {}", describe_status(st), a.number, step_text(latest)),
        {{"attempt", a.number}, {"exit_code", code}, {"committed_step", latest ? json(*latest) : json(nullptr)}});

    out.committed_step = latest;
    const std::string no_progress_text = fmt::format(
        "{} consecutive attempt(s) without a new committed step (latest: {})", no_progress + 1, step_text(latest));

    using Phase = Attempt::Phase;
    if (a.hung) return after_crash(a, code ? code : static_cast<int>(ExitCode::kRuntime), "hung");
    if (a.phase == Phase::kStopping || (a.phase == Phase::kCheckpointing && code != 0)) {
      count_progress(latest, best, no_progress);
      if (no_progress >= o.give_up_after)
        return give_up(static_cast<int>(ExitCode::kCheckFailed),
                       no_progress_text + ", counting earlier allocations; not requeued");
      save_state(latest);
      requeue(newer(latest, a.baseline)
                  ? fmt::format("stopped after committing step {}", *latest)
                  : fmt::format("stopped without a new committed step (resume from {})", step_text(latest)));
      return out;
    }
    if (code == 0) {
      forget_state();
      return finish(0, "CMD finished");
    }
    if (a.forwarded_stop)
      return finish(code, fmt::format("CMD {} after {} was forwarded; not restarted", describe_status(st),
                                      signal_name(a.forwarded_stop)));
    return after_crash(a, code, "crashed");
  }

  // The restart rules, for a crash or a hang (`how`).
  std::optional<Outcome> after_crash(const Attempt& a, int code, const std::string& how) {
    const auto latest = out.committed_step;
    const std::string last = how == "hung" ? "hung" : describe_status(a.status);
    count_progress(latest, best, no_progress);
    if (no_progress >= o.give_up_after)
      return give_up(code, fmt::format("{} consecutive attempt(s) without a new committed step (latest: {}); last one {}",
                                       no_progress, step_text(latest), last));
    if (restarts >= o.max_restarts)
      return give_up(code, fmt::format("restart limit of {} reached; last attempt {}", o.max_restarts, last));
    ++restarts;
    log("restart", fmt::format("CMD {}; restart {} of {} in {} s from {} ({} attempt(s) in a row without progress)",
                               how, restarts, o.max_restarts, o.restart_delay_s, step_text(best), no_progress),
        {{"restart", restarts}, {"no_progress", no_progress}});
    return std::nullopt;
  }

  Outcome run() {
    for (int attempt = 0;; ++attempt) {
      Attempt a;
      a.number = attempt;
      if (auto done = start(a)) return *done;
      watch(a);
      if (auto done = decide(a)) return *done;
      if (auto done = wait_to_restart(o, set, log, job, in_slurm, &mask.old(), no_progress, out)) return *done;
    }
  }
};

}  // namespace

double mono_now() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

// The default request file lives in a directory of its own, made with
// mkdtemp (mode 0700, an unpredictable name) under the first usable one of
// $XDG_RUNTIME_DIR, $SLURM_TMPDIR, $TMPDIR and /tmp: nobody else can plant a
// request there, or a symlink where pacer writes it.
Expected<std::string> make_request_dir() {
  std::vector<std::string> bases;
  for (const char* v : {"XDG_RUNTIME_DIR", "SLURM_TMPDIR", "TMPDIR"})
    if (const char* p = std::getenv(v); p && *p) bases.push_back(p);
  bases.push_back("/tmp");
  std::string why;
  for (const auto& base : bases) {
    Status ok = check_base_dir(base);
    std::string dir = base + "/pacer-run-XXXXXX";
    if (ok && !::mkdtemp(dir.data())) ok = Error{ErrorKind::kIo, fmt::format("{}: mkdtemp: {}", base, std::strerror(errno))};
    if (ok) {
      struct stat st {};
      if (::lstat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == geteuid() && (st.st_mode & 077) == 0)
        return dir;
      ::rmdir(dir.c_str());
      ok = Error{ErrorKind::kIo, fmt::format("{}: not a private directory after mkdtemp", dir)};
    }
    why += (why.empty() ? "" : "; ") + ok.error().message;
  }
  return Error{ErrorKind::kIo, "no private directory for the checkpoint request file: " + why};
}

// The heartbeat file and the stack files of one attempt; the directory stays.
void clear_progress_files(const std::string& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name == "heartbeat" || (name.rfind("stacks-", 0) == 0 && e.path().extension() == ".txt"))
      std::filesystem::remove(e.path(), ec);
  }
}

// The start of a stack file: faulthandler writes the current thread first,
// most recent call first, so the head is what matters.
json read_stacks(const std::string& path, int rank, int pid) {
  constexpr std::size_t kMax = 8192;
  json j = {{"rank", rank}, {"pid", pid}, {"file", path}};
  auto fd = open_fd(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (!fd) {
    j["text"] = nullptr;
    j["note"] = "no stack file: the rank is not a Python process that called pacer.run.heartbeat or watch";
    return j;
  }
  std::string buf(kMax + 1, '\0');
  auto n = read_full(fd->get(), buf.data(), buf.size(), path);
  buf.resize(n ? *n : 0);
  j["truncated"] = buf.size() > kMax;
  if (buf.size() > kMax) buf.resize(kMax);
  j["text"] = buf;
  return j;
}

// Utilization and memory per GPU, where NVML answers; a note otherwise.
json gpu_state() {
  auto nvml = hw::Nvml::open();
  if (!nvml) return {{"note", nvml.error().message}};
  auto count = (*nvml)->device_count();
  if (!count) return {{"note", count.error().message}};
  json gpus = json::array();
  for (unsigned i = 0; i < *count; ++i) {
    auto g = (*nvml)->query(i, hw::Nvml::QueryScope::kFast);
    if (!g) {
      gpus.push_back({{"index", i}, {"note", g.error().message}});
      continue;
    }
    auto opt = [](const auto& v) { return v ? json(*v) : json(nullptr); };
    gpus.push_back({{"index", i}, {"utilization_gpu_pct", opt(g->utilization_gpu_pct)},
                    {"utilization_memory_pct", opt(g->utilization_memory_pct)}, {"memory_used", opt(g->memory_used)},
                    {"memory_total", opt(g->memory_total)}});
  }
  return {{"gpus", gpus}};
}

void requeue_job(const Options& o, const std::function<void(const std::string&, const std::string&)>& log,
                 const std::string& job, bool in_slurm, const sigset_t* child_mask, Outcome& out, const std::string& why) {
  out.exit_code = kExitRequeued;
  out.requeued = true;
  out.committed_step = latest_committed_step(o.ckpt_dir);
  out.reason = why;
  if (!in_slurm) {
    log("requeue", fmt::format("{}; not requeued: no Slurm job (bare); exit {}", why, kExitRequeued));
    return;
  }
  if (o.requeue == RequeueMode::kExit) {
    log("requeue", fmt::format("{}; exit {} for the next job of an sbatch --dependency=singleton chain", why,
                               kExitRequeued));
    return;
  }
  log("requeue", fmt::format("{}; requeueing job {} with '{} requeue {}'", why, job, o.scontrol, job));
  auto c = capture({o.scontrol, "requeue", job}, 30, child_mask);
  if (!c || c->status != 0) {
    const std::string err = !c ? c.error().message
                               : fmt::format("exit {}: {}", c->status, c->output.substr(0, c->output.find('\n')));
    log("requeue-failed", fmt::format("'{} requeue {}' failed ({}); exit {} so a singleton chain can continue",
                                      o.scontrol, job, err, kExitRequeued));
    out.reason += fmt::format("; scontrol requeue failed ({})", err);
    return;
  }
  log("requeued", fmt::format("job {} requeued; exit {}", job, kExitRequeued));
}

// Creates the request file; never follows a symlink or takes over a file
// someone else put there (O_EXCL|O_NOFOLLOW: the supervisor removed its own
// before the attempt started).
Status create_request(const std::string& path, const std::string& body) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0)
    return Error{ErrorKind::kIo, fmt::format("{}: {}", path,
                                             errno == EEXIST ? "exists already, not created by this pacer run"
                                                             : std::strerror(errno))};
  // One small write: readers only test that the file exists.
  const ssize_t n = ::write(fd, body.data(), body.size());
  const int e = errno;
  ::close(fd);
  if (n != static_cast<ssize_t>(body.size()))
    return Error{ErrorKind::kIo, fmt::format("{}: write: {}", path, n < 0 ? std::strerror(e) : "short write")};
  return {};
}

Walltime find_walltime(const Options& o, Log& log) {
  Walltime wt;
  if (o.end_time) {
    wt.end_time = o.end_time;
    wt.source = WalltimeSource::kOverride;
    wt.note = "--end-time";
  } else {
    wt = learn_walltime(o.scontrol);
  }
  if (wt.end_time) {
    // Slurm's warning may have come before pacer run blocked it (a batch
    // script's `trap '' USR1` discards it, and nothing can block it in bash).
    // With --before at least the warning's lead, the end time stands in for
    // it: the first attempt is asked to checkpoint as soon as it starts.
    const double left = *wt.end_time - wall_now();
    const bool inside = o.before_s > 0 && left <= o.before_s;
    log("walltime", fmt::format("job ends at {} ({} s from now, from {}){}", utc_iso(*wt.end_time, true),
                                static_cast<long long>(left), wt.note,
                                inside ? fmt::format("; already inside the --before window of {} s: CMD is asked to "
                                                     "checkpoint as soon as it starts, as if {} had come (it may have "
                                                     "come before pacer run could receive it)",
                                                     o.before_s, signal_name(o.slurm_signal))
                                : o.before_s > 0 ? fmt::format("; checkpoint {} s before", o.before_s)
                                               : "; --before 0: checkpoint on the signal only"),
        {{"end_time", *wt.end_time}, {"inside_window", inside}});
  } else {
    log("walltime", fmt::format("end time unknown: {}; checkpoint on {} only", wt.note, signal_name(o.slurm_signal)),
        {{"end_time", nullptr}});
  }
  return wt;
}

void log_checkpoints(const Options& o, Log& log, const std::optional<std::uint64_t>& best) {
  if (o.ckpt_dir.empty())
    log("checkpoints", "no --ckpt-dir: commits cannot be seen, so a checkpoint request waits the whole grace period "
                       "and crashes never count as progress");
  else
    log("checkpoints", best ? fmt::format("latest committed step in {}: {}", o.ckpt_dir, *best)
                            : fmt::format("no committed step in {} yet", o.ckpt_dir),
        {{"committed_step", best ? json(*best) : json(nullptr)}});
}

std::optional<std::uint64_t> latest_committed_step(const std::string& dir) {
  if (dir.empty()) return std::nullopt;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return std::nullopt;
  for (const auto& e : ckpt::list(dir, false))
    if (e.committed) return e.step;  // newest first
  return std::nullopt;
}

std::optional<Outcome> wait_to_restart(const Options& o, const sigset_t& set, Log& log, const std::string& job,
                                       bool in_slurm, const sigset_t* child_mask, int no_progress, Outcome& out) {
  const double until = mono_now() + o.restart_delay_s;
  for (double left; (left = until - mono_now()) > 0;) {
    timespec ts{static_cast<time_t>(left), static_cast<long>((left - std::floor(left)) * 1e9)};
    const int sig = sigtimedwait(&set, nullptr, &ts);
    if (sig <= 0 || sig == SIGCHLD) continue;
    if (sig == o.slurm_signal) {
      // The next allocation goes on counting the attempts without progress.
      save_no_progress(no_progress_path(o), no_progress, latest_committed_step(o.ckpt_dir), log);
      requeue_job(o, [&log](const std::string& e, const std::string& m) { log(e, m); }, job, in_slurm, child_mask, out,
                  fmt::format("{} received between attempts", signal_name(sig)));
      return out;
    }
    if (sig == SIGUSR1 || sig == SIGUSR2) continue;
    out.exit_code = 128 + sig;
    out.reason = fmt::format("{} received while waiting to restart; not restarted", signal_name(sig));
    log("done", out.reason, {{"exit_code", out.exit_code}});
    return out;
  }
  return std::nullopt;
}

std::string no_progress_path(const Options& o) {
  return o.ckpt_dir.empty() ? std::string() : (std::filesystem::path(o.ckpt_dir) / kStateName).string();
}

// Attempts without progress count across requeues: a job whose every
// allocation ends without a new committed step must stop being requeued.
int load_no_progress(const std::string& state_path, const std::optional<std::uint64_t>& best, Log& log) {
  if (state_path.empty() || !std::filesystem::exists(state_path)) return 0;
  auto text = read_file(state_path);
  const json j = text ? json::parse(*text, nullptr, false) : json();
  if (!j.is_object() || !j.contains("no_progress") || !j.at("no_progress").is_number_integer()) {
    log("history", fmt::format("{}: unreadable, ignored", state_path));
    return 0;
  }
  const json s = j.value("committed_step", json());
  const std::optional<std::uint64_t> then =
      s.is_number_unsigned() ? std::optional<std::uint64_t>(s.get<std::uint64_t>()) : std::nullopt;
  if (then != best) return 0;
  const int no_progress = j.at("no_progress").get<int>();
  log("history", fmt::format("{} earlier attempt(s) in a row ended without a new committed step ({})", no_progress,
                             state_path),
      {{"no_progress", no_progress}});
  return no_progress;
}

void save_no_progress(const std::string& state_path, int no_progress, const std::optional<std::uint64_t>& latest,
                      Log& log) {
  if (state_path.empty()) return;
  // CMD makes --ckpt-dir when it first checkpoints; one stopped before that
  // (a slow start under load) must not lose the count of attempts without
  // progress, or the next allocation would requeue forever.
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(state_path).parent_path(), ec);
  const json j = {{"schema", "pacer.run.state/1"}, {"no_progress", no_progress},
                  {"committed_step", latest ? json(*latest) : json(nullptr)}, {"time", utc_iso(wall_now(), true)}};
  if (auto st = write_file_atomic(state_path, j.dump() + "\n"); !st) log("history", st.error().message);
}

void forget_no_progress(const std::string& state_path) {
  if (!state_path.empty()) unlink(state_path.c_str());
}

std::string format_event(const json& e) {
  std::string line = fmt::format("{} pacer run: {}: {}", e.value("time", ""), e.value("event", ""), e.value("message", ""));
  // A hang's stacks follow its line, indented: where each rank was.
  if (auto it = e.find("stacks"); it != e.end() && it->is_array())
    for (const auto& s : *it) {
      const std::string host = s.value("host", std::string());
      line += fmt::format("\n  rank {}{} (pid {}) stacks:", s.value("rank", -1), host.empty() ? "" : " on " + host,
                          s.value("pid", 0));
      const auto text = s.find("text");
      if (text == s.end() || !text->is_string()) {
        line += " " + s.value("note", std::string("none"));
        continue;
      }
      for (std::size_t at = 0, nl; at < text->get_ref<const std::string&>().size(); at = nl + 1) {
        const auto& t = text->get_ref<const std::string&>();
        nl = t.find('\n', at);
        if (nl == std::string::npos) nl = t.size();
        line += "\n    " + t.substr(at, nl - at);
      }
    }
  return line;
}

Expected<Outcome> supervise(const Options& o) {
  if (auto s = check_options(o); !s) return s.error();
  Log log(o);
  if (auto s = log.open(); !s) return s.error();

  const char* job_env = std::getenv("SLURM_JOB_ID");
  const std::string job = job_env ? job_env : "";
  const bool in_slurm = !job.empty();
  log("start", fmt::format("{}; CMD: {}", in_slurm ? fmt::format("Slurm job {}", job)
                                                   : "no Slurm job (SLURM_JOB_ID unset): running bare, no walltime "
                                                     "from Slurm and no requeue",
                           join(o.argv)),
      {{"argv", o.argv}, {"slurm_job", in_slurm ? json(job) : json(nullptr)}, {"host", hw::hostname()}});

  // Slurm's warning is blocked from here on, so that one arriving while
  // `--vet quick` runs stays pending (a blocked signal is queued even where
  // the batch script left it ignored) and the first attempt is asked at once.
  // SIGINT and SIGTERM stay deliverable: they interrupt the vet.
  sigset_t early;
  sigemptyset(&early);
  sigaddset(&early, o.slurm_signal);
  MaskGuard mask(early);
  if (o.cluster) return lead_cluster(o, log, mask);
  auto vetted = vet_node(o, log);
  if (!vetted) return vetted.error();
  if (*vetted) return **vetted;

  const Walltime wt = find_walltime(o, log);
  auto made_dir = prepare_request_dir(o);
  if (!made_dir) return made_dir.error();
  const std::string request_dir = *made_dir;  // made here, removed at the end
  const std::string request_file = request_dir.empty() ? o.request_file : request_dir + "/ckpt-request";
  const std::optional<std::uint64_t> best = latest_committed_step(o.ckpt_dir);
  log_checkpoints(o, log, best);
  const std::string state_path = no_progress_path(o);
  const int no_progress = load_no_progress(state_path, best, log);

  const sigset_t set = watched_signals();
  mask.extend(set);
  // A request belongs to one attempt: none is left behind.
  // Heartbeats and stacks live in the request's private directory; with
  // --request-file, in one of their own.
  std::string own_progress_dir;
  const bool watch_hangs = !o.hang_timeout_s || *o.hang_timeout_s > 0;
  if (watch_hangs && request_dir.empty()) {
    auto d = make_request_dir();
    if (!d) return d.error();
    own_progress_dir = *d;
  }
  const std::string progress_dir = !watch_hangs ? std::string() : request_dir.empty() ? own_progress_dir : request_dir;
  struct RemoveOnExit {
    const std::string& path;
    const std::string& dir;
    const std::string& progress;
    const std::string& own_progress;
    ~RemoveOnExit() {
      unlink(path.c_str());
      clear_progress_files(progress);
      if (!dir.empty()) rmdir(dir.c_str());
      if (!own_progress.empty()) rmdir(own_progress.c_str());
    }
  } remove_request{request_file, request_dir, progress_dir, own_progress_dir};

  Supervisor sup{o,  log,        job,       in_slurm,  wt,        request_file, set, mask, state_path, best, no_progress,
                 {},  0,          false,     progress_dir, {},     {},           {}};
  return sup.run();
}

}  // namespace pacer::run
