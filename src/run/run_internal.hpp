// Internal to src/run: running a helper program (scontrol) and reading its output.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <functional>
#include <vector>

#include "pacer/core/error.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/core/process.hpp"
#include "pacer/core/time.hpp"
#include "pacer/run.hpp"

namespace pacer::run {

// core's capture_output; `child_mask`: the supervisor blocks signals it waits for.
using Captured = CapturedOutput;
inline Expected<Captured> capture(const std::vector<std::string>& argv, double timeout_s, const sigset_t* child_mask) {
  return capture_output(argv, timeout_s, child_mask);
}

// The heartbeat file as the supervisor sees it (layout in heartbeat.cpp).
struct SlotReading {
  int local_rank = 0;  // the slot's index
  int rank = 0;        // the global rank the process gave (RANK, SLURM_PROCID, ...)
  int pid = 0;
  std::uint64_t count = 0;  // heartbeats so far; 0: none yet
  std::optional<std::uint64_t> step;
  bool alive = true;    // the process still exists (filled by the caller)
  std::string problem;  // non-empty: the slot is corrupt, and ignored
};

class HeartbeatBoard {
 public:
  // Creates `path` (O_EXCL, mode 0600, a fresh zeroed file) and maps it.
  static Expected<HeartbeatBoard> create(const std::string& path);
  HeartbeatBoard(HeartbeatBoard&& other) noexcept;
  HeartbeatBoard& operator=(HeartbeatBoard&& other) noexcept;
  HeartbeatBoard(const HeartbeatBoard&) = delete;
  ~HeartbeatBoard();
  // The slots that heartbeated at least once, or whose contents are corrupt.
  std::vector<SlotReading> read() const;
  const std::string& path() const { return path_; }
  // The mapped bytes (tests corrupt them).
  unsigned char* data() { return static_cast<unsigned char*>(map_); }

 private:
  HeartbeatBoard() = default;
  std::string path_;
  void* map_ = nullptr;
};

// A rank as the hang watch follows it.
struct RankProgress {
  int local_rank = 0;
  int rank = 0;
  int pid = 0;
  std::uint64_t count = 0;
  std::optional<std::uint64_t> step;
  double last_change = 0;  // monotonic seconds when its count last changed
};

struct Hang {
  RankProgress first;            // the rank idle longest (the event names one by name_hung_rank)
  double idle_s = 0;             // since its last heartbeat
  double timeout_s = 0;
  bool all_stalled = false;      // no rank progressed for timeout_s (else: the others did)
  std::vector<RankProgress> ranks;
};

// Decides hangs from successive readings, with times from CLOCK_MONOTONIC
// (the caller's; tests pass their own). A rank is watched from its first
// heartbeat until its process ends; a hang is a watched rank whose count did
// not change for the timeout (all ranks, or one lagging the others).
class HangWatch {
 public:
  explicit HangWatch(std::optional<double> fixed_timeout_s) : fixed_(fixed_timeout_s) {}
  // Readings with a problem are skipped (the caller reports them).
  std::optional<Hang> observe(const std::vector<SlotReading>& slots, double now);
  // The timeout in force: the fixed one, or the derived one once known.
  std::optional<double> timeout() const;
  std::size_t intervals_seen() const { return intervals_.size(); }
  // The ranks followed since the last observe().
  const std::vector<RankProgress>& ranks() const { return ranks_; }

