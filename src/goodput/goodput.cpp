#include "pacer/goodput.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <set>

#include "pacer/core/atomic_file.hpp"
#include "pacer/core/stats.hpp"  // optional_interval
#include "pacer/core/table.hpp"
#include "pacer/core/units.hpp"
#include "pacer/telemetry/catalog.hpp"

namespace pacer::goodput {

bool is_checkpoint_event(const std::string& kind) {
  return kind == "run.committed" || kind.rfind("checkpoint.", 0) == 0 || kind.rfind("ckpt.", 0) == 0;
}

namespace {

using telemetry::Catalog;
using telemetry::Value;

// A cell as a number (NaN for NULL or text) and as text.
double number_of(const Value& v) {
  return std::visit(
      [](const auto& x) -> double {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::int64_t> || std::is_same_v<T, double>) return static_cast<double>(x);
        else return NAN;
      },
      v);
}
std::string text_of(const Value& v) {
  const auto* s = std::get_if<std::string>(&v);
  return s ? *s : std::string();
}
double or_zero(double v) { return std::isfinite(v) && v > 0 ? v : 0; }

// The buckets, in the order of the ledger (docs/goodput.md).
enum B { kProductive, kInput, kComm, kStraggler, kOther, kCkpt, kLost, kRestartGap, kStartup, kIdleEnd, kBuckets };
const char* const kNames[kBuckets] = {"productive", "input_wait", "exposed_comm", "stragglers", "other",
                                      "checkpoint_stall", "restart_lost_work", "restart_gap", "startup", "idle_end"};

struct RankStep {
  int rank = 0;
  std::int64_t step = 0;
  double t = 0, step_time = 0, data_wait = 0, comm = 0, save = 0;
  int attempt = 0;
};

// One step of the job: the ranks' records of one step number in one attempt.
struct JobStep {
  int attempt = 0;
  std::int64_t step = 0;
  double end = 0;         // the slowest rank's end
  double slowest = 0;     // the longest step time of a rank
  double median = 0;      // the median rank's step time
  double data_wait = 0, comm = 0;  // the median rank's
  double save = 0;        // the longest save a rank reports
  int slowest_rank = -1;
  bool redone = false;
};

struct Event {
  double t = 0;
  std::string kind, detail;
  std::int64_t node_id = -1;
};

// The step a checkpoint event names: "step" in a JSON detail, or the number
// after "committed step " in a supervisor message.
std::optional<std::int64_t> event_step(const Event& e) {
  if (!e.detail.empty() && e.detail.front() == '{') {
    auto j = nlohmann::json::parse(e.detail, nullptr, false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer()) return j["step"].get<std::int64_t>();
    return std::nullopt;
  }
  const std::string key = "committed step ";
  const auto at = e.detail.find(key);
  if (at == std::string::npos) return std::nullopt;
  std::int64_t n = 0;
  std::size_t i = at + key.size(), digits = 0;
  for (; i < e.detail.size() && digits < 18 && e.detail[i] >= '0' && e.detail[i] <= '9'; ++i, ++digits)
    n = n * 10 + (e.detail[i] - '0');
  if (digits == 0) return std::nullopt;
  return n;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(pos));
  const std::size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

std::string pct(double v) { return fmt::format("{:.1f}%", 100 * v); }

// Waste of the allocation for checkpoints every `tau` seconds: each save
// stalls `cost`, and a failure loses half an interval on average.
double checkpoint_waste(double tau, double cost, double mtbf) { return cost / tau + tau / (2 * mtbf); }

Status find_run(Catalog& cat, const Options& o, Ledger& l, std::string& status) {
  if (o.run_id)
    if (auto s = telemetry::check_run(cat, *o.run_id); !s) return s;
  const std::string where = o.run_id ? fmt::format("WHERE run_id = {}", *o.run_id) : "";
  auto r = cat.query(fmt::format(
      "SELECT run_id, started, ended, catalog_status FROM runs {} ORDER BY started DESC, run_id DESC LIMIT 1", where));
  if (!r) return r.error();
  if (r->rows.empty()) return Error{ErrorKind::kUsage, fmt::format("{}: the catalog holds no run", cat.path())};
  const auto& row = r->rows[0];
  l.run_id = static_cast<std::int64_t>(number_of(row[0]));
  l.started = number_of(row[1]);
  l.ended = number_of(row[2]);
  status = text_of(row[3]);
  return {};
}

Expected<std::vector<RankStep>> read_steps(Catalog& cat, std::int64_t run) {
  auto r = cat.query(fmt::format(
      "SELECT rank, step, t, step_time_s, data_wait_s, comm_s, "
      "CASE WHEN extra IS NOT NULL AND json_valid(extra) THEN coalesce(json_extract(extra, '$.save_s'), "
      "json_extract(extra, '$.ckpt_s')) END FROM steps WHERE run_id = {} ORDER BY t, rank",
      run));
  if (!r) return r.error();
  std::vector<RankStep> out;
  out.reserve(r->rows.size());
  for (const auto& row : r->rows) {
    // A rank or step that is not a whole number in range is not a step record (a hand-edited catalog).
    const double rank = number_of(row[0]), n = number_of(row[1]);
    if (!(std::fabs(rank) < 1e9) || !(std::fabs(n) < 9e15)) continue;
    RankStep s;
    s.rank = static_cast<int>(rank);
    s.step = static_cast<std::int64_t>(n);
    s.t = number_of(row[2]);
    if (!std::isfinite(s.t)) continue;
    s.step_time = or_zero(number_of(row[3]));
    s.data_wait = or_zero(number_of(row[4]));
    s.comm = or_zero(number_of(row[5]));
    s.save = or_zero(number_of(row[6]));
    out.push_back(s);
  }
  return out;
}

Expected<std::vector<Event>> read_events(Catalog& cat, std::int64_t run) {
  auto r = cat.query(fmt::format("SELECT t, kind, detail, node_id FROM events WHERE run_id = {} ORDER BY t", run));
  if (!r) return r.error();
  std::vector<Event> out;
  for (const auto& row : r->rows) {
    Event e{number_of(row[0]), text_of(row[1]), text_of(row[2]), -1};
    if (!std::isfinite(e.t)) continue;
    const double node = number_of(row[3]);
    if (std::fabs(node) < 9e15) e.node_id = static_cast<std::int64_t>(node);
    out.push_back(std::move(e));
  }
  return out;
}

// Gives every rank step its attempt: by the supervisor's attempt starts
// (run.started) when there are any, else by a rank's step number not
// increasing (a loop that started again).
int assign_attempts(std::vector<RankStep>& steps, const std::vector<Event>& events) {
  std::vector<double> starts;
  for (const auto& e : events)
    if (e.kind == "run.started") starts.push_back(e.t);
  if (!starts.empty()) {
    for (auto& s : steps) {
      const double begin = s.t - s.step_time;
      const auto n = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin();
      s.attempt = std::max<int>(0, static_cast<int>(n) - 1);
    }
    return static_cast<int>(starts.size());
  }
  std::map<int, std::pair<std::int64_t, int>> last;  // rank -> (step, attempt)
  int attempts = 1;
  for (auto& s : steps) {
    auto it = last.find(s.rank);
    if (it == last.end()) {
      last[s.rank] = {s.step, 0};
      continue;
    }
    if (s.step <= it->second.first) ++it->second.second;
    it->second.first = s.step;
    s.attempt = it->second.second;
    attempts = std::max(attempts, s.attempt + 1);
  }
  return attempts;
}

std::vector<JobStep> job_steps(const std::vector<RankStep>& steps) {
  std::map<std::pair<int, std::int64_t>, std::vector<const RankStep*>> by;
  for (const auto& s : steps) by[{s.attempt, s.step}].push_back(&s);
  std::vector<JobStep> out;
  out.reserve(by.size());
  for (const auto& [key, ranks] : by) {
    JobStep j;
    j.attempt = key.first;
    j.step = key.second;
    for (const RankStep* r : ranks) {
      j.end = std::max(j.end, r->t);
      j.save = std::max(j.save, r->save);
    }
    // The median rank is a real rank (the lower one of an even count), so
    // that of two ranks the slower one is measured against the faster.
    std::vector<const RankStep*> by_time = ranks;
    std::sort(by_time.begin(), by_time.end(), [](const RankStep* a, const RankStep* b) { return a->step_time < b->step_time; });
    const RankStep* mid = by_time[(by_time.size() - 1) / 2];
    j.median = mid->step_time;
    j.data_wait = mid->data_wait;
    j.comm = mid->comm;
    j.slowest = by_time.back()->step_time;
    j.slowest_rank = by_time.back()->rank;
    out.push_back(j);
  }
  std::sort(out.begin(), out.end(), [](const JobStep& a, const JobStep& b) {
    return a.attempt != b.attempt ? a.attempt < b.attempt : a.end < b.end;
  });
  // A step number reached in an earlier attempt is done again: work lost to the restart.
  std::int64_t done = std::numeric_limits<std::int64_t>::min();
  int attempt = 0;
  std::int64_t reached = done;
  for (auto& j : out) {
    if (j.attempt != attempt) {
      done = std::max(done, reached);
      attempt = j.attempt;
    }
    j.redone = j.attempt > 0 && j.step <= done;
    reached = std::max(reached, j.step);
  }
  return out;
}

// The advice for the largest loss, and the share of the allocation it saves.
Recovery recover(const Ledger& l, const std::array<double, kBuckets>& s) {
  const double whole = l.whole_s();
  int worst = -1;
  for (int b = kInput; b < kBuckets; ++b)
    if (worst < 0 || s[b] > s[worst]) worst = b;
  Recovery r;
  r.bucket = kNames[worst];
  r.share = whole > 0 ? s[worst] / whole : 0;
  if (s[worst] <= 0) {
    r.advice = "nothing lost: every second went to productive compute at the planned rate";
    return r;
  }
  const CheckpointFacts& c = l.checkpoint;
  // Beyond the checkpoint interval, the most an advice can recover is its bucket.
  r.saves_share = r.share;
  const std::string up_to = " to recover up to " + pct(r.share);
  switch (worst) {
    case kCkpt:
    case kLost:
      if (c.optimal_interval_s > 0 && c.interval_s > 0) {
        const double now = checkpoint_waste(c.interval_s, c.save_cost_s, c.mtbf_s);
        const double best = checkpoint_waste(c.optimal_interval_s, c.save_cost_s, c.mtbf_s);
        r.saves_share = std::max(0.0, now - best);
        r.advice = fmt::format(
            "checkpoint every {} instead of {} (Young/Daly with the measured save cost {} and MTBF {}) saves {} of the allocation",
            format_duration(c.optimal_interval_s), format_duration(c.interval_s), format_duration(c.save_cost_s), format_duration(c.mtbf_s),
            pct(*r.saves_share));
      } else if (c.optimal_interval_s > 0) {
        r.saves_share.reset();
        r.advice = fmt::format("checkpoint every {} (Young/Daly with the measured save cost {} and MTBF {})",
                               format_duration(c.optimal_interval_s), format_duration(c.save_cost_s), format_duration(c.mtbf_s));
      } else if (worst == kCkpt) {
        r.advice = fmt::format("each save stalls the job {} and no failure was seen to weigh it against: save less often, "
                               "or asynchronously (pacer.Checkpointer returns once the state is staged),",
                               format_duration(c.save_cost_s)) + up_to;
      } else {
        r.saves_share.reset();
        r.advice = fmt::format("{} steps were done again after a restart with no measured save cost: checkpoint more often "
                               "(pacer plan ckpt gives the interval)", c.redone_steps);
      }
      break;
    case kInput:
      r.advice = "ranks wait for input: more loader threads or a deeper prefetch (pacer.data.Loader threads=, prefetch=)" + up_to;
      break;
    case kComm:
      r.advice = "communication is not hidden behind compute: overlap it (bucketed gradient all-reduce during the backward pass)" + up_to;
      break;
    case kStraggler:
      if (l.straggler && !l.straggler->node.empty())
        r.advice = fmt::format("rank {} on {} is the slowest in {} steps: exclude node {}", l.straggler->rank,
                               l.straggler->node, l.straggler->steps, l.straggler->node) + up_to;
      else
        r.advice = "ranks are uneven: find the slow rank's node (pacer vet) and exclude it" + up_to;
      break;
    case kOther:
      r.advice = "steps are slower than planned for reasons their records do not break down: look at the slowest steps "
                 "(pacer query DB slowest-steps)" + up_to;
      break;
    case kRestartGap:
      r.advice = fmt::format("{} restart(s) left the GPUs idle from an attempt's exit to the next one's first step: restart "
                             "faster (--restart-delay, a shorter start-up) or remove the failure's cause", c.failures) + up_to;
      break;
    case kStartup:
      r.advice = "start-up (vetting, loading, compiling) came before the first step: shorten it" + up_to;
      break;
    case kIdleEnd:
      r.advice = "the allocation went on after the last step: end the job when training ends" + up_to;
      break;
  }
  return r;
}

}  // namespace

