// `pacer data`: register, trace, compare and export data-set versions (the work is in pacer/curate.hpp).
#include <fmt/format.h>

#include <memory>

#include "commands.hpp"
#include "output.hpp"
#include "pacer/core/table.hpp"
#include "pacer/core/units.hpp"
#include "pacer/curate.hpp"

namespace pacer::cli {
namespace {

using nlohmann::json;

struct DataArgs {
  std::string store, version, a, b, out;
  std::vector<std::string> paths;
  std::size_t limit = 20;
  bool json = false;
};

// What a step did, in one cell.
std::string summary(const curate::Manifest& m) {
  const auto& p = m.parameters;
  if (m.step == "raw") return fmt::format("{} input(s)", m.inputs.size());
  if (m.step == "classify") {
    std::vector<std::string> parts;
    for (const auto& c : p["classifiers"]) parts.push_back(fmt::format("{}={}", c["name"].get<std::string>(), c["model_xxh3"].get<std::string>()));
    return fmt::format("{}", fmt::join(parts, " "));
  }
  if (m.step == "filter") return p["expression"].get<std::string>();
  if (m.step == "dedup") return fmt::format("jaccard>={} shingle={} {}x{}", p["threshold"].dump(), p["shingle"].dump(), p["bands"].dump(), p["rows"].dump());
  if (m.step == "decontaminate") return fmt::format("{}-grams, {} benchmark file(s)", p["n"].dump(), p["benchmarks"].size());
  if (m.step == "import") return fmt::format("{} from {}", p["name"].get<std::string>(), p["source"].value("callable", std::string("?")));
  if (m.step == "model") return fmt::format("model {} from annotations {}", p.value("model_xxh3", ""), p["annotations"].value("version", ""));
  return p.dump();
}

std::string samples_of(const curate::Manifest& m) {
  if (m.counts.contains("samples")) return m.counts["samples"].dump();
  return "-";
}

int add(const DataArgs& a) {
  const auto store = unwrap(curate::Store::open(a.store));
  const auto m = unwrap(store.add_raw(a.paths));
  Table t({{"INPUT"}, {"KIND"}, {"SIZE", true}, {"XXH3"}});
  for (const auto& in : m.inputs) t.add_row({in.path, in.kind, format_bytes(double(in.bytes)), in.xxh3});
  std::string text = t.render();
  const auto malformed = m.counts.value("malformed", std::uint64_t{0});
  if (malformed) text += fmt::format("{} malformed line(s) (pacer curate reports them with file:line)\n", malformed);
  text += fmt::format("OK: version {}: {} samples in {} input(s), store {}\n", m.version, samples_of(m), m.inputs.size(), store.dir());
  print(curate::to_json(m), a.json, text);
  return 0;
}

int log(const DataArgs& a) {
  const auto store = unwrap(curate::Store::open(a.store));
  const auto chain = unwrap(curate::lineage(store, a.version));
  Table t({{"VERSION"}, {"STEP"}, {"SAMPLES", true}, {"WHAT", false, 80}, {"CREATED"}});
  json versions = json::array();
  for (const auto& m : chain) {
    t.add_row({m.version, m.step, samples_of(m), summary(m), m.created});
    versions.push_back(curate::to_json(m));
  }
  std::string text = t.render();
  const auto& root = chain.back();
  for (const auto& in : root.inputs) text += fmt::format("raw input: {} ({}, {}, xxh3 {})\n", in.path, in.kind, format_bytes(double(in.bytes)), in.xxh3);
  if (root.step == "model") {
    const auto& ann = root.parameters["annotations"];
    text += fmt::format("annotation set: {} ({}), source {}\n", ann.value("dir", ""), ann.value("version", ""), ann.value("source", ""));
  }
  text += fmt::format("OK: {} version(s) from {} back to {}\n", chain.size(), a.version, root.version);
  print({{"schema", "pacer.data.log/1"}, {"version", a.version}, {"lineage", versions}}, a.json, text);
  return 0;
}

int diff(const DataArgs& a) {
  const auto store = unwrap(curate::Store::open(a.store));
  const auto d = unwrap(curate::diff(store, a.a, a.b));
  Table t({{"RULE", false, 70}, {"REMOVED", true}});
  for (const auto& [rule, n] : d.removed_by_rule) t.add_row({rule, std::to_string(n)});
  std::string text = t.render();
  auto list = [&](const char* what, const std::vector<std::string>& ids) {
    if (ids.empty()) return;
    std::vector<std::string> head(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(std::min(a.limit, ids.size())));
    text += fmt::format("{}: {}{}\n", what, fmt::join(head, ", "), ids.size() > head.size() ? ", ..." : "");
  };
  list("added", d.added);
  list("removed", d.removed);
  text += fmt::format("OK: {} ({} samples) -> {} ({} samples): {} added, {} removed\n", d.a, d.a_samples, d.b, d.b_samples, d.added.size(), d.removed.size());
  print(curate::to_json(d, a.limit), a.json, text);
  return 0;
}

int export_version(const DataArgs& a) {
  const auto store = unwrap(curate::Store::open(a.store));
  const auto m = unwrap(store.read(a.version));
  const auto n = unwrap(curate::export_samples(store, m, a.out));
  print({{"schema", "pacer.data.export/1"}, {"version", m.version}, {"out", a.out}, {"samples", n}}, a.json,
        fmt::format("OK: {} samples of version {} written to {}\n", n, m.version, a.out));
  return 0;
}

}  // namespace

Handler register_data(CLI::App& app) {
  auto args = std::make_shared<DataArgs>();
  auto handler = std::make_shared<Handler>();
  CLI::App* cmd = app.add_subcommand("data", "Data-set versions: register raw files, show lineage, compare, export");
  cmd->require_subcommand(1);
  cmd->footer("Versions live in the store directory (--store, $PACER_DATA_STORE, else ./pacer-data). Exit codes: 0 ok, 2 usage error, 3 runtime error. See docs/curate.md.");
  auto bind = [&](CLI::App* sub, int (*fn)(const DataArgs&)) {
    sub->add_flag("--json", args->json, "Machine-readable output");
    sub->add_option("--store", args->store, "The version store directory");
    sub->callback([args, handler, fn] { *handler = [args, fn] { return fn(*args); }; });
  };
  CLI::App* ad = cmd->add_subcommand("add", "Register JSON-lines files or shard sets as a raw version");
  ad->add_option("paths", args->paths, "Inputs")->required();
  bind(ad, add);
  CLI::App* lg = cmd->add_subcommand("log", "A version's lineage back to its raw files");
  lg->add_option("version", args->version, "A version id")->required();
  bind(lg, log);
  CLI::App* df = cmd->add_subcommand("diff", "Samples added and removed from A to B, removals per filter clause");
  df->add_option("a", args->a, "The older version")->required();
  df->add_option("b", args->b, "The newer version")->required();
  df->add_option("--limit", args->limit, "Sample ids listed per side")->capture_default_str();
  bind(df, diff);
  CLI::App* ex = cmd->add_subcommand("export", "Write a version's samples as JSON lines (the training mix)");
  ex->add_option("version", args->version, "A version id")->required();
  ex->add_option("out", args->out, "Output .jsonl")->required();
  bind(ex, export_version);
  return [handler] { return *handler ? (*handler)() : static_cast<int>(ExitCode::kUsage); };
}

}  // namespace pacer::cli
