// Internal to src/run: running a helper program (scontrol) and reading its output.
#pragma once

#include <signal.h>

#include <cstdint>
#include <optional>
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
  RankProgress first;            // the rank that stopped first
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

 private:
  std::optional<double> fixed_;
  std::vector<RankProgress> ranks_;
  std::vector<double> intervals_;  // seconds per heartbeat, the newest kKeep
};

}  // namespace pacer::run