double Ledger::sum_s() const {
  double s = 0;
  for (const auto& b : buckets) s += b.seconds;
  return s;
}

const Bucket* Ledger::bucket(const std::string& name) const {
  for (const auto& b : buckets)
    if (b.name == name) return &b;
  return nullptr;
}

bool balanced(const Ledger& l, double tolerance) {
  const double whole = l.whole_s();
  if (whole <= 0) return std::fabs(l.sum_s()) <= 1e-9;
  return std::fabs(l.sum_s() - whole) <= tolerance * whole;
}

Expected<nlohmann::json> read_plan_step(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return Error{ErrorKind::kUsage, fmt::format("{}: no such plan file", path)};
  auto text = read_file(path);
  if (!text) return text.error();
  auto j = nlohmann::json::parse(*text, nullptr, false);
  if (!j.is_object() || j.value("schema", std::string()) != "pacer.plan.step/1")
    return Error{ErrorKind::kConfig, fmt::format("{}: not a `pacer plan step --json` document (schema pacer.plan.step/1)", path)};
  return j;
}

Expected<double> read_planned_step(const std::string& path) {
  auto doc = read_plan_step(path);
  if (!doc) return doc.error();
  const nlohmann::json& j = *doc;
  if (!j.contains("step_s") || !j["step_s"].is_number() || !(j["step_s"].get<double>() > 0) ||
      !std::isfinite(j["step_s"].get<double>()))
    return Error{ErrorKind::kConfig, fmt::format("{}: step_s: expected a positive number of seconds", path)};
  return j["step_s"].get<double>();
}

