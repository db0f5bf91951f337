// `pacer ckpt`: list, verify, prune and inspect checkpoint directories.
#include <fmt/format.h>

#include <filesystem>
#include <memory>

#include "commands.hpp"
#include "output.hpp"
#include "pacer/checkpoint.hpp"
#include "pacer/core/table.hpp"
#include "pacer/core/units.hpp"

namespace pacer::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct CkptArgs {
  std::string dir;
  std::optional<std::uint64_t> step;
  int keep_last = 3;
  int keep_every = 0;
  bool json = false;
  bool verify = false;
  std::string save_cost;
  std::string mtbf;
};

json entry_json(const ckpt::Entry& e) {
  return {{"step", e.step}, {"path", e.path}, {"bytes", e.bytes}, {"partial", e.partial}, {"committed", e.committed},
          {"verified", e.verified}, {"problem", e.problem}};
}

std::string status_of(const ckpt::Entry& e, bool verify) {
  if (e.partial) return "partial";
  if (!e.committed) return "CORRUPT";
  if (!verify) return "committed";
  return e.verified ? "valid" : "CORRUPT";
}

int ls(const CkptArgs& a) {
  require_dir(a.dir);
  const auto entries = ckpt::list(a.dir, a.verify);
  json j = {{"schema", "pacer.ckpt.ls/1"}, {"dir", a.dir}, {"checkpoints", json::array()}};
  Table t({{"STEP", true}, {"SIZE", true}, {"STATUS"}, {"PATH"}, {"PROBLEM"}});
  for (const auto& e : entries) {
    j["checkpoints"].push_back(entry_json(e));
    t.add_row({std::to_string(e.step), e.committed ? format_bytes(double(e.bytes)) : "-", status_of(e, a.verify), e.path, e.problem});
  }
  print(j, a.json, t.render());
  // A step directory that does not check (missing or truncated data, bad
  // manifest) is damage, not a leftover: it fails ls --verify.
  bool bad = false;
  for (const auto& e : entries)
    if (a.verify && !e.partial && !e.verified) bad = true;
  return bad ? 1 : 0;
}

int verify(const CkptArgs& a) {
  require_dir(a.dir);
  json j = {{"schema", "pacer.ckpt.verify/1"}, {"dir", a.dir}, {"checkpoints", json::array()}};
  Table t({{"STEP", true}, {"SIZE", true}, {"STATUS"}, {"PROBLEM"}});
  int checked = 0;
  bool bad = false;
  for (const auto& e : ckpt::list(a.dir, true)) {
    if (a.step && e.step != *a.step) continue;
    if (e.partial && !a.step) continue;  // leftovers of unfinished saves are not checkpoints
    ++checked;
    if (!e.verified) bad = true;
    j["checkpoints"].push_back(entry_json(e));
    t.add_row({std::to_string(e.step), e.committed ? format_bytes(double(e.bytes)) : "-", status_of(e, true), e.problem});
  }
  if (a.step && checked == 0) usage_error(fmt::format("{}: no checkpoint for step {}", a.dir, *a.step));
  j["verdict"] = bad ? "fail" : "pass";
  std::string table = t.render() + fmt::format("{}: {} checkpoint(s) checked in {}\n", bad ? "FAILED" : "OK", checked, a.dir);
  print(j, a.json, table);
  return bad ? 1 : 0;
}

int prune(const CkptArgs& a) {
  require_dir(a.dir);
  if (a.keep_last < 1) usage_error("--keep-last must be at least 1");
  const auto removed = unwrap(ckpt::prune(a.dir, a.keep_last, a.keep_every));
  json j = {{"schema", "pacer.ckpt.prune/1"}, {"dir", a.dir}, {"removed", removed}};
  std::string text;
  for (auto s : removed) text += fmt::format("removed step {}\n", s);
  text += fmt::format("OK: {} checkpoint(s) removed from {}\n", removed.size(), a.dir);
  print(j, a.json, text);
  return 0;
}

