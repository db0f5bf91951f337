// Internal to src/run: which rank of a hung job to name, from the steps, the
// idle times and the Python stacks that the hang event collects (docs/run.md,
// "How the hung rank is named").
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pacer::run {

// Where a stack dump shows a rank blocked in a collective: the call the
// program made (`torch.distributed.all_reduce`) and the first frame outside
// the library that made it (`train.py:40 in step`).
struct CollectiveWait {
  std::string op;
  std::string site;
};

// The collective the signalled thread of a faulthandler dump (the first one:
// the main thread, which the kernel prefers for a process-directed signal)
// waits in, judged from its innermost frames; nothing when it is elsewhere or
// the text holds no frames.
std::optional<CollectiveWait> collective_wait(std::string_view faulthandler_text);

// A stalled rank as the namer sees it.
struct Suspect {
  int rank = 0;
  std::string host;                 // empty on one node
  std::optional<std::uint64_t> step;  // its last heartbeat's step
  double idle_s = 0;                // since its last heartbeat
  std::optional<std::string> stacks;  // the dump's text; none: no stack file came
};

struct Naming {
  std::size_t index = 0;  // into the suspects
  std::string rule;       // "alone", "step", "stacks" or "first-stopped": the rule that decided
  std::string reason;     // for the event and the log, naming the ranks compared
};

// The rules, in order: (1) the ranks idle within `window_s` of the longest
// idle are the candidates (naming_window()); (2) of
// them, the lowest last step; (3) of those, by the stacks: the ranks not
// waiting in a collective while others are, or, when all wait, those whose
// collective differs from the one a strict majority waits in; (4) the one
// idle longest; (5) the lowest rank. `suspects` must not be empty.
Naming name_hung_rank(const std::vector<Suspect>& suspects, double window_s);

// The window for name_hung_rank: half the hang timeout, at least two poll
// periods. A rank still stepping heartbeated far more recently; one blocked
// behind the hung rank stopped about when it did, before or after it (a
// culprit descheduled before its last heartbeat is "younger" than the ranks
// waiting for it, and must stay a candidate).
inline double naming_window(double timeout_s, double poll_s) { return std::max(timeout_s / 2, 2 * poll_s); }

// Fills each suspect's stacks from the hang event's `stacks` array (entries
// with `rank`, `text` and, across nodes, `host`) and records in every entry
// what collective_wait() saw (`collective`: {op, site} or null).
void attach_stacks(std::vector<Suspect>& suspects, nlohmann::json& stacks);

// The `named` object of the hang event.
nlohmann::json naming_json(const std::vector<Suspect>& suspects, const Naming& n);

}  // namespace pacer::run
