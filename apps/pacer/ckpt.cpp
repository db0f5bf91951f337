// `pacer ckpt`: list, verify, prune, inspect and export checkpoint directories.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <memory>

#include "ckpt_interval.hpp"
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
  bool remove_damaged = false;
  bool dry_run = false;
  std::string safetensors;
  std::string prefix = "model";
  std::string max_shard_size = "5GB";
};

std::string status_of(const ckpt::Entry& e, bool verify) {
  if (e.partial) return "partial";
  if (e.damaged) return "damaged";
  if (!e.committed) return "CORRUPT";
  if (!verify) return "committed";
  return e.verified ? "valid" : "CORRUPT";
}

int ls(const CkptArgs& a) {
  require_dir(a.dir);
  const auto entries = ckpt::list(a.dir, a.verify);
  Table t({{"STEP", true}, {"SIZE", true}, {"STATUS"}, {"PATH"}, {"PROBLEM"}});
  for (const auto& e : entries) {
    t.add_row({std::to_string(e.step), e.committed || e.damaged ? format_bytes(double(e.bytes)) : "-", status_of(e, a.verify), e.path,
               e.problem});
  }
  print(ckpt::to_json(ckpt::ListReport{a.dir, entries}), a.json, t.render());
  // A step directory that does not check (missing or truncated data, bad
  // manifest) is damage, not a leftover: it fails ls --verify.
  bool bad = false;
  for (const auto& e : entries)
    if (a.verify && !e.partial && !e.damaged && !e.verified) bad = true;
  return bad ? 1 : 0;
}

int verify(const CkptArgs& a) {
  require_dir(a.dir);
  ckpt::VerifyReport report{a.dir, {}};
  Table t({{"STEP", true}, {"SIZE", true}, {"STATUS"}, {"PROBLEM"}});
  int checked = 0;
  for (const auto& e : ckpt::list(a.dir, true)) {
    if (a.step && e.step != *a.step) continue;
    if (e.partial && !a.step) continue;  // leftovers of unfinished saves are not checkpoints
    if (e.damaged) continue;             // moved aside by a save: not a checkpoint any more
    ++checked;
    report.checkpoints.push_back(e);
    t.add_row({std::to_string(e.step), e.committed ? format_bytes(double(e.bytes)) : "-", status_of(e, true), e.problem});
  }
  if (a.step && checked == 0) usage_error(fmt::format("{}: no checkpoint for step {}", a.dir, *a.step));
  const bool bad = !report.ok();
  std::string table = t.render() + fmt::format("{}: {} checkpoint(s) checked in {}\n", bad ? "FAILED" : "OK", checked, a.dir);
  print(ckpt::to_json(report), a.json, table);
  return bad ? 1 : 0;
}

