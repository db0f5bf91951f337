// `pacer vet`: parse options, run the library's vet, print table or JSON.
#include "pacer/vet/vet.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <memory>

#include "commands.hpp"
#include "output.hpp"
#include "pacer/comm/communicator.hpp"
#include "pacer/comm/timed.hpp"
#include "pacer/vet/cluster.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/core/progress.hpp"
#include "pacer/core/table.hpp"
#include "pacer/core/units.hpp"

namespace pacer::cli {
namespace {

struct VetArgs {
  std::string profile = "default";
  std::string baseline;
  bool quick = false;
  std::vector<std::string> only;
  std::vector<std::string> skip;
  std::vector<std::string> paths;
  std::string timeout;
  int expect_gpus = -1;
  std::vector<std::string> inject;
  bool json = false;
  std::string json_file;
  bool list = false;
  bool show_profile = false;
  // Cluster mode and bounded runs.
  bool cluster = false;
  std::string node_name;
  int need = -1;
  std::string hostfile = "vet-hosts.txt";
  std::string exclude_file = "vet-exclude.txt";
  std::string bound;
  bool prolog = false;
};

// A prolog or health check is killed by Slurm after 60 s; this leaves room to exit.
constexpr double kPrologBound = 55;

int list_checks() {
  Table t({{"CHECK"}, {"CATEGORY"}, {"UNIT"}, {"WHAT"}});
  for (const auto& c : vet::list_checks()) t.add_row({c.name, c.category, c.unit, c.help});
  std::fputs(t.render().c_str(), stdout);
  return 0;
}

double positive_duration(const std::string& flag, const std::string& text) {
  auto t = parse_duration(text);
  if (!t || *t <= 0) usage_error(fmt::format("{} '{}': expected a positive duration such as 30s", flag, text));
  return *t;
}

int run_cluster(const VetArgs& a, vet::VetOptions node) {
  vet::ClusterOptions o;
  o.node = std::move(node);
  const auto net = std::find(o.node.skip.begin(), o.node.skip.end(), "network");
  if (net != o.node.skip.end()) {
    o.network = false;
    o.node.skip.erase(net);
  }
  // Not a node check either: the perftest pairs of the network phase.
  const auto rdma = std::find(o.node.skip.begin(), o.node.skip.end(), "rdma");
  if (rdma != o.node.skip.end()) {
    o.rdma = false;
    o.node.skip.erase(rdma);
  }
  o.node_name = a.node_name;
  if (a.need >= 0) o.need = static_cast<unsigned>(a.need);
  if (!a.bound.empty()) o.bound_s = positive_duration("--bound", a.bound);
  else if (a.prolog) o.bound_s = kPrologBound;
  if (o.node.quick) {
    o.p2p_bytes = 1u << 20;
    o.allreduce_bytes = 4u << 20;
    o.latency_reps = 100;
  }
  auto comm = comm::built_with_mpi() ? unwrap(comm::timed_world()) : comm::timed_single_rank();
  const auto start = std::chrono::steady_clock::now();
  const auto report = unwrap(vet::run_cluster_vet(*comm, o));
  if (!report) {
    // Not rank 0: rank 0 reports for everyone. MPI_Finalize would wait for a
    // pending operation's peer, or for rank 0 once it is gone past the bound;
    // such a rank leaves without it, but only after the bound, so that the
    // launcher's ending the job cannot cut rank 0's report short.
    const auto bound_end = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                       std::chrono::duration<double>(o.bound_s + 1));
    if (comm->abandoned() || std::chrono::steady_clock::now() > bound_end) {
      std::this_thread::sleep_until(bound_end);
      comm->abort(0);
    }
    return 0;
  }
  const int code = vet::exit_code(*report);
  const std::string json = vet::to_json(*report).dump(2) + "\n";
  if (!a.json_file.empty()) unwrap(write_file_atomic(a.json_file, json));
  if (report->selection) unwrap(vet::write_selection(*report->selection, a.hostfile, a.exclude_file));
  std::fputs(a.json ? json.c_str() : vet::render_table(*report).c_str(), stdout);
  std::fflush(nullptr);
  // A node that never answered would keep MPI_Finalize waiting past the bound.
  if (!report->complete() || comm->abandoned()) comm->abort(code);
  return code;
}

int run(const VetArgs& a) {
  if (a.list) return list_checks();
  if (a.show_profile) {
    auto p = unwrap(vet::load_profile(a.profile));
    std::puts(vet::to_json(p).dump(2).c_str());
    return 0;
  }
  if (!a.cluster && a.need >= 0) usage_error("--need applies to --cluster runs");
  vet::VetOptions o;
  o.profile = a.profile;
  if (!a.baseline.empty()) o.baseline_path = a.baseline;
  o.quick = a.quick || a.prolog;
  o.only = a.only;
  o.skip = a.skip;
  o.storage_paths = a.paths;
  o.node_name = a.node_name;
  if (!a.timeout.empty()) o.timeout_s = positive_duration("--timeout", a.timeout);
  if (!a.bound.empty()) o.bound_s = positive_duration("--bound", a.bound);
  else if (a.prolog) o.bound_s = kPrologBound;
  if (a.expect_gpus >= 0) o.expect_gpus = static_cast<unsigned>(a.expect_gpus);
  for (const auto& s : a.inject) o.injections.push_back(unwrap(vet::parse_injection(s)));
  if (a.cluster) return run_cluster(a, std::move(o));

  auto progress = std::make_shared<Progress>();
  o.on_probe = [progress](const std::string& probe, std::size_t i, std::size_t n, bool done) {
    if (done) progress->clear();
    else progress->update(fmt::format("[{}/{}] {} ...", i + 1, n, probe));
  };

  const vet::VetReport report = unwrap(vet::run_vet(o));
  progress->clear();
  const std::string json = vet::to_json(report).dump(2) + "\n";
  if (!a.json_file.empty()) unwrap(write_file_atomic(a.json_file, json));
  if (a.json) std::fputs(json.c_str(), stdout);
  else std::fputs(vet::render_table(report).c_str(), stdout);
  return static_cast<int>(vet::exit_code(report));
}

}  // namespace

