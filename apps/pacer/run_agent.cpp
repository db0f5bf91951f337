// `pacer run-agent`: the per-node side of `pacer run --nodes` (started by the leader's launcher, not by hand).
#include <memory>

#include "commands.hpp"
#include "pacer/run.hpp"

namespace pacer::cli {

Handler register_run_agent(CLI::App& app) {
  auto a = std::make_shared<run::AgentOptions>();
  auto* cmd = app.add_subcommand("run-agent", "One node of `pacer run --nodes`: run CMD here for the leader (started by "
                                              "the leader's launcher; docs/run.md, \"Several nodes\")");
  cmd->add_option("--leader", a->leader, "The leader's HOST:PORT")->required();
  cmd->add_option("--attempt", a->attempt, "The leader's attempt number")->required();
  cmd->add_option("--node-name", a->node_name,
                  "This node's name as the leader knows it (default: $PACER_NODE_NAME, $SLURMD_NODENAME, host name)");
  cmd->add_option("command", a->argv, "CMD and its arguments, after --")->required();
  return [a] { return run::run_agent(*a); };
}

}  // namespace pacer::cli
