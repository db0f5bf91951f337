// `pacer shard`: pack, index, inspect and verify data shards (the work is in pacer/data.hpp).
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include "commands.hpp"
#include "output.hpp"
#include "pacer/core/progress.hpp"
#include "pacer/core/table.hpp"
#include "pacer/core/units.hpp"
#include "pacer/data.hpp"
#include "pacer/data/tokenize.hpp"

namespace pacer::cli {
namespace {

namespace fs = std::filesystem;

struct ShardArgs {
  std::string src, out, target_size = "256MB", prefix = "train";
  int jobs = 1;
  std::vector<std::string> shards;
  std::string spec;
  std::string vocab, field = "text";
  // tokenize: INPUT... PREFIX
  std::vector<std::string> paths;
  std::string model, bad_utf8 = "replace", document = "line";
  int threads = 0;
  std::optional<std::int64_t> eod;
  bool no_eod = false;
  bool json = false;
};

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (std::size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

// "[3/17] path" while shards are read one by one.
auto step_line(Progress& progress) {
  return [&progress](const data::ShardStep& s) { progress.update(fmt::format("[{}/{}] {}", s.index + 1, s.count, s.path)); };
}

int pack(const ShardArgs& a) {
  // The library checks these too; here they are named by their flags.
  if (a.jobs < 1) usage_error("--jobs must be at least 1");
  auto target = parse_size(a.target_size);
  if (!target || *target == 0) usage_error(fmt::format("--target-size '{}': expected a positive size such as 256MB", a.target_size));
  if (a.prefix.empty() || a.prefix.find('/') != std::string::npos || a.prefix.find('\0') != std::string::npos || a.prefix[0] == '.')
    usage_error(fmt::format("--prefix '{}': expected a plain file name prefix (no '/', not starting with '.')", a.prefix));
  data::PackOptions o;
  o.src = a.src;
  o.out = a.out;
  o.target_bytes = *target;
  o.prefix = a.prefix;
  o.jobs = a.jobs;
  Progress progress;
  const auto r = unwrap(data::pack_shards(o, [&](const data::PackProgress& p) {
    const double b = static_cast<double>(p.bytes_done);
    progress.update(fmt::format("[{}/{} shards] {} of {}  {}/s", p.shards_done, p.shards_total, format_bytes(b),
                                format_bytes(double(p.bytes_total)), format_bytes(p.elapsed_s > 0.05 ? b / p.elapsed_s : 0)));
  }));
  progress.clear();
  Table t({{"SHARD"}, {"SAMPLES", true}, {"SIZE", true}, {"XXH3"}, {"STATUS"}});
  for (const auto& sh : r.shards)
    t.add_row({sh.path, std::to_string(sh.samples), format_bytes(double(sh.bytes)), fmt::format("{:016x}", sh.xxh3),
               sh.written ? "written" : "up to date"});
  std::string text = t.render();
  for (const auto& f : r.removed) text += fmt::format("removed {} (beyond this plan)\n", f);
  text += fmt::format("OK: {} shard(s), {} samples, {} in {} ({} written, {} up to date)\n", r.shards.size(), r.samples,
                      format_bytes(double(r.bytes)), a.out, r.written(), r.up_to_date());
  print(data::to_json(r), a.json, text);
  return 0;
}

int index(const ShardArgs& a) {
  for (const auto& s : a.shards) {
    std::error_code ec;
    if (!fs::is_regular_file(s, ec)) usage_error(fmt::format("{}: no such shard", s));
  }
  data::IndexReport report;
  Table t({{"SHARD"}, {"SAMPLES", true}, {"SIZE", true}, {"INDEX"}});
  Progress progress;
  for (std::size_t i = 0; i < a.shards.size(); ++i) {
    const auto& s = a.shards[i];
    progress.update(fmt::format("[{}/{}] {}", i + 1, a.shards.size(), s));
    const auto idx = unwrap(data::build_index(s));
    report.samples += idx.samples;
    report.shards.push_back({s, idx.samples, idx.shard_bytes, data::index_path(s)});
    t.add_row({s, std::to_string(idx.samples), format_bytes(double(idx.shard_bytes)), data::index_path(s)});
  }
  progress.clear();
  print(data::to_json(report), a.json, t.render() + fmt::format("OK: {} shard(s) indexed, {} samples\n", a.shards.size(), report.samples));
  return 0;
}

int inspect(const ShardArgs& a) {
  Progress progress;
  const auto r = unwrap(data::inspect_shards(a.spec, step_line(progress)));
  progress.clear();
  Table t({{"SHARD"}, {"SAMPLES", true}, {"SIZE", true}, {"FIELDS"}, {"FIRST KEY", false, 40}, {"LAST KEY", false, 40}});
  for (const auto& s : r.shards) {
    std::vector<std::string> names;
    for (const auto& [k, v] : s.fields) names.push_back(k);
    t.add_row({s.path, std::to_string(s.samples), format_bytes(double(s.bytes)), join(names, ","), s.first_key, s.last_key});
  }
  std::vector<std::string> fields;
  for (const auto& [k, v] : r.fields) fields.push_back(fmt::format("{} ({})", k.empty() ? "(none)" : k, v));
  std::string text = t.render();
  text += fmt::format("{} shard(s), {} samples, {}\n", r.shards.size(), r.samples, format_bytes(double(r.bytes)));
  text += "fields: " + join(fields, ", ") + "\n";
  text += "first keys: " + join(r.first_keys, ", ") + "\n";
  print(data::to_json(r), a.json, text);
  return 0;
}

int verify(const ShardArgs& a) {
  Progress progress;
  const auto r = unwrap(data::verify_shards(a.spec, step_line(progress)));
  progress.clear();
  Table t({{"SHARD"}, {"SAMPLES", true}, {"SIZE", true}, {"STATUS"}});
  for (const auto& s : r.shards) t.add_row({s.path, std::to_string(s.samples), format_bytes(double(s.bytes)), s.ok() ? (s.indexed ? "ok" : "ok (no index)") : "BAD"});
  std::string text = t.render();
  for (const auto& f : r.failures) text += "FAILED: " + f + "\n";
  if (!r.ok()) text += fmt::format("FAILED: {} problem(s) in {} shard(s) of {}\n", r.failures.size(), r.shards.size(), a.spec);
  else text += fmt::format("OK: {} shard(s), {} samples verified in {}\n", r.shards.size(), r.samples, a.spec);
  print(data::to_json(r), a.json, text);
  if (!r.ok() && !a.json)
    for (const auto& f : r.failures) std::fprintf(stderr, "pacer: %s\n", f.c_str());
  return r.ok() ? 0 : 1;
}

int tokenize(const ShardArgs& a) {
  if (a.paths.size() < 2) usage_error("tokenize: expected INPUT... PREFIX (at least one input and the output prefix)");
  if (!a.model.empty() && !a.vocab.empty()) usage_error("--model and --vocab: give one tokenizer");
  if (a.threads < 0) usage_error(fmt::format("--threads {}: expected 0 (every CPU) or more", a.threads));
  if (a.document != "line" && a.document != "file") usage_error(fmt::format("--document '{}': expected line or file", a.document));
  data::TokenizeOptions o;
  o.inputs.assign(a.paths.begin(), a.paths.end() - 1);
  o.prefix = a.paths.back();
  o.field = a.field;
  o.threads = a.threads;
  o.document_per_file = a.document == "file";
  o.append_eod = !a.no_eod;
  o.eod_id = a.eod;
  auto bad = data::parse_bad_utf8(a.bad_utf8);
  if (!bad) usage_error("--bad-utf8: " + bad.error().message);
  o.bad_utf8 = *bad;
  const auto tok = unwrap(a.model.empty() ? data::load_vocabulary(a.vocab) : data::load_sentencepiece(a.model));
  const auto r = unwrap(data::tokenize(o, *tok));

  Table t({{"INPUT"}, {"DOCUMENTS", true}, {"TOKENS", true}, {"SIZE", true}, {"BAD UTF-8", true}, {"XXH3"}});
  for (const auto& in : r.inputs)
    t.add_row({in.path, std::to_string(in.documents), std::to_string(in.tokens), format_bytes(double(in.bytes)),
               in.bad_utf8 ? fmt::format("{} (line {})", in.bad_utf8, in.first_bad_utf8_line) : "0", fmt::format("{:016x}", in.xxh3)});
  std::string text = t.render();
  if (r.bad_utf8_documents)
    text += fmt::format("{} document(s) with invalid UTF-8 {}\n", r.bad_utf8_documents, r.bad_utf8 == data::BadUtf8::kSkip ? "skipped" : "repaired (U+FFFD)");
  if (r.empty) text += fmt::format("{} empty document(s) not written\n", r.empty);
  const std::string who = r.tokenizer.contains("path") ? r.tokenizer["path"].get<std::string>() : std::string("bytes");
  text += fmt::format("OK: {} documents, {} {} tokens ({}, vocabulary {}, {}) in {}.bin/.idx, manifest {}; {}/s on {} thread(s)\n", r.documents,
                      r.tokens, r.dtype, who, r.vocab_size, r.eod ? fmt::format("end of document {}", *r.eod) : std::string("no end-of-document token"),
                      r.prefix, r.manifest, format_bytes(r.seconds > 0 ? double(r.bytes) / r.seconds : 0), r.threads);
  print(data::to_json(r), a.json, text);
  return 0;
}

}  // namespace

Handler register_shard(CLI::App& app) {
  auto args = std::make_shared<ShardArgs>();
  auto handler = std::make_shared<Handler>();
  CLI::App* cmd = app.add_subcommand("shard", "Pack, index, inspect, verify and tokenize data shards");
  cmd->require_subcommand(1);
  cmd->footer(
      "SPEC: a shard, a brace range (train-{000000..000099}.tar), a glob or a manifest.json.\n"
      "Exit codes: 0 ok, 1 a shard failed verification, 2 usage error or malformed input, 3 runtime error. See docs/data.md.");
  auto bind = [&](CLI::App* sub, int (*fn)(const ShardArgs&)) {
    sub->add_flag("--json", args->json, "Machine-readable output");
    sub->callback([args, handler, fn] { *handler = [args, fn] { return fn(*args); }; });
  };

  CLI::App* p = cmd->add_subcommand("pack", "Pack a directory of files (grouped by key) or a JSONL/text file into tar shards");
  p->add_option("src", args->src, "Directory of samples (files sharing a name before the first '.') or a .jsonl/text file")->required();
  p->add_option("out", args->out, "Output directory for the shards, their indexes and manifest.json")->required();
  p->add_option("--target-size", args->target_size, "Approximate shard size, e.g. 256MB (a sample is never split)")->capture_default_str();
  p->add_option("--prefix", args->prefix, "Shard file name prefix: PREFIX-000000.tar")->capture_default_str();
  p->add_option("--jobs", args->jobs, "Shards written in parallel")->capture_default_str();
  bind(p, pack);

  CLI::App* ix = cmd->add_subcommand("index", "(Re)build the .pidx index of each shard");
  ix->add_option("shards", args->shards, "Shard files")->required();
  bind(ix, index);

  CLI::App* in = cmd->add_subcommand("inspect", "Shards, samples, sizes, fields and first keys");
  in->add_option("spec", args->spec, "Shards: a path, brace range, glob or manifest.json")->required();
  bind(in, inspect);

  CLI::App* v = cmd->add_subcommand("verify", "Check checksums (manifest) and that each index matches a fresh scan; exit 1 naming the bad shard");
  v->add_option("spec", args->spec, "A manifest.json, or shards: a path, brace range or glob")->required();
  bind(v, verify);

  CLI::App* tk = cmd->add_subcommand("tokenize", "Text or JSON lines to a Megatron-Core token dataset (PREFIX.bin/.idx) and PREFIX.manifest.json");
  tk->add_option("paths", args->paths, "INPUT... PREFIX: text files (a document per line) or .jsonl files (the --field of each line), then the output prefix")
      ->required();
  auto* model = tk->add_option("--model", args->model, "SentencePiece model file (.model)");
  tk->add_option("--vocab", args->vocab, "Test vocabulary: a token per line, id = line number (without --model or --vocab: bytes)")->excludes(model);
  tk->add_option("--field", args->field, "JSON lines: the field holding the text")->capture_default_str();
  tk->add_option("--document", args->document, "Text files: a document per non-empty 'line', or per 'file'")->capture_default_str();
  tk->add_option("--threads", args->threads, "Encoding threads (0: every CPU this process may use)")->capture_default_str();
  auto* eod = tk->add_option("--eod", args->eod, "End-of-document id appended to every document (default: the model's eos id)");
  tk->add_flag("--no-eod", args->no_eod, "Append no end-of-document token")->excludes(eod);
  tk->add_option("--bad-utf8", args->bad_utf8, "A document that is not valid UTF-8: replace (U+FFFD), skip, or fail")->capture_default_str();
  bind(tk, tokenize);

  return [handler] { return *handler ? (*handler)() : static_cast<int>(ExitCode::kUsage); };
}

}  // namespace pacer::cli