int inspect(const CkptArgs& a) {
  require_dir(a.dir);
  std::string step_dir = a.dir;
  if (a.step) step_dir = (fs::path(a.dir) / ckpt::step_dir_name(*a.step)).string();
  else {
    const auto entries = ckpt::list(a.dir, false);
    for (const auto& e : entries)
      if (e.committed) {
        step_dir = e.path;
        break;
      }
  }
  auto r = ckpt::Reader::open(step_dir);
  if (!r) usage_error(r.error().message);
  const auto& m = r->manifest();
  json j = ckpt::to_json(m);
  j["dir"] = step_dir;
  Table t({{"BLOB"}, {"RANK", true}, {"DTYPE"}, {"SHAPE"}, {"SIZE", true}, {"LAYOUT"}});
  for (const auto& b : m.blobs) {
    std::string shape = "[";
    for (std::size_t i = 0; i < b.shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(b.shape[i]);
    shape += "]";
    std::string layout = b.layout == ckpt::Layout::kShard
                             ? fmt::format("shard {}..{} of {}", b.shard_offset, b.shard_offset + b.size, b.global_size)
                             : "replicated";
    t.add_row({b.name, std::to_string(b.rank), b.dtype, shape, format_bytes(double(b.size)), layout});
  }
  std::string text = fmt::format("step {} in {} ({} rank(s), created {})\n", m.step, step_dir, m.world_size, m.created_at);
  text += t.render();
  text += "meta: " + m.meta.dump() + "\n";
  print(j, a.json, text);
  return 0;
}

int interval(const CkptArgs& a) {
  auto cost = parse_duration(a.save_cost);
  auto mtbf = parse_duration(a.mtbf);
  if (!cost || *cost <= 0) usage_error(fmt::format("--save-cost '{}': expected a positive duration", a.save_cost));
  if (!mtbf || *mtbf <= 0) usage_error(fmt::format("--mtbf '{}': expected a positive duration", a.mtbf));
  const double daly = ckpt::optimal_interval(*cost, *mtbf);
  const double young = ckpt::young_interval(*cost, *mtbf);
  json j = {{"schema", "pacer.ckpt.interval/1"}, {"save_cost_s", *cost}, {"mtbf_s", *mtbf}, {"interval_s", daly}, {"young_interval_s", young}};
  print(j, a.json, fmt::format("checkpoint every {} (Daly; Young's estimate {}) for a {} save and a {} MTBF\n",
                               format_duration(daly), format_duration(young), format_duration(*cost), format_duration(*mtbf)));
  return 0;
}

}  // namespace

Handler register_ckpt(CLI::App& app) {
  auto args = std::make_shared<CkptArgs>();
  auto handler = std::make_shared<Handler>();
  CLI::App* cmd = app.add_subcommand("ckpt", "List, verify, prune and inspect checkpoints");
  cmd->require_subcommand(1);
  cmd->footer("Exit codes: 0 ok, 1 a checkpoint failed verification, 2 usage error, 3 runtime error. See docs/checkpoint.md.");
  auto add = [&](const char* name, const char* help, int (*fn)(const CkptArgs&)) {
    CLI::App* sub = cmd->add_subcommand(name, help);
    sub->add_option("dir", args->dir, "Checkpoint root directory")->required();
    sub->add_flag("--json", args->json, "Machine-readable output");
    sub->callback([args, handler, fn] { *handler = [args, fn] { return fn(*args); }; });
    return sub;
  };
  add("ls", "List checkpoints: step, size, committed or partial", ls)
      ->add_flag("--verify", args->verify, "Also check every checksum (reads everything)");
  add("verify", "Check every checksum; exit 1 naming the first bad blob", verify)
      ->add_option("--step", args->step, "Only this step");
  auto* p = add("prune", "Remove checkpoints beyond retention (never the newest)", prune);
  p->add_option("--keep-last", args->keep_last, "Keep the newest N")->required();
  p->add_option("--keep-every", args->keep_every, "Also keep every step that is a multiple of M");
  add("inspect", "Show a checkpoint's blobs, dtypes, shapes and metadata", inspect)
      ->add_option("--step", args->step, "Step (default: newest committed)");
  CLI::App* iv = cmd->add_subcommand("interval", "Optimal checkpoint interval from the save cost and the MTBF (Young/Daly)");
  iv->add_option("--save-cost", args->save_cost, "Time one save costs the job, e.g. 40s")->required();
  iv->add_option("--mtbf", args->mtbf, "Mean time between failures of the whole job, e.g. 8h")->required();
  iv->add_flag("--json", args->json, "Machine-readable output");
  iv->callback([args, handler] { *handler = [args] { return interval(*args); }; });
  return [handler] { return *handler ? (*handler)() : static_cast<int>(ExitCode::kUsage); };
}

}  // namespace pacer::cli
