// The annotation set pacer curate trains on: a directory written beside OUT and swapped in whole.
#include <fcntl.h>
#include <fmt/format.h>
#include <stdio.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <set>

#include "pacer/annotate.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/core/posix_io.hpp"

namespace pacer::annotate {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kSchema = "pacer.annotations/1";

// OUT may be replaced only when it is an earlier annotation set (never some other directory).
Status check_replaceable(const std::string& out) {
  std::error_code ec;
  if (!fs::exists(out, ec)) return {};
  const std::string manifest = (fs::path(out) / "manifest.json").string();
  auto text = read_file(manifest);
  json j = text ? json::parse(*text, nullptr, false) : json();
  if (!fs::is_directory(out, ec) || !j.is_object() || j.value("schema", "") != kSchema)
    return Error{ErrorKind::kUsage, fmt::format("{}: exists and is not an annotation set ({}); give a new path", out, kSchema)};
  return {};
}

}  // namespace

Expected<ExportReport> export_set(Store& store, const std::string& out, const std::string& source) {
  if (Status st = check_replaceable(out); !st) return st.error();
  auto rows = store.all_labels();
  if (!rows) return rows.error();
  auto labels = store.labels();
  if (!labels) return labels.error();
  auto guidelines = store.guidelines();
  if (!guidelines) return guidelines.error();
  ExportReport r;
  r.out = out;
  r.source = source.empty() ? store.source() : source;
  std::string lines;
  std::set<std::string> samples, annotators, used;
  for (const auto& l : *rows) {
    lines += json{{"id", l.sample}, {"label", l.label}, {"annotator", l.annotator}, {"time", l.time},
                  {"guideline_version", l.guideline_version}, {"text", l.text}}
                 .dump(-1, ' ', false, json::error_handler_t::replace);
    lines += '\n';
    samples.insert(l.sample);
    annotators.insert(l.annotator);
    used.insert(l.guideline_version);
  }
  r.labels = static_cast<std::int64_t>(rows->size());
  r.samples = static_cast<std::int64_t>(samples.size());
  r.annotators = static_cast<std::int64_t>(annotators.size());
  std::string canonical = fmt::format("{}\nsource={}\nlabels=", kSchema, r.source);
  for (const auto& l : *labels) canonical += l + '\n';
  canonical += lines;
  r.version = version_id(canonical);

  json manifest = {{"schema", kSchema}, {"version", r.version}, {"source", r.source}, {"labels", *labels},
                   {"guidelines", json::array()}, {"annotators", r.annotators}, {"samples", r.samples},
                   {"label_lines", r.labels}};
  const fs::path final_dir(out);
  const fs::path tmp = final_dir.parent_path() / fmt::format(".{}.tmp-{}", final_dir.filename().string(), ::getpid());
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp / "guidelines", ec);
  if (ec) return Error{ErrorKind::kIo, fmt::format("{}: cannot create: {}", tmp.string(), ec.message())};
  auto fail = [&](Error e) -> Expected<ExportReport> {
    std::error_code ignore;
    fs::remove_all(tmp, ignore);
    return e;
  };
  for (const auto& g : *guidelines) {
    if (!used.count(g.version)) continue;
    const std::string file = "guidelines/" + g.version + ".md";
    manifest["guidelines"].push_back({{"version", g.version}, {"path", g.path}, {"xxh3", g.xxh3}, {"file", file}});
    if (Status st = write_file_atomic((tmp / file).string(), g.text); !st) return fail(st.error());
    ++r.guidelines;
  }
  if (Status st = write_file_atomic((tmp / "labels.jsonl").string(), lines); !st) return fail(st.error());
  if (Status st = write_file_atomic((tmp / "manifest.json").string(),
                                    manifest.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
      !st)
    return fail(st.error());
  if (Status st = fsync_dir((tmp / "guidelines").string()); !st) return fail(st.error());
  if (Status st = fsync_dir(tmp.string()); !st) return fail(st.error());
  // The old set and the new one trade places in one step, so a reader of OUT
  // sees one whole set or the other.
  if (fs::exists(final_dir, ec)) {
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0)
      return fail(io_error("cannot replace the annotation set", out, errno));
  } else if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
    return fail(io_error("cannot write the annotation set", out, errno));
  }
  fs::remove_all(tmp, ec);
  const std::string parent = final_dir.parent_path().string();
  if (Status st = fsync_dir(parent); !st) return st.error();
  return r;
}

json to_json(const ExportReport& r) {
  return {{"schema", "pacer.annotate.export/1"}, {"out", r.out}, {"version", r.version}, {"source", r.source},
          {"samples", r.samples}, {"label_lines", r.labels}, {"annotators", r.annotators}, {"guidelines", r.guidelines}};
}

}  // namespace pacer::annotate
