// classify: fastText models (Debian's libfasttext) over every sample, one
// score column per classifier beside the data; import of scores computed
// elsewhere (pacer.curate's Python callables).
#include <fasttext/fasttext.h>
#include <fmt/format.h>
#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "curate_internal.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/core/time.hpp"
#include "pacer/data.hpp"
#include "pacer/hw/system.hpp"

namespace pacer::curate {

namespace fs = std::filesystem;
using nlohmann::json;

// ---------------------------------------------------------------------------
// Shared by the steps

Manifest derive(const Manifest& parent, const std::string& step, const json& identity, json parameters) {
  Manifest m;
  m.step = step;
  m.parent = parent.version;
  m.version = version_id({{"step", step}, {"parent", parent.version}, {"parameters", identity}});
  m.parameters = std::move(parameters);
  m.inputs = parent.inputs;
  m.columns = parent.columns;
  m.created = utc_iso_now();
  return m;
}

std::vector<std::vector<json>> null_columns(const std::vector<std::uint64_t>& rows) {
  std::vector<std::vector<json>> v(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) v[i].assign(rows[i], json(nullptr));
  return v;
}

void set_column(Manifest& m, Column c) {
  for (auto& old : m.columns)
    if (old.name == c.name) {
      old = std::move(c);
      return;
    }
  m.columns.push_back(std::move(c));
}

int worker_count(int jobs) { return jobs > 0 ? jobs : static_cast<int>(std::max<std::size_t>(1, hw::allowed_cpus().size())); }

void parallel_blocks(std::size_t n, int threads, std::size_t block, const std::function<void(std::size_t, std::size_t)>& fn) {
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (;;) {
      const std::size_t b = next.fetch_add(block);
      if (b >= n) return;
      fn(b, std::min(n, b + block));
    }
  };
  std::vector<std::thread> pool;
  const int t = std::max(1, std::min<int>(threads, static_cast<int>((n + block - 1) / block)));
  for (int i = 1; i < t; ++i) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
}

// ---------------------------------------------------------------------------
// Models

