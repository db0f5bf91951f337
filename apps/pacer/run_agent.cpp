// `pacer run-agent`: the per-node side of `pacer run --nodes` (started by the leader's launcher, not by hand).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <memory>

#include "commands.hpp"
#include "pacer/core/time.hpp"
#include "pacer/core/units.hpp"
#include "pacer/run.hpp"
#include "pacer/telemetry/catalog.hpp"
#include "run_monitor.hpp"

namespace pacer::cli {
namespace {

struct AgentArgs {
  run::AgentOptions agent;
  std::string monitor_db, monitor_interval = "1s", monitor_job;
};

// The leader's --monitor: CMD runs under `pacer monitor` into this node's own
// catalog file, in a run of the leader's job key, so that the leader's merge
// makes it part of its run. A catalog that cannot be opened costs the
// samples, not the training: CMD then runs unmonitored.
int run_agent(AgentArgs& a) {
  if (!a.monitor_db.empty()) {
    const std::string node = run::agent_node_name(a.agent);
    const std::string db = node_catalog(a.monitor_db, node);
    auto interval = parse_duration(a.monitor_interval);
    std::string problem;
    if (auto cat = telemetry::Catalog::open(db); !cat) {
      problem = cat.error().message;
    } else {
      telemetry::RunInfo ri;
      ri.job_id = a.monitor_job;
      ri.command = fmt::format("pacer run-agent (attempt {}) -- {}", a.agent.attempt, fmt::join(a.agent.argv, " "));
      ri.hostname = node;
      ri.started = wall_now();
      ri.interval_s = interval ? *interval : 1;
      if (auto id = (*cat)->begin_run(ri)) a.agent.argv = monitored(db, *id, a.monitor_interval, a.agent.argv);
      else problem = id.error().message;
    }
    if (!problem.empty())
      std::fprintf(stderr, "pacer run-agent %s: warning: %s; CMD runs without pacer monitor\n", node.c_str(),
                   problem.c_str());
  }
  return run::run_agent(a.agent);
}

}  // namespace

Handler register_run_agent(CLI::App& app) {
  auto a = std::make_shared<AgentArgs>();
  auto* cmd = app.add_subcommand("run-agent", "One node of `pacer run --nodes`: run CMD here for the leader (started by "
                                              "the leader's launcher; docs/run.md, \"Several nodes\")");
  cmd->add_option("--leader", a->agent.leader, "The leader's HOST:PORT")->required();
  cmd->add_option("--attempt", a->agent.attempt, "The leader's attempt number")->required();
  cmd->add_option("--node-name", a->agent.node_name,
                  "This node's name as the leader knows it (default: $PACER_NODE_NAME, $SLURMD_NODENAME, host name)");
  cmd->add_option("--monitor-db", a->monitor_db,
                  "The job's catalog (pacer run --monitor): CMD runs under pacer monitor into DB-NODE.db");
  cmd->add_option("--monitor-interval", a->monitor_interval, "Sampling interval for --monitor-db")->capture_default_str();
  cmd->add_option("--monitor-job", a->monitor_job, "The job id of the node's run (the leader's run's)");
  cmd->add_option("command", a->agent.argv, "CMD and its arguments, after --")->required();
  return [a] { return run_agent(*a); };
}

}  // namespace pacer::cli