int prune(const CkptArgs& a) {
  require_dir(a.dir);
  if (a.keep_last < 1) usage_error("--keep-last must be at least 1");
  const auto r = unwrap(ckpt::prune(a.dir, {.keep_last = a.keep_last, .keep_every = a.keep_every,
                                            .remove_damaged = a.remove_damaged, .dry_run = a.dry_run}));
  const std::string verb = a.dry_run ? "would remove" : "removed";
  std::string text;
  if (r.newest_valid) text += fmt::format("newest valid step {} (kept)\n", *r.newest_valid);
  for (auto s : r.removed) text += fmt::format("{} step {}\n", verb, s);
  for (const auto& d : r.damaged) {
    const bool gone = std::find(r.removed_damaged.begin(), r.removed_damaged.end(), d.path) != r.removed_damaged.end();
    if (gone) text += fmt::format("{} damaged step {} ({})\n", verb, d.step, d.path);
    else text += fmt::format("damaged step {} left in place ({}): {}\n", d.step, d.path, d.problem);
  }
  for (auto s : r.busy) text += fmt::format("step {} is being read: left for the next prune\n", s);
  for (const auto& p : r.removed_partial) text += fmt::format("{} stale partial save of step {} ({}): {}\n", verb, p.step, p.path, p.problem);
  const std::size_t n = r.removed.size() + r.removed_damaged.size();
  if (a.dry_run) text += fmt::format("dry run: {} checkpoint(s) would be removed from {}; nothing was changed\n", n, a.dir);
  else text += fmt::format("OK: {} checkpoint(s) removed from {}\n", n, a.dir);
  if (!r.damaged.empty() && !a.remove_damaged) text += "damaged steps are left for you: --remove-damaged removes them\n";
  print(ckpt::to_json(r, a.dir, a.dry_run), a.json, text);
  // Step directories but none that verifies: the root has nothing to resume from.
  bool any_step = false;
  for (const auto& d : r.damaged) any_step = any_step || !d.damaged;
  return !r.newest_valid && any_step ? 1 : 0;
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

int export_cmd(const CkptArgs& a) {
  require_dir(a.dir);
  if (a.safetensors.empty()) usage_error("--safetensors OUTDIR is required (the only export format)");
  auto max = parse_size(a.max_shard_size);
  if (!max || *max == 0) usage_error(fmt::format("--max-shard-size '{}': expected a positive size such as 5GB", a.max_shard_size));
  const auto r = unwrap(ckpt::export_safetensors(a.dir, a.step, a.safetensors, {.prefix = a.prefix, .max_shard_bytes = *max}));
  for (const auto& s : r.skipped) fmt::print(stderr, "pacer: warning: not exported, damaged: {}\n", s);
  std::string text = fmt::format("exported step {} of {}: {} tensor(s), {}, checked by reading back\n", r.step, a.dir, r.tensors,
                                 format_bytes(double(r.bytes)));
  for (const auto& f : r.files) text += "  " + f + "\n";
  print(ckpt::to_json(r, a.dir, a.safetensors), a.json, text);
  return 0;
}

}  // namespace

Handler register_ckpt(CLI::App& app) {
  auto args = std::make_shared<CkptArgs>();
  auto handler = std::make_shared<Handler>();
  CLI::App* cmd = app.add_subcommand("ckpt", "List, verify, prune, inspect and export checkpoints");
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
  auto* p = add("prune", "Remove checkpoints beyond retention (never the newest valid one; damaged ones are left)", prune);
  p->add_option("--keep-last", args->keep_last, "Keep the newest N valid steps")->required();
  p->add_option("--keep-every", args->keep_every, "Also keep every step that is a multiple of M");
  p->add_flag("--remove-damaged", args->remove_damaged, "Also remove damaged steps and moved-aside .damaged-* directories");
  p->add_flag("--dry-run", args->dry_run, "Print what would be removed; remove nothing");
  add("inspect", "Show a checkpoint's blobs, dtypes, shapes and metadata", inspect)
      ->add_option("--step", args->step, "Step (default: newest committed)");
  auto* ex = add("export", "Write a step's model tensors as safetensors files, checked by reading back", export_cmd);
  ex->add_option("--step", args->step, "Step (default: the newest that reads back whole)");
  ex->add_option("--safetensors", args->safetensors, "Output directory for model.safetensors (or shards and an index)")->required();
  ex->add_option("--prefix", args->prefix, "Export the blobs named PREFIX/..., named by the rest ('' : every numeric blob)");
  ex->add_option("--max-shard-size", args->max_shard_size, "Shard above this size (default 5GB)");
  // The same question as `pacer plan ckpt`, asked from here: the same flags and output.
  auto iargs = std::make_shared<IntervalArgs>();
  CLI::App* iv = cmd->add_subcommand("interval", "Optimal checkpoint interval from the save cost and the MTBF (Young/Daly); "
                                                 "the same as pacer plan ckpt");
  add_interval_options(iv, *iargs);
  iv->add_flag("--json", iargs->json, "Machine-readable output");
  iv->callback([iargs, handler] { *handler = [iargs] { return print_interval(*iargs, "pacer.ckpt.interval/1"); }; });
  return [handler] { return *handler ? (*handler)() : static_cast<int>(ExitCode::kUsage); };
}

}  // namespace pacer::cli