namespace {

// fastText's loader trusts the file: a truncated or altered model makes it
// allocate what its header claims, or read garbage. This walks the layout
// (fasttext.cc saveModel: magic, version, Args, Dictionary, quant flag,
// input matrix, qout flag, output matrix) and checks every size against the
// bytes that are there before libfasttext sees the file.
Status check_model_file(const std::string& path) {
  auto bad = [&](const std::string& why) {
    return Error{ErrorKind::kConfig, fmt::format("{}: not a fastText supervised model ({})", path, why)};
  };
  std::ifstream f(path, std::ios::binary);
  if (!f) return Error{ErrorKind::kUsage, fmt::format("{}: cannot open the model", path)};
  std::error_code ec;
  const std::uint64_t size = fs::file_size(path, ec);
  if (ec) return Error{ErrorKind::kIo, fmt::format("{}: {}", path, ec.message())};
  std::uint64_t pos = 0;
  auto get = [&](void* out, std::size_t n) {
    if (pos + n > size || !f.read(static_cast<char*>(out), static_cast<std::streamsize>(n))) return false;
    pos += n;
    return true;
  };
  std::int32_t magic = 0, version = 0;
  if (!get(&magic, 4) || !get(&version, 4)) return bad("shorter than its header");
  if (magic != 793712314) return bad("wrong magic number");
  if (version < 11 || version > 12) return bad(fmt::format("file format version {}", version));
  std::int32_t args[12];
  double t = 0;
  if (!get(args, sizeof args) || !get(&t, sizeof t)) return bad("truncated in its arguments");
  // Args::save order: dim ws epoch minCount neg wordNgrams loss model bucket minn maxn lrUpdateRate, t.
  const std::int32_t dim = args[0], word_ngrams = args[5], loss = args[6], model = args[7], bucket = args[8], maxn = args[10];
  if (dim <= 0 || dim > 10000) return bad(fmt::format("dimension {}", dim));
  if (model != 3) return bad("an unsupervised (word vector) model cannot classify");
  if (loss < 1 || loss > 4) return bad(fmt::format("loss {} (1-4: hs, ns, softmax, ova)", loss));
  // fastText hashes word n-grams and subwords modulo the bucket count as it loads and predicts, and
  // compares maxn with unsigned lengths (a negative one loops over every length).
  const std::int32_t minn = args[9];
  if (minn < 0 || maxn < 0 || maxn > 1000 || word_ngrams < 1 || word_ngrams > 1000)
    return bad(fmt::format("subwords of {} to {} characters, {}-word n-grams", minn, maxn, word_ngrams));
  if (bucket < 0 || (bucket == 0 && (word_ngrams > 1 || maxn > 0)))
    return bad(fmt::format("{} buckets for {}-word n-grams and subwords up to {} characters", bucket, word_ngrams, maxn));
  std::int32_t nwords_all = 0, nwords = 0, nlabels = 0;
  std::int64_t ntokens = 0, prune = 0;
  if (!get(&nwords_all, 4) || !get(&nwords, 4) || !get(&nlabels, 4) || !get(&ntokens, 8) || !get(&prune, 8)) return bad("truncated dictionary");
  if (nwords_all < 0 || nwords < 0 || nlabels <= 0 || static_cast<std::int64_t>(nwords) + nlabels != nwords_all || nwords_all > 30000000)
    return bad(fmt::format("dictionary of {} entries ({} words, {} labels)", nwords_all, nwords, nlabels));
  // Each entry is at least a NUL, a count and a type: 10 bytes.
  if (static_cast<std::uint64_t>(nwords_all) * 10 > size - pos) return bad("dictionary larger than the file");
  // Byte by byte through the stream buffer: istream::read per byte made this check cost as much as
  // loading a large vocabulary.
  std::streambuf* sb = f.rdbuf();
  for (std::int32_t i = 0; i < nwords_all; ++i) {
    std::uint64_t len = 0;
    for (;;) {
      if (pos >= size) return bad("truncated dictionary entry");
      const int c = sb->sbumpc();
      if (c == std::char_traits<char>::eof()) return bad("truncated dictionary entry");
      ++pos;
      if (c == 0) break;
      if (++len > 1u << 20) return bad("dictionary entry over 1 MiB");
    }
    char rest[9];
    if (pos + 9 > size || sb->sgetn(rest, 9) != 9) return bad("truncated dictionary entry");
    pos += 9;
  }
  // -1: not pruned (quantize -cutoff writes the pairs of a pruned one).
  if (prune < -1 || (prune > 0 && static_cast<std::uint64_t>(prune) > (size - pos) / 8)) return bad("pruned index larger than the file");
  if (prune > 0) {
    f.seekg(static_cast<std::streamoff>(prune * 8), std::ios::cur);
    pos += static_cast<std::uint64_t>(prune) * 8;
  }
  // fastText reads its two flags as a raw bool: a byte other than 0 or 1 is refused here, never loaded as one.
  std::uint8_t quant = 0;
  if (!get(&quant, 1)) return bad("truncated before its input matrix");
  if (quant > 1) return bad(fmt::format("quantization flag {} (0 or 1)", quant));
  if (quant) return bad("a quantized (.ftz) model; classify with the .bin");
  for (const char* which : {"input", "output"}) {
    std::int64_t m = 0, n = 0;
    if (!get(&m, 8) || !get(&n, 8)) return bad(fmt::format("truncated {} matrix", which));
    if (m < 0 || n != dim || static_cast<std::uint64_t>(m) > (size - pos) / (4 * static_cast<std::uint64_t>(n)))
      return bad(fmt::format("{} matrix of {} x {} does not fit the file", which, m, n));
    if (which[0] == 'i' && m != static_cast<std::int64_t>(nwords) + bucket)
      return bad(fmt::format("input matrix of {} rows for {} words and {} buckets", m, nwords, bucket));
    f.seekg(static_cast<std::streamoff>(m * n * 4), std::ios::cur);
    pos += static_cast<std::uint64_t>(m * n * 4);
    if (which[0] == 'i') {
      std::uint8_t qout = 0;
      if (!get(&qout, 1)) return bad("truncated before its output matrix");
      if (qout > 1) return bad(fmt::format("output quantization flag {} (0 or 1)", qout));
      if (qout) return bad("a quantized output matrix");
    } else if (m != nlabels) {
      return bad(fmt::format("output matrix of {} rows for {} labels", m, nlabels));
    }
  }
  if (pos != size) return bad(fmt::format("{} bytes after its output matrix", size - pos));
  return {};
}

}  // namespace

