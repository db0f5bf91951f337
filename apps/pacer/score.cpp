// `pacer score` and `pacer report`: judge how saturated a run kept each resource; draw the run as one HTML file.
#include <fmt/format.h>

#include <cmath>
#include <cstdio>

#include "commands.hpp"
#include "output.hpp"
#include "pacer/report.hpp"
#include "pacer/score.hpp"

namespace pacer::cli {
namespace {

struct ScoreArgs {
  std::string db, out;
  std::optional<std::int64_t> run;
  double nic_gbps = 0;
  bool json = false;
  std::string plan;                  // report only
  std::optional<double> peak_tflops; // report only
};

score::ScoreOptions score_options(const ScoreArgs& a) {
  if (a.nic_gbps < 0) usage_error("--nic-gbps must not be negative");
  return {a.run, a.nic_gbps * 1e9 / 8};
}

int score_cmd(const ScoreArgs& a) {
  const auto r = unwrap(score::score_catalog(a.db, score_options(a)));
  print(score::to_json(r), a.json, score::to_text(r));
  return 0;
}

int report_cmd(const ScoreArgs& a) {
  if (a.out.empty()) usage_error("pacer report: -o FILE is required");
  if (a.peak_tflops && !(std::isfinite(*a.peak_tflops) && *a.peak_tflops > 0))
    usage_error("--peak-tflops must be a positive number of TFLOP/s");
  unwrap(report::write_report(a.db, a.out,
                              report::ReportOptions{.score = score_options(a), .plan_file = a.plan, .peak_tflops = a.peak_tflops}));
  std::fprintf(stderr, "OK: wrote %s\n", a.out.c_str());
  return 0;
}

void add_common(CLI::App* cmd, ScoreArgs& a) {
  cmd->add_option("db", a.db, "Catalog file")->required();
  cmd->add_option("--run", a.run, "Run id (default: the run that started last)");
  cmd->add_option("--nic-gbps", a.nic_gbps, "Network capacity per node and direction in Gb/s (judges network utilization)");
}

}  // namespace

Handler register_score(CLI::App& app) {
  auto args = std::make_shared<ScoreArgs>();
  CLI::App* cmd = app.add_subcommand("score", "Score how saturated a run kept compute, memory, communication, input, host CPU and I/O");
  add_common(cmd, *args);
  cmd->add_flag("--json", args->json, "JSON output (pacer.score/1)");
  cmd->footer("Exit codes: 0 scored, 2 usage error (no such run, missing or newer catalog), 3 runtime error. See docs/score.md.");
  return [args] { return score_cmd(*args); };
}

Handler register_report(CLI::App& app) {
  auto args = std::make_shared<ScoreArgs>();
  CLI::App* cmd = app.add_subcommand("report", "Write a run's report as one self-contained HTML file");
  add_common(cmd, *args);
  cmd->add_option("-o,--output", args->out, "The HTML file to write")->required();
  cmd->add_option("--plan", args->plan,
                  "A `pacer plan step --json` file: FLOPs per token and GPU peak for MFU, planned step for goodput");
  cmd->add_option("--peak-tflops", args->peak_tflops, "Dense peak of one GPU in TFLOP/s, for MFU (overrides the plan's)");
  cmd->footer("Exit codes: 0 written, 2 usage error (also a missing or malformed --plan), 3 runtime error (cannot write). "
              "See docs/score.md.");
  return [args] { return report_cmd(*args); };
}

}  // namespace pacer::cli