 private:
  std::optional<double> fixed_;
  std::vector<RankProgress> ranks_;
  std::vector<double> intervals_;  // seconds per heartbeat, the newest kKeep
};


// CLOCK_MONOTONIC seconds: every duration the supervisor, leader and agent keep.
double mono_now();
// A fresh private directory (mkdtemp, mode 0700) for the request file, the
// heartbeat file and stack files, under $XDG_RUNTIME_DIR, $SLURM_TMPDIR, $TMPDIR or /tmp.
Expected<std::string> make_request_dir();
// Removes the heartbeat file and stack files of one attempt from `dir`.
void clear_progress_files(const std::string& dir);
// Creates the checkpoint request file (O_EXCL|O_NOFOLLOW, mode 0600).
Status create_request(const std::string& path, const std::string& body);
// The head of a rank's stack file, as the hang event records it.
nlohmann::json read_stacks(const std::string& path, int rank, int pid);
// This node's GPUs as NVML sees them (utilization, memory), or a note.
nlohmann::json gpu_state();
// `scontrol requeue` (or not, by RequeueMode), filling `out` for exit kExitRequeued.
void requeue_job(const Options& o, const std::function<void(const std::string&, const std::string&)>& log,
                 const std::string& job, bool in_slurm, const sigset_t* child_mask, Outcome& out, const std::string& why);

// Every decision goes to the JSON lines log (when set) and to on_event.
class Log {
 public:
  explicit Log(const Options& o) : o_(o) {}
  Status open() {
    if (o_.log_path.empty()) return {};
    fd_ = ::open(o_.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd_ < 0) return Error{ErrorKind::kUsage, fmt::format("--log {}: {}", o_.log_path, std::strerror(errno))};
    reserve();
    return {};
  }
  ~Log() {
    if (fd_ >= 0) close(fd_);
  }
  void operator()(const std::string& event, const std::string& message, nlohmann::json extra = nlohmann::json::object()) {
    const double t = wall_now();
    nlohmann::json j = {{"schema", kEventSchema}, {"time", utc_iso(t, true)}, {"unix", t}, {"event", event}, {"message", message}};
    for (auto& [k, v] : extra.items()) j[k] = v;
    if (fd_ >= 0) {
      // One write per line with O_APPEND: lines from several supervisors sharing
      // a log never interleave.
      const std::string line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
      if (write(fd_, line.data(), line.size()) != static_cast<ssize_t>(line.size()) && !write_failed_) {
        write_failed_ = true;
        if (o_.on_event)
          o_.on_event({{"schema", kEventSchema}, {"time", utc_iso(t, true)}, {"unix", t}, {"event", "log-failed"},
                       {"message", fmt::format("--log {}: {}", o_.log_path, std::strerror(errno))}});
      }
      reserve();
    }
    if (o_.on_event) o_.on_event(j);
  }

 private:
  // Keeps blocks allocated past the end of the log (FALLOC_FL_KEEP_SIZE:
  // the file's size does not change), renewed after every line, so the lines
  // that record how the run ended (exited, done, give-up, with exit_code)
  // still land when CMD has filled the disk. Fails quietly where the file
  // system cannot preallocate.
  void reserve() {
    struct stat st {};
    if (fstat(fd_, &st) == 0) (void)reserve_space(fd_, static_cast<std::uint64_t>(st.st_size), kReserveBytes, "");
  }
  static constexpr off_t kReserveBytes = 64 << 10;
  const Options& o_;
  int fd_ = -1;
  bool write_failed_ = false;
};

inline std::string step_text(const std::optional<std::uint64_t>& s) { return s ? fmt::format("step {}", *s) : "none"; }
inline bool newer(const std::optional<std::uint64_t>& now, const std::optional<std::uint64_t>& before) {
  return now && (!before || *now > *before);
}
// An attempt ended with `latest` committed: a step newer than `best` is
// progress and resets `no_progress`, the attempts in a row without any.
inline void count_progress(const std::optional<std::uint64_t>& latest, std::optional<std::uint64_t>& best, int& no_progress) {
  if (newer(latest, best)) {
    no_progress = 0;
    best = latest;
  } else {
    ++no_progress;
  }
}

// The count of attempts without progress across requeued allocations
// (docs/run.md, Decisions 6): kStateName in --ckpt-dir ("" without one).
std::string no_progress_path(const Options& o);
// The count the last allocation left, when the newest committed step is
// still the one it recorded (a "history" event says so); else 0.
int load_no_progress(const std::string& state_path, const std::optional<std::uint64_t>& best, Log& log);
// Before a requeue (atomic; makes --ckpt-dir when CMD has not yet).
void save_no_progress(const std::string& state_path, int no_progress, const std::optional<std::uint64_t>& latest,
                      Log& log);
// Finishing or giving up: a resubmission starts afresh.
void forget_no_progress(const std::string& state_path);

// The pause before a restart (--restart-delay) still answers signals:
// Slurm's warning requeues at once (the newest commit is all there is to
// save; `no_progress` is saved for the next allocation), a stop signal ends
// the run; an Outcome then ends it (`out` filled).
std::optional<Outcome> wait_to_restart(const Options& o, const sigset_t& set, Log& log, const std::string& job,
                                       bool in_slurm, const sigset_t* child_mask, int no_progress, Outcome& out);

// The signals the supervisor waits for, blocked while it runs.
inline sigset_t watched_signals() {
  sigset_t s;
  sigemptyset(&s);
  for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2}) sigaddset(&s, sig);
  return s;
}

