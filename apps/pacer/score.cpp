// `pacer score` and `pacer report`: judge how saturated a run kept each resource; draw the run as one HTML file.
#include <fmt/format.h>

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
  unwrap(report::write_report(a.db, a.out, report::ReportOptions{.score = score_options(a)}));
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
  cmd->footer("Exit codes: 0 written, 2 usage error, 3 runtime error (cannot write). See docs/score.md.");
  return [args] { return report_cmd(*args); };
}

}  // namespace pacer::cli
