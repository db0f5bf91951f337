// `pacer ports`: free ports for this job's local rank, from a deterministic range, for shell scripts.
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "commands.hpp"
#include "output.hpp"
#include "pacer/run/ports.hpp"

namespace pacer::cli {
namespace {

struct PortsArgs {
  int count = 1;
  run::PortPlan plan;
  std::optional<std::uint64_t> job;
  std::optional<int> local_rank;
  bool json = false;
  std::vector<std::string> argv;
};

int ports(const PortsArgs& a) {
  auto scope = unwrap(run::port_scope_from_env());
  if (a.job) {
    scope.job = *a.job;
    scope.job_from = "--job";
  }
  if (a.local_rank) {
    scope.local_rank = *a.local_rank;
    scope.rank_from = "--local-rank";
  }
  const auto local = unwrap(run::read_local_ports(a.plan.root));
  const auto range = unwrap(run::port_range(a.plan, scope, local));
  auto lease = unwrap(run::PortLease::acquire(a.count, scope, a.plan));
  std::string list;
  for (int p : lease.ports()) list += (list.empty() ? "" : " ") + std::to_string(p);
  if (!a.argv.empty()) {
    // Handed over at exec: the ports stay bound until the moment CMD starts.
    setenv("PACER_PORTS", list.c_str(), 1);
    for (std::size_t i = 0; i < lease.ports().size(); ++i)
      setenv(fmt::format("PACER_PORT_{}", i).c_str(), std::to_string(lease.ports()[i]).c_str(), 1);
    lease.release_all();
    std::vector<char*> args;
    for (const auto& s : a.argv) args.push_back(const_cast<char*>(s.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    const int e = errno;
    std::fprintf(stderr, "pacer: error: %s: %s\n", a.argv[0].c_str(), e == ENOENT ? "command not found" : std::strerror(e));
    return e == ENOENT ? 127 : 126;
  }
  // Plain output is the ports alone, one line, for `read P1 P2 < <(pacer ports --count 2)`.
  print(run::to_json(scope, range, lease.ports(), local), a.json, list + "\n");
  return 0;
}

}  // namespace

Handler register_ports(CLI::App& app) {
  auto args = std::make_shared<PortsArgs>();
  auto* cmd = app.add_subcommand("ports", "Free ports for this job's local rank, from a range no other rank or job uses");
  cmd->add_option("--count,-n", args->count, "How many ports")->capture_default_str();
  cmd->add_option("--first", args->plan.first, "Lowest port of the plan")->capture_default_str();
  cmd->add_option("--last", args->plan.last, "Highest port of the plan")->capture_default_str();
  cmd->add_option("--per-rank", args->plan.per_rank, "Ports in one local rank's range")->capture_default_str();
  cmd->add_option("--ranks-per-job", args->plan.ranks_per_job, "Local ranks one job's block has room for")
      ->capture_default_str();
  cmd->add_option("--job", args->job, "Job id (default $SLURM_JOB_ID, 0 bare)");
  cmd->add_option("--local-rank", args->local_rank, "Local rank (default $SLURM_LOCALID, $LOCAL_RANK, ...)");
  cmd->add_flag("--json", args->json, "JSON report (pacer.ports/1)");
  // A test seam: where /proc/sys/net/ipv4 (the ephemeral range) is read from.
  cmd->add_option("--proc-root", args->plan.root)->group("");
  cmd->add_option("command", args->argv, "CMD to exec with PACER_PORTS and PACER_PORT_<i> set (after --)");
  return [args] { return ports(*args); };
}

}  // namespace pacer::cli
