// The per-thread CPU sampler: the busiest thread of a process tree per interval, from /proc/PID/task/TID/stat.
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <string_view>

#include "pacer/core/posix_io.hpp"
#include "pacer/hw/system.hpp"
#include "pacer/telemetry/sampler.hpp"

namespace pacer::telemetry {

namespace {

// A task's stat line, read through the open task directory (openat, no path
// built per thread); empty when the thread has ended. A stat line is a few
// hundred bytes; more than the buffer holds is not a stat line.
std::string_view read_task_stat(int task_dir_fd, const char* tid, char (&buf)[1024]) {
  char rel[32];
  std::snprintf(rel, sizeof rel, "%s/stat", tid);
  Fd fd(retry_eintr([&] { return ::openat(task_dir_fd, rel, O_RDONLY | O_CLOEXEC); }));
  if (!fd) return {};
  const ssize_t n = retry_eintr([&] { return ::read(fd.get(), buf, sizeof buf); });
  if (n <= 0 || static_cast<std::size_t>(n) == sizeof buf) return {};
  return {buf, static_cast<std::size_t>(n)};
}

// A directory entry's name as a pid or tid; 0 when it is not one.
int as_id(const char* name) {
  int v = 0;
  const char* p = name;
  if (*p < '0' || *p > '9') return 0;
  for (; *p >= '0' && *p <= '9'; ++p) {
    if (v > (INT_MAX - (*p - '0')) / 10) return 0;  // too long for a pid
    v = v * 10 + (*p - '0');
  }
  return *p == '\0' ? v : 0;
}

// The last path component, as argv[0] or a link target gives it.
std::string_view basename_of(std::string_view path) {
  const std::size_t slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

bool python_name(std::string_view name) { return name.starts_with("python"); }

}  // namespace

bool ThreadSampler::is_python(int pid, std::uint64_t starttime, const std::string& main_comm) {
  auto it = interpreters_.find(pid);
  if (it != interpreters_.end() && it->second.starttime == starttime && it->second.comm == main_comm) return it->second.python;
  // The executable says it best; it is unreadable for another user's
  // process, and then argv[0] (a "python3" found on PATH) is asked.
  bool python = false;
  char target[PATH_MAX];
  const std::string exe = fmt::format("{}/proc/{}/exe", root_, pid);
  const ssize_t n = ::readlink(exe.c_str(), target, sizeof target - 1);
  if (n > 0) {
    python = python_name(basename_of(std::string_view(target, static_cast<std::size_t>(n))));
  } else if (auto cmdline = hw::read_text(fmt::format("{}/proc/{}/cmdline", root_, pid))) {
    const std::string_view argv0(cmdline->c_str());  // up to the first NUL
    python = python_name(basename_of(argv0));
  }
  interpreters_[pid] = {starttime, main_comm, python};
  return python;
}

std::optional<ThreadRecord> ThreadSampler::sample(const std::vector<int>& pids, double now) {
  ++pass_;
  const double dt = now - prev_t_;
  const bool have_interval = prev_t_ > 0 && dt > 0;
  prev_t_ = now;
  const double tick = static_cast<double>(hw::clock_ticks_per_second());
  std::optional<ThreadRecord> best;
  std::uint64_t best_ticks = 0;
  std::string best_main_comm;
  std::uint64_t best_process_start = 0;
  unsigned threads = 0, busy_threads = 0;  // busy_threads: in the busiest thread's process
  char buf[1024];
  for (const int pid : pids) {
    const std::string task_dir = fmt::format("{}/proc/{}/task", root_, pid);
    std::string main_comm;
    std::uint64_t process_start = 0;
    unsigned process_busy = 0;
    DIR* dir = ::opendir(task_dir.c_str());
    if (!dir) continue;  // the process ended
    while (const dirent* e = ::readdir(dir)) {
      const int tid = as_id(e->d_name);
      if (tid == 0) continue;
      const std::string_view text = read_task_stat(::dirfd(dir), e->d_name, buf);
      if (text.empty()) continue;  // ended since the listing
      auto st = hw::parse_pid_stat(text);
      if (!st || st->state == 'Z') continue;
      if (tid == pid) main_comm = st->comm, process_start = st->starttime;
      const std::uint64_t ticks = st->utime + st->stime;
      auto [it, fresh] = seen_.try_emplace(tid);
      Seen& s = it->second;
      // A tid that now names another thread (other start time), or whose
      // time went backwards, starts over.
      const bool same = !fresh && s.starttime == st->starttime && ticks >= s.ticks;
      const std::uint64_t used = same ? ticks - s.ticks : 0;
      const bool counted = same && s.pass + 1 == pass_ && have_interval;
      s = {st->starttime, ticks, pass_};
      if (!counted) continue;
      ++threads;
      const double share = std::min(1.0, static_cast<double>(used) / tick / dt);
      if (share >= 0.5) ++process_busy;
      if (!best || used > best_ticks) {
        best_ticks = used;
        best = ThreadRecord{pid, tid, st->comm, tid == pid, false, share, 0, 0};
      }
    }
    ::closedir(dir);
    // Ranks of one node are processes of one thread each: the busy threads
    // that tell one thread's work from a pool's are those of its process.
    if (best && best->pid == pid) best_main_comm = main_comm, best_process_start = process_start, busy_threads = process_busy;
  }
  // Threads not seen in this pass are gone: forget them, so that the map
  // holds the live threads only.
  for (auto it = seen_.begin(); it != seen_.end();) it = it->second.pass == pass_ ? std::next(it) : seen_.erase(it);
  for (auto it = interpreters_.begin(); it != interpreters_.end();)
    it = std::find(pids.begin(), pids.end(), it->first) != pids.end() ? std::next(it) : interpreters_.erase(it);
  if (!best) return std::nullopt;
  best->python = is_python(best->pid, best_process_start, best_main_comm);
  best->threads = threads;
  best->busy_threads = busy_threads;
  return best;
}

}  // namespace pacer::telemetry
