// `pacer plan ckpt` and `pacer ckpt interval` answer one question, the checkpoint
// interval: one set of flags, one computation (plan::plan_ckpt) and one output.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace pacer::cli {

struct IntervalArgs {
  std::string save_cost, restart_cost = "0s", mtbf, node_mtbf, campaign, interval, ckpt_size, vet, write_time;
  int nodes = 0;
  double write_mbps = 0;
  bool json = false;
};

// The flags (--save-cost or --ckpt-size with --write-mbps or --vet, --mtbf or
// --node-mtbf with --nodes, --restart-cost, --campaign, --interval); --json is
// the caller's.
void add_interval_options(CLI::App* cmd, IntervalArgs& a);
// Prints the report under `schema` (pacer.plan.ckpt/1 or pacer.ckpt.interval/1).
int print_interval(const IntervalArgs& a, const std::string& schema);

}  // namespace pacer::cli
