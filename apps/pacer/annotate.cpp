// `pacer annotate`: serve the labelling web app, add annotators, measure agreement, export an annotation set.
#include <fmt/format.h>

#include <cstdio>

#include "commands.hpp"
#include "output.hpp"
#include "pacer/annotate.hpp"

namespace pacer::cli {
namespace {

struct AnnotateArgs {
  annotate::ServeOptions serve;
  std::string name, out, source, guideline_version;
  bool json = false;
};

int serve_cmd(AnnotateArgs& a) {
  a.serve.on_ready = [&](const std::string& url, const std::vector<std::pair<std::string, std::string>>& tokens,
                         const annotate::SampleSet& samples) {
    for (const auto& m : samples.malformed_at) std::fprintf(stderr, "pacer annotate: warning: skipped %s\n", m.c_str());
    if (samples.malformed > samples.malformed_at.size())
      std::fprintf(stderr, "pacer annotate: warning: ... %llu malformed in all\n", static_cast<unsigned long long>(samples.malformed));
    std::printf("pacer annotate: %zu samples from %s (%llu malformed skipped), store %s\n", samples.samples.size(),
                samples.source.c_str(), static_cast<unsigned long long>(samples.malformed), a.serve.store.c_str());
    for (const auto& [name, token] : tokens) std::printf("  %s: %s#token=%s\n", name.c_str(), url.c_str(), token.c_str());
    std::printf("serving %s (Ctrl-C stops; every label is already in the store)\n", url.c_str());
    std::fflush(stdout);
  };
  unwrap(annotate::serve(a.serve));
  std::fprintf(stderr, "OK: stopped; labels are in %s\n", a.serve.store.c_str());
  return 0;
}

int add_annotator_cmd(const AnnotateArgs& a) {
  auto store = unwrap(annotate::Store::open(a.serve.store, true));
  const std::string token = unwrap(store->add_annotator(a.name));
  const nlohmann::json j = {{"schema", "pacer.annotate.annotator/1"}, {"store", a.serve.store}, {"annotator", a.name}, {"token", token}};
  print(j, a.json, fmt::format("{}\nOK: annotator {} added to {}; open the served URL with #token={}\n", token, a.name, a.serve.store, token));
  return 0;
}

int agreement_cmd(const AnnotateArgs& a) {
  auto store = unwrap(annotate::Store::open(a.serve.store, false));
  const auto r = unwrap(annotate::agreement(*store, a.guideline_version));
  print(annotate::to_json(r), a.json, annotate::to_text(r));
  return r.overall.kappa ? 0 : 1;
}

int export_cmd(const AnnotateArgs& a) {
  auto store = unwrap(annotate::Store::open(a.serve.store, false));
  const auto r = unwrap(annotate::export_set(*store, a.out, a.source));
  print(annotate::to_json(r), a.json,
        fmt::format("OK: annotation set {} in {}: {} labels of {} samples by {} annotators, {} guideline versions\n", r.version, r.out,
                    r.labels, r.samples, r.annotators, r.guidelines));
  return 0;
}

void add_store(CLI::App* c, AnnotateArgs& a) {
  c->add_option("--store", a.serve.store, "The annotation store (SQLite)")->capture_default_str();
}

}  // namespace

Handler register_annotate(CLI::App& app) {
  auto a = std::make_shared<AnnotateArgs>();
  auto which = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand("annotate", "Label samples in a web app, measure agreement, export annotation sets");
  cmd->require_subcommand(1);
  cmd->footer("See docs/annotate.md.");
  auto sub = [&](const char* name, const char* help) {
    CLI::App* s = cmd->add_subcommand(name, help);
    s->parse_complete_callback([which, name] { *which = name; });
    add_store(s, *a);
    return s;
  };
  CLI::App* sv = sub("serve", "Serve the labelling page: one sample at a time, keyboard labels, skip and undo");
  sv->add_option("source", a->serve.source, "JSON-lines file or pacer shard directory")->required();
  sv->add_option("--labels", a->serve.labels, "labels.toml: [[label]] name, key, description")->required();
  sv->add_option("--guidelines", a->serve.guidelines, "The guideline file shown to annotators (its content hash is its version)")->required();
  sv->add_option("--bind", a->serve.bind, "Address to listen on (loopback by default)")->capture_default_str();
  sv->add_option("--port", a->serve.port, "Port (0: any free one)")->capture_default_str()->check(CLI::Range(0, 65535));
  sv->add_option("--add-annotator", a->serve.add_annotators, "Add an annotator first and print their link (repeatable)");
  sv->footer("Exit codes: 0 stopped by SIGINT/SIGTERM, 2 usage or config error, 3 runtime error (cannot bind, store).");
  CLI::App* ad = sub("add-annotator", "Add an annotator to the store and print their token");
  ad->add_option("name", a->name, "Annotator name (A-Z a-z 0-9 _ . -)")->required();
  ad->add_flag("--json", a->json, "JSON output (pacer.annotate.annotator/1)");
  CLI::App* ag = sub("agreement", "Agreement between annotators: Cohen's kappa (two), Fleiss' kappa (more)");
  ag->add_option("--guideline-version", a->guideline_version, "Only labels made under this guideline version");
  ag->add_flag("--json", a->json, "JSON output (pacer.annotate.agreement/1)");
  ag->footer("Exit codes: 0 measured, 1 not measurable (fewer than two annotators, no shared samples), 2 usage error.");
  CLI::App* ex = sub("export", "Write the labels as a versioned annotation set (manifest.json + labels.jsonl)");
  ex->add_option("out", a->out, "Output directory (new, or an earlier annotation set, replaced whole)")->required();
  ex->add_option("--source", a->source, "What the manifest names as the source (default: the served SOURCE's path)");
  ex->add_flag("--json", a->json, "JSON output (pacer.annotate.export/1)");
  return [a, which] {
    if (*which == "serve") return serve_cmd(*a);
    if (*which == "add-annotator") return add_annotator_cmd(*a);
    if (*which == "agreement") return agreement_cmd(*a);
    return export_cmd(*a);
  };
}

}  // namespace pacer::cli