Handler register_vet(CLI::App& app) {
  auto args = std::make_shared<VetArgs>();
  CLI::App* cmd = app.add_subcommand("vet", "Check this node before a job spends its allocation");
  cmd->footer(
      "Exit codes: 0 all checks pass (warnings allowed), 1 a check failed or could not finish,\n"
      "2 usage or configuration error, 3 internal error, 4 (--cluster --need N) fewer than N healthy nodes,\n"
      "130 interrupted. See docs/vet.md.");
  cmd->add_flag("--quick", args->quick, "Prolog-sized run: every check, with small sizes and short durations");
  cmd->add_option("--profile", args->profile, "Built-in profile (default, h200) or a TOML file")->capture_default_str();
  cmd->add_option("--baseline", args->baseline, "JSON report of a known-good run: judge figures relative to it");
  cmd->add_option("--only", args->only, "Run only these checks or categories (comma-separated)")->delimiter(',');
  cmd->add_option("--skip", args->skip, "Skip these checks or categories (comma-separated)")->delimiter(',');
  cmd->add_option("--path", args->paths, "Storage path to test (repeatable; replaces the profile's paths)");
  cmd->add_option("--timeout", args->timeout, "Timeout for every check, e.g. 30s (default: per check)");
  cmd->add_option("--expect-gpus", args->expect_gpus, "GPUs this node must have (default: profile, 0 = any)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--inject", args->inject,
                  "Chaos testing: [NODE:]CHECK=hang, CHECK=crash or CHECK=VALUE (repeatable); NODE limits it to one node");
  cmd->add_flag("--json", args->json, "Print the full JSON report instead of the table");
  cmd->add_option("--json-file", args->json_file, "Also write the JSON report to this file (atomically)");
  cmd->add_flag("--cluster", args->cluster,
                "Vet every node of an MPI job (srun/mpirun): one leader per node, network tests, drift and outliers");
  cmd->add_option("--node-name", args->node_name, "This rank's node name (default: host name); ranks with one name form a node");
  cmd->add_option("--need", args->need, "With --cluster: pick this many healthy nodes; exit 4 when fewer are healthy")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--hostfile", args->hostfile, "With --need: file for the chosen nodes, one per line")->capture_default_str();
  cmd->add_option("--exclude-file", args->exclude_file, "With --need: file for every other node (srun --exclude=./FILE)")
      ->capture_default_str();
  cmd->add_option("--bound", args->bound, "Hard bound on the whole run, e.g. 55s (default: none; 300s with --cluster)");
  cmd->add_flag("--prolog", args->prolog, "Slurm prolog / HealthCheckProgram mode: --quick with a 55 s bound");
  cmd->add_flag("--list", args->list, "List the checks and exit");
  cmd->add_flag("--show-profile", args->show_profile, "Print the resolved profile as JSON and exit");
  return [args] { return run(*args); };
}

}  // namespace pacer::cli