Expected<Ledger> build_ledger(Catalog& cat, const Options& o) {
  Ledger l;
  l.db = cat.path();
  std::string status;
  if (Status s = find_run(cat, o, l, status); !s) return s.error();
  if (!status.empty() && status != "ok") l.notes.push_back("catalog: " + status);

  auto steps = read_steps(cat, l.run_id);
  if (!steps) return steps.error();
  if (steps->empty())
    return Error{ErrorKind::kUsage,
                 fmt::format("{}: run {} has no step records: the ledger needs the training loop's steps "
                             "(pacer.telemetry.step, or pacer monitor --steps FILE)",
                             cat.path(), l.run_id)};
  auto events = read_events(cat, l.run_id);
  if (!events) return events.error();

  // The allocation's span: the run's start and end, or the records' when the catalog lacks one.
  double first = INFINITY, last = -INFINITY;
  for (const auto& s : *steps) {
    first = std::min(first, s.t - s.step_time);
    last = std::max(last, s.t);
  }
  for (const auto& e : *events) last = std::max(last, e.t);
  if (!std::isfinite(l.started)) {
    l.started = first;
    l.notes.push_back("the run has no start time: the allocation starts at the first step");
  }
  if (!std::isfinite(l.ended)) {
    l.ended = last;
    l.ended_from_data = true;
    l.notes.push_back("the run has no end time (still running, or its monitor was killed): it ends at the last record");
  }
  if (l.ended < l.started) l.ended = l.started;

  l.attempts = assign_attempts(*steps, *events);
  std::set<int> ranks;
  for (const auto& s : *steps) ranks.insert(s.rank);
  l.ranks = static_cast<int>(ranks.size());
  std::vector<JobStep> js = job_steps(*steps);
  l.steps = static_cast<std::int64_t>(js.size());

  // GPUs: --gpus, else those with samples in this run, else one per rank.
  if (o.gpus) {
    l.gpus = *o.gpus;
    l.gpus_from = "--gpus";
  } else {
    auto g = cat.query(fmt::format("SELECT count(DISTINCT gpu_id) FROM samples WHERE run_id = {} AND gpu_id IS NOT NULL", l.run_id));
    if (!g) return g.error();
    l.gpus = static_cast<int>(or_zero(number_of(g->rows.at(0).at(0))));
    l.gpus_from = "samples";
    if (l.gpus == 0) {
      l.gpus = std::max(1, l.ranks);
      l.gpus_from = "ranks (no GPU samples)";
    }
  }

  // The productive rate: the plan's, else the fastest sustained compute.
  if (o.planned_step_s) {
    l.planned_step_s = *o.planned_step_s;
    l.planned_from = "--planned-step";
  } else if (!o.plan_file.empty()) {
    auto p = read_planned_step(o.plan_file);
    if (!p) return p.error();
    l.planned_step_s = *p;
    l.planned_from = "--plan " + o.plan_file;
  } else {
    std::vector<double> compute;
    for (const auto& j : js)
      if (!j.redone && j.median > 0) compute.push_back(std::max(0.0, j.median - j.data_wait - j.comm - j.save));
    l.planned_step_s = percentile(compute, o.percentile);
    l.planned_from = fmt::format("no plan given: the {:.0f}th percentile of measured compute time per step "
                                 "(step time less data wait, communication and saves)",
                                 100 * o.percentile);
  }

  // Checkpointed steps: the gap after such a step is the save's stall.
  std::set<std::int64_t> saved;
  for (const auto& e : *events)
    if (is_checkpoint_event(e.kind))
      if (auto n = event_step(e)) saved.insert(*n);

  // Attempt exits: the in-flight work between an attempt's last step and its exit is lost.
  std::vector<double> exits;
  for (const auto& e : *events)
    if (e.kind == "run.exited") exits.push_back(e.t);

  std::array<double, kBuckets> sec{};
  std::map<int, std::pair<double, std::int64_t>> strag;  // rank -> (seconds, steps)
  double cursor = l.started;
  const double end = l.ended;
  auto advance_to = [&](double t, int bucket) {
    const double to = std::clamp(t, cursor, end);
    sec[bucket] += to - cursor;
    cursor = to;
  };
  std::vector<double> save_times;  // end of each checkpointed step
  double vet_s = 0;
  for (const auto& e : *events)
    if (e.kind.rfind("vet", 0) == 0 && e.t <= first) vet_s = std::max(vet_s, e.t - l.started);

  int attempt = -1;
  const JobStep* prev = nullptr;
  for (const auto& j : js) {
    if (j.attempt != attempt) {
      const double seg_start = j.end - j.slowest;
      if (attempt < 0) {
        advance_to(seg_start, kStartup);
      } else {
        // From the previous attempt's last step: in-flight work until its exit, then the restart gap.
        const auto ex = std::lower_bound(exits.begin(), exits.end(), cursor);
        if (ex != exits.end() && *ex < seg_start) {
          for (const auto& e : *events)
            if (e.kind == "run.hang" && e.t >= cursor && e.t <= *ex)
              l.notes.push_back(fmt::format("restart_lost_work includes a hang: {} from the last step of attempt {} to its exit",
                                            format_duration(*ex - cursor), attempt));
          advance_to(*ex, kLost);
        }
        advance_to(seg_start, kRestartGap);
      }
      attempt = j.attempt;
      prev = nullptr;
    }
    const double to = std::clamp(j.end, cursor, end);
    double d = to - cursor;
    cursor = to;
    if (j.redone) {
      sec[kLost] += d;
      ++l.checkpoint.redone_steps;
      prev = &j;
      continue;
    }
    // Between the previous step's end and this step's start: a save when the previous step was checkpointed.
    const double gap = std::max(0.0, d - j.slowest);
    d -= gap;
    const bool after_save = prev && saved.count(prev->step);
    sec[after_save ? kCkpt : kOther] += gap;
    if (after_save) save_times.push_back(prev->end);
    auto take = [&](int bucket, double want) {
      const double x = std::min(d, std::max(0.0, want));
      sec[bucket] += x;
      d -= x;
      return x;
    };
    if (take(kCkpt, j.save) > 0 && !after_save) save_times.push_back(j.end);
    const double waited = take(kStraggler, j.slowest - j.median);
    if (waited > 0) {
      strag[j.slowest_rank].first += waited;
      ++strag[j.slowest_rank].second;
    }
    take(kInput, j.data_wait);
    take(kComm, j.comm);
    if (take(kProductive, l.planned_step_s) < l.planned_step_s * (1 - 1e-9)) ++l.faster_than_plan;
    sec[kOther] += d;
    prev = &j;
  }
  // Time after the last step of a failed attempt without a later one is counted below as idle.
  advance_to(end, kIdleEnd);

  const char* how[kBuckets] = {
      "steps x the planned step time (a step faster than planned counts its own time)",
      "the median rank's data_wait_s per step",
      "the median rank's comm_s per step (communication the step reports as not overlapped)",
      "per step, the slowest rank's step time beyond the median rank's",
      "step time beyond plan, input, communication and stragglers; gaps between steps without a save",
      "gaps after a checkpointed step (run.committed, checkpoint.* events) and save_s reported by steps",
      "steps done again after a restart, and an attempt's in-flight work from its last step to its exit",
      "from an attempt's exit to the next attempt's first step",
      "from the run's start to the first step",
      "from the last step to the run's end"};
  for (int b = 0; b < kBuckets; ++b) l.buckets.push_back({kNames[b], sec[b], how[b]});
  if (vet_s > 0) l.notes.push_back(fmt::format("start-up includes vetting: {} until the vet result", format_duration(vet_s)));
  if (l.faster_than_plan > 0)
    l.notes.push_back(fmt::format("{} of {} steps left less than the planned {} for compute after their losses "
                                  "(they count their own time as productive)",
                                  l.faster_than_plan, l.steps, format_duration(l.planned_step_s)));

  // The straggler, its node and the node's vet findings.
  if (!strag.empty()) {
    auto worst = std::max_element(strag.begin(), strag.end(),
                                  [](const auto& a, const auto& b) { return a.second.first < b.second.first; });
    Straggler s{worst->first, "", worst->second.first, worst->second.second, {}};
    auto n = cat.query(fmt::format(
        "SELECT n.hostname, r.node_id FROM ranks r LEFT JOIN nodes n ON n.node_id = r.node_id WHERE r.run_id = {} AND r.rank = {}",
        l.run_id, s.rank));
    if (!n) return n.error();
    if (!n->rows.empty()) {
      s.node = text_of(n->rows[0][0]);
      const double node_id = number_of(n->rows[0][1]);
      for (const auto& e : *events)
        if (e.kind.rfind("vet", 0) == 0 && std::fabs(node_id) < 9e15 && e.node_id == static_cast<std::int64_t>(node_id))
          s.vet_findings.push_back(e.kind + ": " + e.detail.substr(0, 200));
    }
    l.straggler = std::move(s);
  }

  // Checkpoints and failures, for Young/Daly.
  CheckpointFacts& c = l.checkpoint;
  c.checkpoints = static_cast<std::int64_t>(save_times.size());
  c.save_cost_s = c.checkpoints ? sec[kCkpt] / static_cast<double>(c.checkpoints) : 0;
  if (save_times.size() >= 2) {
    std::sort(save_times.begin(), save_times.end());
    c.interval_s = (save_times.back() - save_times.front()) / static_cast<double>(save_times.size() - 1);
  }
  std::int64_t restarts = 0;
  for (const auto& e : *events)
    if (e.kind == "run.restart") ++restarts;
  c.failures = restarts ? restarts : std::max(0, l.attempts - 1);
  c.mtbf_s = c.failures ? l.whole_s() / static_cast<double>(c.failures) : 0;
  c.optimal_interval_s = optimal_interval(c.save_cost_s, c.mtbf_s);

  l.recovery = recover(l, sec);
  return l;
}

