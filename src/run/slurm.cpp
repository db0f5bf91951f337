// What the supervisor learns from Slurm: the job's end time, signal names, and running scontrol.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "pacer/run.hpp"
#include "run_internal.hpp"

namespace pacer::run {
namespace {

struct SignalName {
  const char* name;
  int sig;
};
constexpr SignalName kSignals[] = {{"USR1", SIGUSR1}, {"USR2", SIGUSR2}, {"TERM", SIGTERM},
                                   {"INT", SIGINT},   {"HUP", SIGHUP},   {"QUIT", SIGQUIT}};

}  // namespace

Expected<int> parse_signal(const std::string& text) {
  std::string t = text;
  for (auto& c : t) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (t.rfind("SIG", 0) == 0) t = t.substr(3);
  for (const auto& s : kSignals) {
    if (t == s.name || t == std::to_string(s.sig)) return s.sig;
  }
  return Error{ErrorKind::kUsage, fmt::format("signal '{}': expected one of USR1, USR2, TERM, INT, HUP, QUIT", text)};
}

std::string signal_name(int sig) {
  for (const auto& s : kSignals)
    if (s.sig == sig) return std::string("SIG") + s.name;
  const char* d = strsignal(sig);
  return d ? fmt::format("signal {} ({})", sig, d) : fmt::format("signal {}", sig);
}

std::optional<double> parse_scontrol_end_time(const std::string& text) {
  const auto at = text.find("EndTime=");
  if (at == std::string::npos) return std::nullopt;
  std::tm tm{};
  const char* p = text.c_str() + at + 8;
  const char* end = strptime(p, "%Y-%m-%dT%H:%M:%S", &tm);
  if (!end) return std::nullopt;  // "Unknown" or "None" for jobs without a limit
  tm.tm_isdst = -1;               // scontrol prints local time
  const std::time_t t = std::mktime(&tm);
  if (t == static_cast<std::time_t>(-1)) return std::nullopt;
  return static_cast<double>(t);
}

Expected<Captured> capture(const std::vector<std::string>& argv, double timeout_s, const sigset_t* child_mask) {
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return Error{ErrorKind::kIo, fmt::format("pipe: {}", std::strerror(errno))};
  int err_pipe[2];
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    close(out[0]);
    close(out[1]);
    return Error{ErrorKind::kIo, fmt::format("pipe: {}", std::strerror(errno))};
  }
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return Error{ErrorKind::kIo, fmt::format("fork: {}", std::strerror(errno))};
  if (pid == 0) {
    if (child_mask) sigprocmask(SIG_SETMASK, child_mask, nullptr);
    dup2(out[1], 1);
    dup2(out[1], 2);
    execvp(args[0], args.data());
    const int e = errno;
    (void)!write(err_pipe[1], &e, sizeof e);
    _exit(127);
  }
  close(out[1]);
  close(err_pipe[1]);
  int exec_errno = 0;
  const bool exec_failed = read(err_pipe[0], &exec_errno, sizeof exec_errno) == sizeof exec_errno;
  close(err_pipe[0]);
  Captured c;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  bool timed_out = false;
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    pollfd pfd{out[0], POLLIN, 0};
    const int r = poll(&pfd, 1, static_cast<int>(left * 1000) + 1);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    const ssize_t n = read(out[0], buf, sizeof buf);
    if (n <= 0) break;
    c.output.append(buf, static_cast<std::size_t>(n));
  }
  close(out[0]);
  if (timed_out) kill(pid, SIGKILL);
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  if (exec_failed)
    return Error{ErrorKind::kIo, fmt::format("{}: {}", argv[0], exec_errno == ENOENT ? "not found" : std::strerror(exec_errno))};
  if (timed_out) return Error{ErrorKind::kIo, fmt::format("{}: no answer within {:.0f} s", argv[0], timeout_s)};
  c.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return c;
}

Walltime learn_walltime(const std::string& scontrol) {
  Walltime w;
  if (const char* e = std::getenv("SLURM_JOB_END_TIME"); e && *e) {
    char* end = nullptr;
    const double t = std::strtod(e, &end);
    if (end && *end == '\0' && t > 0) {
      w.end_time = t;
      w.source = WalltimeSource::kEnv;
      w.note = "SLURM_JOB_END_TIME";
      return w;
    }
    w.note = fmt::format("SLURM_JOB_END_TIME='{}' is not Unix seconds; ", e);
  }
  const char* job = std::getenv("SLURM_JOB_ID");
  if (!job || !*job) {
    w.note += "no Slurm job (SLURM_JOB_ID unset)";
    return w;
  }
  auto c = capture({scontrol, "show", "job", job}, 10, nullptr);
  if (!c) {
    w.note += fmt::format("{}; relying on the signal", c.error().message);
    return w;
  }
  if (c->status != 0) {
    std::string first = c->output.substr(0, c->output.find('\n'));
    w.note += fmt::format("'{} show job {}' failed (exit {}): {}; relying on the signal", scontrol, job, c->status, first);
    return w;
  }
  if (auto t = parse_scontrol_end_time(c->output)) {
    w.end_time = *t;
    w.source = WalltimeSource::kScontrol;
    w.note = fmt::format("'{} show job {}' EndTime", scontrol, job);
    return w;
  }
  w.note += fmt::format("'{} show job {}' gave no EndTime (no time limit?); relying on the signal", scontrol, job);
  return w;
}

}  // namespace pacer::run
