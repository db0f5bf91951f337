// `pacer vet`: parse options, run the library's vet, print table or JSON.
#include "pacer/vet/vet.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <memory>

#include "commands.hpp"
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
};

int list_checks() {
  Table t({{"CHECK"}, {"CATEGORY"}, {"UNIT"}, {"WHAT"}});
  for (const auto& c : vet::list_checks()) t.add_row({c.name, c.category, c.unit, c.help});
  std::fputs(t.render().c_str(), stdout);
  return 0;
}

int run(const VetArgs& a) {
  if (a.list) return list_checks();
  if (a.show_profile) {
    auto p = unwrap(vet::load_profile(a.profile));
    std::puts(vet::to_json(p).dump(2).c_str());
    return 0;
  }
  vet::VetOptions o;
  o.profile = a.profile;
  if (!a.baseline.empty()) o.baseline_path = a.baseline;
  o.quick = a.quick;
  o.only = a.only;
  o.skip = a.skip;
  o.storage_paths = a.paths;
  if (!a.timeout.empty()) {
    auto t = parse_duration(a.timeout);
    if (!t || *t <= 0) throw Exception(Error{ErrorKind::kUsage, fmt::format("--timeout '{}': expected a positive duration such as 30s", a.timeout)});
    o.timeout_s = *t;
  }
  if (a.expect_gpus >= 0) o.expect_gpus = static_cast<unsigned>(a.expect_gpus);
  for (const auto& s : a.inject) o.injections.push_back(unwrap(vet::parse_injection(s)));
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
      "2 usage or configuration error, 3 internal error, 130 interrupted. See docs/vet.md.");
  cmd->add_flag("--quick", args->quick, "Prolog-sized run: every check, with small sizes and short durations");
  cmd->add_option("--profile", args->profile, "Built-in profile (default, h200) or a TOML file")->capture_default_str();
  cmd->add_option("--baseline", args->baseline, "JSON report of a known-good run: judge figures relative to it");
  cmd->add_option("--only", args->only, "Run only these checks or categories (comma-separated)")->delimiter(',');
  cmd->add_option("--skip", args->skip, "Skip these checks or categories (comma-separated)")->delimiter(',');
  cmd->add_option("--path", args->paths, "Storage path to test (repeatable; replaces the profile's paths)");
  cmd->add_option("--timeout", args->timeout, "Timeout for every check, e.g. 30s (default: per check)");
  cmd->add_option("--expect-gpus", args->expect_gpus, "GPUs this node must have (default: profile, 0 = any)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--inject", args->inject, "Chaos testing: CHECK=hang, CHECK=crash or CHECK=VALUE (repeatable)");
  cmd->add_flag("--json", args->json, "Print the full JSON report instead of the table");
  cmd->add_option("--json-file", args->json_file, "Also write the JSON report to this file (atomically)");
  cmd->add_flag("--list", args->list, "List the checks and exit");
  cmd->add_flag("--show-profile", args->show_profile, "Print the resolved profile as JSON and exit");
  return [args] { return run(*args); };
}

}  // namespace pacer::cli