struct Model::Impl {
  fasttext::FastText ft;
};

Model::~Model() = default;

Expected<std::shared_ptr<Model>> Model::load(const std::string& path) {
  if (Status st = check_model_file(path); !st) return st.error();
  std::shared_ptr<Model> m(new Model());
  m->impl_ = std::make_unique<Impl>();
  m->path_ = path;
  try {
    m->impl_->ft.loadModel(path);
  } catch (const std::exception& e) {
    return Error{ErrorKind::kConfig, fmt::format("{}: fastText cannot load it: {}", path, e.what())};
  }
  auto h = data::file_xxh3(path);
  if (!h) return h.error();
  m->xxh3_ = fmt::format("{:016x}", *h);
  return m;
}

namespace {
// An istream over a string without copying it again (istringstream copies).
struct ViewBuf : std::streambuf {
  ViewBuf(char* p, std::size_t n) { setg(p, p, p + n); }
};

// fastText reads one example a line: line breaks inside a text become spaces.
void flatten_lines(std::string& text) {
  for (char& c : text)
    if (c == '\n' || c == '\r' || c == '\v' || c == '\f') c = ' ';
}

// A label as the user names it: fastText's "__label__" prefix dropped.
std::string label_name(std::string label) { return label.rfind("__label__", 0) == 0 ? label.substr(9) : label; }
}  // namespace

std::vector<std::pair<float, std::string>> Model::predict(const std::string& text, int k) const {
  thread_local std::string line;
  line.assign(text);
  flatten_lines(line);
  line += '\n';
  ViewBuf buf(line.data(), line.size());
  std::istream in(&buf);
  std::vector<std::pair<fasttext::real, std::string>> p;
  impl_->ft.predictLine(in, p, k, 0.0);
  std::vector<std::pair<float, std::string>> out;
  out.reserve(p.size());
  for (auto& [prob, label] : p) out.emplace_back(prob, label_name(std::move(label)));
  return out;
}

std::vector<std::string> Model::labels() const {
  auto d = impl_->ft.getDictionary();
  std::vector<std::string> out;
  for (std::int32_t i = 0; i < d->nlabels(); ++i) out.push_back(label_name(d->getLabel(i)));
  return out;
}

std::string fasttext_line(const std::string& text) {
  std::string out = text;
  flatten_lines(out);
  return out;
}

// ---------------------------------------------------------------------------
// classify

Expected<Classifier> parse_classifier(const std::string& spec) {
  const auto eq = spec.find('=');
  if (eq == std::string::npos) return Error{ErrorKind::kUsage, fmt::format("--model '{}': expected NAME=MODEL.bin or NAME=MODEL.bin:LABEL", spec)};
  Classifier c;
  c.name = spec.substr(0, eq);
  c.model = spec.substr(eq + 1);
  if (const auto colon = c.model.rfind(':'); colon != std::string::npos) {
    c.label = c.model.substr(colon + 1);
    c.model.resize(colon);
  }
  if (Status st = check_column_name(c.name); !st) return Error{ErrorKind::kUsage, fmt::format("--model '{}': {}", spec, st.error().message)};
  if (c.model.empty()) return Error{ErrorKind::kUsage, fmt::format("--model '{}': no model file", spec)};
  return c;
}

