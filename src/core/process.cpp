#include "pacer/core/process.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string_view>

#include "pacer/core/posix_io.hpp"

extern char** environ;

namespace pacer {

Expected<pid_t> spawn_process(const std::vector<std::string>& argv, const SpawnOptions& o, int* exec_errno) {
  if (exec_errno) *exec_errno = 0;
  if (argv.empty() || argv[0].empty()) return Error{ErrorKind::kUsage, "no command to run"};
  // The environment and argument vectors are built here: between fork and
  // exec only async-signal-safe calls are allowed (another thread may hold
  // the allocator's lock at the fork).
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    const std::string_view kv(*e);
    const std::string_view name = kv.substr(0, kv.find('='));
    bool replaced = false;
    for (const auto& [k, v] : o.env)
      if (name == k) replaced = true;
    if (!replaced) env_strings.emplace_back(kv);
  }
  for (const auto& [k, v] : o.env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp, args;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& s : argv_copy) args.push_back(s.data());
  args.push_back(nullptr);
  sigset_t none;
  sigemptyset(&none);
  const sigset_t* mask = o.signal_mask ? o.signal_mask : &none;

  int err_pipe[2];
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) return io_error("cannot create a pipe", argv[0], errno);
  Fd err_read(err_pipe[0]), err_write(err_pipe[1]);
  const pid_t pid = ::fork();
  if (pid < 0) return io_error("cannot fork", argv[0], errno);
  if (pid == 0) {
    if (o.new_process_group) ::setpgid(0, 0);
    if (o.stdout_fd >= 0) ::dup2(o.stdout_fd, 1);
    if (o.stderr_fd >= 0) ::dup2(o.stderr_fd, 2);
    ::sigprocmask(SIG_SETMASK, mask, nullptr);
    ::execvpe(args[0], args.data(), envp.data());
    const int e = errno;
    (void)!::write(err_pipe[1], &e, sizeof e);
    ::_exit(127);
  }
  // Also here: no signal may be sent to a group that does not exist yet.
  if (o.new_process_group) ::setpgid(pid, pid);
  err_write.reset();
  int e = 0;
  const ssize_t n = retry_eintr([&] { return ::read(err_read.get(), &e, sizeof e); });
  if (n == static_cast<ssize_t>(sizeof e)) {
    (void)wait_process(pid);
    if (exec_errno) *exec_errno = e;
    return Error{ErrorKind::kUsage, fmt::format("{}: cannot run: {}", argv[0], e == ENOENT ? "not found" : std::strerror(e))};
  }
  return pid;
}

pid_t wait_process(pid_t pid, int* status, int flags) {
  int st = 0;
  const pid_t r = retry_eintr([&] { return ::waitpid(pid, &st, flags); });
  if (status && r > 0) *status = st;
  return r;
}

int exit_code_of(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

Expected<CapturedOutput> capture_output(const std::vector<std::string>& argv, double timeout_s, const sigset_t* child_mask) {
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return io_error("cannot create a pipe", argv.empty() ? "" : argv[0], errno);
  Fd out_read(out[0]), out_write(out[1]);
  SpawnOptions so;
  so.signal_mask = child_mask;
  so.stdout_fd = so.stderr_fd = out[1];
  // spawn_process's wording ("X: cannot run: not found"), so a missing
  // program reads the same wherever pacer runs one.
  auto pid = spawn_process(argv, so);
  if (!pid) return Error{ErrorKind::kIo, pid.error().message};
  out_write.reset();
  CapturedOutput c;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  bool timed_out = false;
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    pollfd pfd{out_read.get(), POLLIN, 0};
    const int r = poll(&pfd, 1, static_cast<int>(left * 1000) + 1);
    if (r <= 0) continue;  // EINTR or the deadline: the loop head decides
    const ssize_t n = retry_eintr([&] { return read(out_read.get(), buf, sizeof buf); });
    if (n <= 0) break;
    c.output.append(buf, static_cast<std::size_t>(n));
  }
  out_read.reset();
  if (timed_out) kill(*pid, SIGKILL);
  int st = 0;
  (void)wait_process(*pid, &st);
  if (timed_out) return Error{ErrorKind::kIo, fmt::format("{}: no answer within {:.0f} s", argv[0], timeout_s)};
  c.status = exit_code_of(st);
  return c;
}

}  // namespace pacer
