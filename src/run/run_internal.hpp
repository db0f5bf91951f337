// Internal to src/run: running a helper program (scontrol) and reading its output.
#pragma once

#include <signal.h>

#include <string>
#include <vector>

#include "pacer/core/error.hpp"

namespace pacer::run {

struct Captured {
  int status = 0;      // exit status, or 128 + signal
  std::string output;  // stdout and stderr together
};

// Runs argv (path search, no shell) and collects its output. Errors: it could
// not start (the message says "not found" for a missing program) or gave no
// answer within timeout_s (it is killed). `child_mask`: the signal mask the
// child starts with (the supervisor blocks signals it waits for).
Expected<Captured> capture(const std::vector<std::string>& argv, double timeout_s, const sigset_t* child_mask);

}  // namespace pacer::run