namespace {

// A classifier's value for one text: P(label), or the top label; null without a prediction.
json score(const Model& m, const Classifier& c, const std::string& text) {
  const auto p = m.predict(text, c.label.empty() ? 1 : -1);
  if (p.empty()) return nullptr;
  if (c.label.empty()) return p[0].second;
  for (const auto& [prob, label] : p)
    if (label == c.label) return static_cast<double>(prob);
  return 0.0;
}

}  // namespace

Expected<ClassifyReport> classify(const Store& store, const Manifest& parent, const ClassifyOptions& o) {
  if (o.classifiers.empty()) return Error{ErrorKind::kUsage, "classify: no --model"};
  std::vector<std::shared_ptr<Model>> models;
  json identity = json::array(), params = json::array();
  for (const auto& c : o.classifiers) {
    for (const auto& other : o.classifiers)
      if (&other != &c && other.name == c.name) return Error{ErrorKind::kUsage, fmt::format("--model: column {} given twice", c.name)};
    auto m = Model::load(c.model);
    if (!m) return m.error();
    if (!c.label.empty()) {
      const auto labels = (*m)->labels();
      if (std::find(labels.begin(), labels.end(), c.label) == labels.end())
        return Error{ErrorKind::kUsage, fmt::format("{}: has no label '{}' (its labels: {})", c.model, c.label, fmt::join(labels, ", "))};
    }
    identity.push_back({{"name", c.name}, {"model_xxh3", (*m)->xxh3()}, {"label", c.label}});
    params.push_back({{"name", c.name}, {"model", fs::absolute(c.model).string()}, {"model_xxh3", (*m)->xxh3()}, {"label", c.label}});
    models.push_back(std::move(*m));
  }
  ClassifyReport r;
  r.jobs = worker_count(o.jobs);
  r.version = derive(parent, "classify", identity, {{"classifiers", params}});
  if (store.has(r.version.version)) {
    auto old = store.read(r.version.version);
    bool intact = bool(old);
    for (std::size_t k = 0; intact && k < o.classifiers.size(); ++k) {
      intact = false;
      for (const auto& c : old->columns)
        if (c.name == o.classifiers[k].name && c.version == old->version) intact = bool(read_column(c));
    }
    if (intact) {
      r.version = std::move(*old);
      r.reused = true;
      r.samples = r.version.counts.value("classified", std::uint64_t{0});
      return r;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::vector<std::vector<json>>> values(models.size(), std::vector<std::vector<json>>(parent.inputs.size()));
  // A filtered parent: only its own samples are scored (the dropped rows stay null).
  auto drops = dropped_rows(store, parent);
  if (!drops) return drops.error();
  std::vector<std::uint64_t> rows;
  Status st = for_each_chunk(parent.inputs, o.strict, r.jobs, r.malformed,
                             [&](std::vector<Sample>& chunk) -> Status {
                               if (!drops->empty())
                                 chunk.erase(std::remove_if(chunk.begin(), chunk.end(),
                                                            [&](const Sample& s) { return drops->count({s.input, s.row}) > 0; }),
                                             chunk.end());
                               for (auto& per : values)
                                 for (const auto& s : chunk) {
                                   auto& col = per[s.input];
                                   const std::size_t at = row_index(parent.inputs[s.input], s.row);
                                   if (col.size() <= at) col.resize(at + 1);
                                 }
                               parallel_blocks(chunk.size(), r.jobs, 64, [&](std::size_t b, std::size_t e) {
                                 for (std::size_t i = b; i < e; ++i) {
                                   const Sample& s = chunk[i];
                                   const std::size_t at = row_index(parent.inputs[s.input], s.row);
                                   for (std::size_t k = 0; k < models.size(); ++k) values[k][s.input][at] = score(*models[k], o.classifiers[k], s.text);
                                 }
                               });
                               r.samples += chunk.size();
                               return {};
                             },
                             &rows);
  if (!st) return st.error();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (std::size_t k = 0; k < models.size(); ++k) {
    for (std::size_t i = 0; i < rows.size(); ++i) values[k][i].resize(rows[i]);
    json source = {{"kind", "fasttext"}, {"model", params[k]["model"]}, {"model_xxh3", models[k]->xxh3()}, {"label", o.classifiers[k].label}};
    auto col = write_column(parent.inputs, o.classifiers[k].name, r.version.version, values[k], source);
    if (!col) return col.error();
    set_column(r.version, std::move(*col));
  }
  r.version.counts = parent.counts;
  r.version.counts["classified"] = r.samples;
  if (Status w = store.write(r.version); !w) return w.error();
  return r;
}

json to_json(const ClassifyReport& r) {
  return {{"schema", "pacer.curate.classify/1"},
          {"version", r.version.version},
          {"parent", r.version.parent},
          {"samples", r.samples},
          {"seconds", r.seconds},
          {"samples_per_s", r.seconds > 0 ? double(r.samples) / r.seconds : 0.0},
          {"jobs", r.jobs},
          {"reused", r.reused},
          {"classifiers", r.version.parameters["classifiers"]},
          {"malformed", to_json(r.malformed)}};
}

Expected<Manifest> import_scores(const Store& store, const Manifest& parent, const std::string& name, const std::string& file,
                                 const json& source) {
  if (Status st = check_column_name(name); !st) return st.error();
  auto text = read_file(file);
  if (!text) return text.error();
  std::vector<std::uint64_t> rows = parent.counts.value("rows", std::vector<std::uint64_t>{});
  if (rows.size() != parent.inputs.size()) return Error{ErrorKind::kConfig, fmt::format("version {}: its manifest has no row counts", parent.version)};
  auto values = null_columns(rows);
  std::istringstream in(*text);
  std::string line;
  std::uint64_t n = 0, scored = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    json j = json::parse(line, nullptr, false);
    auto bad = [&](const std::string& why) { return Error{ErrorKind::kConfig, fmt::format("{}:{}: {}", file, n, why)}; };
    if (j.is_discarded() || !j.is_object() || !j.contains("input") || !j["input"].is_number_unsigned() || !j.contains("row") ||
        !j["row"].is_number_unsigned() || !j.contains("value"))
      return bad("expected {\"input\": I, \"row\": R, \"value\": V}");
    const auto i = j["input"].get<std::uint64_t>();
    const auto row = j["row"].get<std::uint64_t>();
    if (i >= parent.inputs.size()) return bad(fmt::format("input {} (the version has {})", i, parent.inputs.size()));
    const Input& inp = parent.inputs[i];
    if ((inp.kind == "jsonl" && (row == 0 || row > rows[i])) || (inp.kind != "jsonl" && row >= rows[i]))
      return bad(fmt::format("row {} outside {} ({} rows)", row, inp.path, rows[i]));
    const auto& v = j["value"];
    if (!(v.is_null() || v.is_boolean() || v.is_number() || v.is_string())) return bad("a value must be a number, string, boolean or null");
    values[i][row_index(inp, row)] = v;
    ++scored;
  }
  const std::string sum = fmt::format("{:016x}", XXH3_64bits(text->data(), text->size()));
  json src = source;
  src["values_xxh3"] = sum;
  Manifest m = derive(parent, "import", {{"name", name}, {"source", source}, {"values_xxh3", sum}}, {{"name", name}, {"source", src}});
  auto col = write_column(parent.inputs, name, m.version, values, src);
  if (!col) return col.error();
  set_column(m, std::move(*col));
  m.counts = parent.counts;
  m.counts["scored"] = scored;
  if (Status st = store.write(m); !st) return st.error();
  return m;
}

}  // namespace pacer::curate
