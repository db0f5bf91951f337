// The goodput ledger: where every second (and GPU-hour) of a run's allocation went, from its job catalog.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"

namespace pacer::telemetry {
class Catalog;
}

namespace pacer::goodput {

// One part of the allocation. Names, in ledger order: productive,
// input_wait, exposed_comm, stragglers, other, checkpoint_stall,
// restart_lost_work, restart_gap, startup, idle_end (docs/goodput.md).
struct Bucket {
  std::string name;
  double seconds = 0;  // wall seconds of the allocation
  std::string how;     // how it was measured, for people
};

// The rank the job waited for most (the largest sum, over steps, of its step
// time beyond the median rank's).
struct Straggler {
  int rank = -1;
  std::string node;                       // hostname; empty when the catalog does not say
  double seconds = 0;                     // the job's wait for it
  std::int64_t steps = 0;                 // steps in which it was the slowest rank
  std::vector<std::string> vet_findings;  // its node's vet events (kind: detail)
};

// Checkpoints and restarts as measured, and Young/Daly's interval for them.
struct CheckpointFacts {
  std::int64_t checkpoints = 0;  // saves seen (committed steps, checkpoint events, steps reporting save_s)
  double save_cost_s = 0;        // mean stall per save
  double interval_s = 0;         // mean wall time between saves; 0 with fewer than two
  std::int64_t failures = 0;     // attempts that were restarted
  double mtbf_s = 0;             // wall time / failures; 0 without a failure
  double optimal_interval_s = 0; // pacer::optimal_interval(save_cost_s, mtbf_s)
  std::int64_t redone_steps = 0;
};

struct Recovery {
  std::string bucket;     // the largest loss (a Bucket name)
  double share = 0;       // its share of the allocation
  std::string advice;     // one sentence: what would recover it
  std::optional<double> saves_share;  // share of the allocation the advice is expected to save, when computed
};

struct Ledger {
  std::string db;
  std::int64_t run_id = 0;
  double started = 0, ended = 0;  // Unix seconds; the allocation's span
  bool ended_from_data = false;   // the run has no end time: the last record's time
  int gpus = 0;
  std::string gpus_from;          // "samples", "--gpus" or "ranks (no GPU samples)"
  int ranks = 0;
  int attempts = 0;
  std::int64_t steps = 0;         // job steps (one per step number and attempt, over all ranks)
  double planned_step_s = 0;
  std::string planned_from;       // "--planned-step", "--plan FILE" or the measured percentile, said so
  std::int64_t faster_than_plan = 0;  // steps that left less than the planned time for compute (productive at their time)
  std::vector<Bucket> buckets;
  std::optional<Straggler> straggler;
  CheckpointFacts checkpoint;
  Recovery recovery;
  std::vector<std::string> notes;

  double whole_s() const { return ended - started; }
  double sum_s() const;
  const Bucket* bucket(const std::string& name) const;
};

struct Options {
  std::optional<std::int64_t> run_id;      // default: the run that started last
  std::optional<double> planned_step_s;    // --planned-step
  std::string plan_file;                   // --plan: a `pacer plan step --json` document (step_s)
  std::optional<int> gpus;                 // --gpus: overrides the count from the samples
  double percentile = 0.10;                // of measured compute time, without a plan
};

// Reads the run from an open catalog (read-only queries) and splits its wall
// time. A run without step records is a usage error naming the catalog.
Expected<Ledger> build_ledger(telemetry::Catalog& catalog, const Options& options);
// Opens `db` read-only and builds the ledger; a missing file is a usage error naming it.
Expected<Ledger> ledger_of(const std::string& db, const Options& options);
// The planned step time of a `pacer plan step --json` file (its "step_s").
Expected<double> read_planned_step(const std::string& path);
// That file's document, checked to be one (schema pacer.plan.step/1); a
// missing file is a usage error naming it.
Expected<nlohmann::json> read_plan_step(const std::string& path);
// Whether an event marks a checkpoint (run.committed, checkpoint.*, ckpt.*).
bool is_checkpoint_event(const std::string& kind);

// The `pacer.goodput/1` document.
nlohmann::json to_json(const Ledger& ledger);
// The human table, ending in "OK: largest loss ..." (or FAILED when the parts
// do not sum to the whole within 1%).
std::string to_text(const Ledger& ledger);
// Whether the parts sum to the whole within `tolerance` of it.
bool balanced(const Ledger& ledger, double tolerance = 0.01);

}  // namespace pacer::goodput