class MaskGuard {
 public:
  explicit MaskGuard(const sigset_t& set) : set_(set) {
    pthread_sigmask(SIG_BLOCK, &set_, &old_);
    // Children must be reapable: an inherited SIG_IGN would reap them for us.
    struct sigaction sa {};
    sa.sa_handler = SIG_DFL;
    sigaction(SIGCHLD, &sa, &old_chld_);
  }
  // Blocks more signals; old() stays the caller's mask (children start with it).
  void extend(const sigset_t& more) {
    for (int sig = 1; sig < NSIG; ++sig)
      if (sigismember(&more, sig) == 1) sigaddset(&set_, sig);
    pthread_sigmask(SIG_BLOCK, &more, nullptr);
  }
  ~MaskGuard() {
    // Signals that arrive as we finish (Slurm's SIGTERM after `scontrol
    // requeue`) were answered already; they must not kill the caller now.
    timespec zero{};
    while (sigtimedwait(&set_, nullptr, &zero) > 0) {
    }
    sigaction(SIGCHLD, &old_chld_, nullptr);
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  const sigset_t& old() const { return old_; }

 private:
  sigset_t set_;
  sigset_t old_;
  struct sigaction old_chld_ {};
};

// The job's end time (--end-time or Slurm), logged as the "walltime" event.
Walltime find_walltime(const Options& o, Log& log);
// The "checkpoints" event: where commits are looked for, and the newest.
void log_checkpoints(const Options& o, Log& log, const std::optional<std::uint64_t>& best);

// The multi-node leader (cluster.cpp): runs when Options::cluster is set,
// after supervise() has logged the start and blocked Slurm's signal.
Expected<Outcome> lead_cluster(const Options& o, Log& log, MaskGuard& mask);

// The leader-agent protocol (pacer.run.agent/1, docs/run.md "Several
// nodes"): JSON objects, one per line, over TCP.
inline constexpr const char* kAgentSchema = "pacer.run.agent/1";
inline constexpr std::size_t kMaxLine = 8u << 20;  // a dump of 256 ranks' stacks fits
inline constexpr double kSendTimeoutS = 10;

// One connection, non-blocking; every operation is bounded in time.
class Conn {
 public:
  // Connects to host:port (getaddrinfo) within timeout_s.
  static Expected<Conn> connect(const std::string& host, int port, double timeout_s);
  explicit Conn(int fd, std::string peer);
  Conn(Conn&& o) noexcept;
  Conn& operator=(Conn&& o) noexcept;
  Conn(const Conn&) = delete;
  ~Conn();
  int fd() const { return fd_; }
  const std::string& peer() const { return peer_; }
  // Writes one line; an error when the peer takes nothing for timeout_s.
  Status send(const nlohmann::json& j, double timeout_s = kSendTimeoutS);
  // The complete lines that arrived (no waiting). Errors: a line that is not a
  // JSON object, or longer than kMaxLine. eof() tells that the peer closed.
  Expected<std::vector<nlohmann::json>> receive();
  // Waits up to timeout_s for one line (receive() until one comes).
  Expected<std::optional<nlohmann::json>> receive_one(double timeout_s);
  bool eof() const { return eof_; }
  void close();

 private:
  int fd_ = -1;
  std::string peer_;
  std::string buf_;
  std::vector<nlohmann::json> pending_;
  bool eof_ = false;
};

// A listening TCP socket on every address, on a port the kernel picks.
class Listener {
 public:
  static Expected<Listener> open();
  Listener(Listener&& o) noexcept;
  Listener(const Listener&) = delete;
  ~Listener();
  int fd() const { return fd_; }
  int port() const { return port_; }
  // A connection that is waiting, or nothing.
  std::optional<Conn> accept();

 private:
  Listener() = default;
  int fd_ = -1;
  int port_ = 0;
};

// "HOST:PORT" (an IPv6 host in brackets) -> host, port.
Expected<std::pair<std::string, int>> parse_host_port(const std::string& text);
}  // namespace pacer::run