Expected<Ledger> ledger_of(const std::string& db, const Options& options) {
  auto cat = Catalog::open(db, telemetry::CatalogOptions{.read_only = true});
  if (!cat) return cat.error();
  return build_ledger(**cat, options);
}

nlohmann::json to_json(const Ledger& l) {
  using nlohmann::json;
  const double whole = l.whole_s();
  json buckets = json::array();
  for (const auto& b : l.buckets)
    buckets.push_back({{"name", b.name}, {"seconds", b.seconds}, {"gpu_hours", b.seconds * l.gpus / 3600},
                       {"share", whole > 0 ? b.seconds / whole : 0.0}, {"how", b.how}});
  const auto& c = l.checkpoint;
  json j = {{"schema", "pacer.goodput/1"},
            {"db", l.db},
            {"run_id", l.run_id},
            {"started", l.started},
            {"ended", l.ended},
            {"ended_from_data", l.ended_from_data},
            {"wall_s", whole},
            {"gpus", l.gpus},
            {"gpus_from", l.gpus_from},
            {"gpu_hours", whole * l.gpus / 3600},
            {"ranks", l.ranks},
            {"attempts", l.attempts},
            {"steps", l.steps},
            {"planned_step_s", l.planned_step_s},
            {"planned_from", l.planned_from},
            {"faster_than_plan", l.faster_than_plan},
            {"buckets", buckets},
            {"sum_s", l.sum_s()},
            {"balanced", balanced(l)},
            {"goodput", whole > 0 && l.bucket("productive") ? l.bucket("productive")->seconds / whole : 0.0},
            {"checkpoint",
             {{"checkpoints", c.checkpoints},
              {"save_cost_s", c.save_cost_s},
              {"interval_s", c.interval_s > 0 ? json(c.interval_s) : json(nullptr)},
              {"failures", c.failures},
              {"mtbf_s", c.mtbf_s > 0 ? json(c.mtbf_s) : json(nullptr)},
              {"optimal_interval_s", c.optimal_interval_s > 0 ? json(c.optimal_interval_s) : json(nullptr)},
              {"redone_steps", c.redone_steps}}},
            {"straggler", l.straggler ? json{{"rank", l.straggler->rank},
                                             {"node", l.straggler->node.empty() ? json(nullptr) : json(l.straggler->node)},
                                             {"seconds", l.straggler->seconds},
                                             {"steps", l.straggler->steps},
                                             {"vet_findings", l.straggler->vet_findings}}
                                      : json(nullptr)},
            {"largest_loss",
             {{"bucket", l.recovery.bucket},
              {"share", l.recovery.share},
              {"advice", l.recovery.advice},
              {"saves_share", l.recovery.saves_share ? json(*l.recovery.saves_share) : json(nullptr)}}},
            {"notes", l.notes}};
  return j;
}

