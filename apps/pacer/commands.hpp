// The subcommands of the pacer CLI; each registers its options and a handler.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace pacer::cli {

// A subcommand's handler returns the process exit code; errors travel as
// pacer::Exception and are mapped to exit codes once, in main.
using Handler = std::function<int()>;

Handler register_vet(CLI::App& app);
Handler register_ckpt(CLI::App& app);
Handler register_shard(CLI::App& app);
Handler register_plan(CLI::App& app);
Handler register_comm(CLI::App& app);
Handler register_monitor(CLI::App& app);
Handler register_query(CLI::App& app);
Handler register_catalog(CLI::App& app);
Handler register_run(CLI::App& app);
Handler register_run_agent(CLI::App& app);
Handler register_ports(CLI::App& app);
Handler register_bcast(CLI::App& app);
Handler register_score(CLI::App& app);
Handler register_report(CLI::App& app);
Handler register_goodput(CLI::App& app);
Handler register_annotate(CLI::App& app);
Handler register_curate(CLI::App& app);
Handler register_data(CLI::App& app);

}  // namespace pacer::cli
