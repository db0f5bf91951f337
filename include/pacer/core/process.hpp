// Child processes for the whole library: start one with an exec-error pipe, wait for it.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

#include "pacer/core/error.hpp"

namespace pacer {

struct SpawnOptions {
  // Set in the child's environment (replacing a variable of the same name).
  std::vector<std::pair<std::string, std::string>> env;
  // The child's signal mask; nullptr: nothing blocked (a parent that blocks
  // signals to wait for them must not pass that on).
  const sigset_t* signal_mask = nullptr;
  // Its own process group (pgid = pid), set in the child and the parent, so
  // that a signal to the group can be sent as soon as spawn_process returns.
  bool new_process_group = false;
  // Descriptors made the child's stdout and stderr when >= 0.
  int stdout_fd = -1;
  int stderr_fd = -1;
};

// Starts argv[0] (searched in PATH) with argv. An exec that fails in the
// child comes back here as an error naming argv[0] ("not found" for ENOENT),
// with the child reaped. Everything the child needs is built before fork, so
// this is safe in a multi-threaded process. `exec_errno` (may be null) gets
// the exec's errno, 0 when it started or failed before the exec.
Expected<pid_t> spawn_process(const std::vector<std::string>& argv, const SpawnOptions& options = {},
                              int* exec_errno = nullptr);

// waitpid(2) retrying EINTR: the pid, 0 (WNOHANG and still running) or -1
// with errno set. `status` (may be null) gets the wait status.
pid_t wait_process(pid_t pid, int* status = nullptr, int flags = 0);

// A wait status as a shell reports it: the exit code, or 128 + the signal.
int exit_code_of(int wait_status);

struct CapturedOutput {
  int status = 0;      // exit status, or 128 + signal
  std::string output;  // stdout and stderr together
};
// Runs argv (path search, no shell) and collects its output. Errors: it could
// not start (the message says "not found" for a missing program) or gave no
// answer within timeout_s (it is killed). `child_mask`: the signal mask the
// child starts with (nullptr: nothing blocked).
Expected<CapturedOutput> capture_output(const std::vector<std::string>& argv, double timeout_s,
                                        const sigset_t* child_mask = nullptr);

}  // namespace pacer