std::string to_text(const Ledger& l) {
  const double whole = l.whole_s();
  std::string out = fmt::format("run {}: {} x {} GPU(s) ({}) = {:.3f} GPU-hours, {} steps, {} rank(s), {} attempt(s)\n",
                                l.run_id, format_duration(whole), l.gpus, l.gpus_from, whole * l.gpus / 3600, l.steps, l.ranks,
                                l.attempts);
  out += fmt::format("planned step {} ({})\n", format_duration(l.planned_step_s), l.planned_from);
  Table t({{"bucket"}, {"seconds", true}, {"GPU-hours", true}, {"share", true}});
  for (const auto& b : l.buckets)
    t.add_row({b.name, fmt::format("{:.2f}", b.seconds), fmt::format("{:.4f}", b.seconds * l.gpus / 3600),
               pct(whole > 0 ? b.seconds / whole : 0)});
  t.add_row({"total", fmt::format("{:.2f}", l.sum_s()), fmt::format("{:.4f}", l.sum_s() * l.gpus / 3600),
             pct(whole > 0 ? l.sum_s() / whole : 0)});
  out += t.render();
  if (l.straggler)
    out += fmt::format("straggler: rank {}{}, slowest in {} steps, {} waited for it{}\n", l.straggler->rank,
                       l.straggler->node.empty() ? "" : " on " + l.straggler->node, l.straggler->steps,
                       format_duration(l.straggler->seconds),
                       l.straggler->vet_findings.empty() ? "" : "; vet: " + l.straggler->vet_findings.front());
  const auto& c = l.checkpoint;
  if (c.checkpoints || c.failures)
    out += fmt::format("checkpoints: {} (mean stall {}), restarts: {}, steps redone: {}\n", c.checkpoints,
                       format_duration(c.save_cost_s), c.failures, c.redone_steps);
  for (const auto& n : l.notes) out += "note: " + n + "\n";
  if (!balanced(l))
    out += fmt::format("FAILED: the parts sum to {:.2f} s, not the allocation's {:.2f} s\n", l.sum_s(), whole);
  else
    out += fmt::format("OK: largest loss {} ({}): {}\n", l.recovery.bucket, pct(l.recovery.share), l.recovery.advice);
  return out;
}

}  // namespace pacer::goodput
