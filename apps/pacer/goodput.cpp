// `pacer goodput`: split a run's allocation into productive compute and each kind of loss.
#include "commands.hpp"
#include "output.hpp"
#include "pacer/core/error.hpp"
#include "pacer/goodput.hpp"

namespace pacer::cli {
namespace {

struct GoodputArgs {
  std::string db, plan;
  std::optional<std::int64_t> run;
  std::optional<double> planned_step;
  std::optional<int> gpus;
  bool json = false;
};

int goodput_cmd(const GoodputArgs& a) {
  if (a.planned_step && !(*a.planned_step > 0)) usage_error("--planned-step must be a positive number of seconds");
  if (a.planned_step && !a.plan.empty()) usage_error("give --planned-step or --plan, not both");
  if (a.gpus && *a.gpus < 1) usage_error("--gpus must be at least 1");
  goodput::Options o;
  o.run_id = a.run;
  o.planned_step_s = a.planned_step;
  o.plan_file = a.plan;
  o.gpus = a.gpus;
  const auto l = unwrap(goodput::ledger_of(a.db, o));
  print(goodput::to_json(l), a.json, goodput::to_text(l));
  return goodput::balanced(l) ? 0 : 1;
}

}  // namespace

Handler register_goodput(CLI::App& app) {
  auto a = std::make_shared<GoodputArgs>();
  CLI::App* cmd = app.add_subcommand("goodput", "Split a run's GPU-hours into productive compute and each kind of loss");
  cmd->add_option("db", a->db, "Catalog file")->required();
  cmd->add_option("--run", a->run, "Run id (default: the run that started last)");
  cmd->add_option("--planned-step", a->planned_step, "Planned step time in seconds (the productive rate)");
  cmd->add_option("--plan", a->plan, "A `pacer plan step --json` file whose step_s is the planned step time");
  cmd->add_option("--gpus", a->gpus, "GPUs of the allocation (default: those with samples in the run, else one per rank)");
  cmd->add_flag("--json", a->json, "JSON output (pacer.goodput/1)");
  cmd->footer("Exit codes: 0 the parts sum to the whole, 1 they do not (within 1%), 2 usage error (missing catalog or "
              "plan, no such run, a run without step records), 3 runtime error. See docs/goodput.md.");
  return [a] { return goodput_cmd(*a); };
}

}  // namespace pacer::cli
