// classify: fastText models (Debian's libfasttext) over every sample, one
// score column per classifier beside the data; import of scores computed
// elsewhere (pacer.curate's Python callables).
#include <fasttext/fasttext.h>
#include <fmt/format.h>
#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <istream>
#include <limits>
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

void parallel_blocks(std::size_t n, int threads, std::size_t block, const std::function<void(int, std::size_t, std::size_t)>& fn) {
  std::atomic<std::size_t> next{0};
  auto work = [&](int worker) {
    for (;;) {
      const std::size_t b = next.fetch_add(block);
      if (b >= n) return;
      fn(worker, b, std::min(n, b + block));
    }
  };
  std::vector<std::thread> pool;
  const int t = std::max(1, std::min<int>(threads, static_cast<int>((n + block - 1) / block)));
  for (int i = 1; i < t; ++i) pool.emplace_back(work, i);
  work(0);
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

namespace {

// fastText reads an example as one line of an istream (Dictionary::getLine).
// This presents a text as that line without copying it: each '\n' in it is
// read as a space, then the '\n' that ends the line. fastText's other
// separators (space, \t, \r, \v, \f, \0) it reads alike, so the tokens are
// those of fasttext_line(text) + "\n", the line `fasttext predict` reads.
// One per thread, reused: an istream costs a locale to construct.
class LineStream : private std::streambuf {
 public:
  LineStream() : in_(this) {}
  std::istream& reset(std::string_view text) {
    rest_ = text;
    ended_ = false;
    setg(nullptr, nullptr, nullptr);
    in_.clear();
    return in_;
  }

 private:
  int_type underflow() override {
    if (!rest_.empty()) {
      char* p = const_cast<char*>(rest_.data());  // the get area is only read
      if (*p == '\n') {
        setg(&space_, &space_, &space_ + 1);
        rest_.remove_prefix(1);
        return traits_type::to_int_type(' ');
      }
      const std::size_t n = std::min(rest_.find('\n'), rest_.size());
      setg(p, p, p + n);
      rest_.remove_prefix(n);
      return traits_type::to_int_type(*p);
    }
    if (ended_) return traits_type::eof();
    ended_ = true;
    setg(&eol_, &eol_, &eol_ + 1);
    return traits_type::to_int_type('\n');
  }

  std::string_view rest_;
  bool ended_ = false;
  char space_ = ' ', eol_ = '\n';
  std::istream in_;
};

// A label as the user names it: fastText's "__label__" prefix dropped.
std::string label_name(std::string label) { return label.rfind("__label__", 0) == 0 ? label.substr(9) : label; }

}  // namespace

struct Model::Impl {
  fasttext::FastText ft;
  std::shared_ptr<const fasttext::Dictionary> dict;
  std::vector<std::string> labels;  // by fastText's label id, as label_name gives them

  // What FastText::predictLine computes for `text` as one line, before it
  // turns ids into label strings and log-probabilities into probabilities:
  // (log-probability, label id), best first; none for a text without tokens.
  void predict(std::string_view text, int k, fasttext::Predictions& out) const {
    thread_local LineStream line;
    thread_local std::vector<std::int32_t> words, line_labels;
    out.clear();
    dict->getLine(line.reset(text), words, line_labels);
    ft.predict(k, words, out, 0.0);
  }
};

Model::~Model() = default;

Expected<std::shared_ptr<Model>> Model::load(const std::string& path) {
  if (Status st = check_model_file(path); !st) return st.error();
  std::shared_ptr<Model> m(new Model());
  m->impl_ = std::make_unique<Impl>();
  m->path_ = path;
  try {
    m->impl_->ft.loadModel(path);
    m->impl_->dict = m->impl_->ft.getDictionary();
    for (std::int32_t i = 0; i < m->impl_->dict->nlabels(); ++i) m->impl_->labels.push_back(label_name(m->impl_->dict->getLabel(i)));
  } catch (const std::exception& e) {
    return Error{ErrorKind::kConfig, fmt::format("{}: fastText cannot load it: {}", path, e.what())};
  }
  auto h = data::file_xxh3(path);
  if (!h) return h.error();
  m->xxh3_ = fmt::format("{:016x}", *h);
  return m;
}

namespace {
// fastText reads one example a line: line breaks inside a text become spaces.
void flatten_lines(std::string& text) {
  for (char& c : text)
    if (c == '\n' || c == '\r' || c == '\v' || c == '\f') c = ' ';
}
}  // namespace

std::vector<std::pair<float, std::string>> Model::predict(const std::string& text, int k) const {
  fasttext::Predictions p;
  impl_->predict(text, k, p);
  std::vector<std::pair<float, std::string>> out;
  out.reserve(p.size());
  for (const auto& [logp, id] : p) out.emplace_back(std::exp(logp), impl_->labels[static_cast<std::size_t>(id)]);
  return out;
}

std::vector<std::string> Model::labels() const { return impl_->labels; }

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

// One classifier's values while scoring, per input and row: P(label) as
// fastText's float (NaN: null, as nlohmann writes a NaN), or the top label's
// id (-1: null). Rendered once at the end as the reference score() would
// write them: json(double(P)) or json(label name), null without a prediction.
struct Scores {
  const Model::Impl* model = nullptr;
  int k = 1;                // fastText's k: 1 for the top label, -1 (all) for P(label)
  std::int32_t label = -1;  // the label whose probability is the value; -1: the top label
  std::vector<std::vector<float>> prob;
  std::vector<std::vector<std::int32_t>> top;

  void grow(std::size_t input, std::size_t rows) {
    if (label >= 0 && prob[input].size() < rows) prob[input].resize(rows, std::numeric_limits<float>::quiet_NaN());
    if (label < 0 && top[input].size() < rows) top[input].resize(rows, -1);
  }
  void score(std::string_view text, std::size_t input, std::size_t at, fasttext::Predictions& p) {
    model->predict(text, k, p);
    if (p.empty()) return;
    if (label < 0) {
      top[input][at] = p[0].second;
      return;
    }
    prob[input][at] = 0.0f;
    for (const auto& [logp, id] : p)
      if (id == label) {
        prob[input][at] = std::exp(logp);  // as predictLine: exp of fastText's float
        break;
      }
  }
  std::string render(std::size_t input, std::size_t rows) const {
    std::string text;
    if (label < 0) {
      std::vector<std::string> names;
      for (const auto& l : model->labels) names.push_back(json(l).dump(-1, ' ', false, json::error_handler_t::replace));
      const auto& v = top[input];
      for (std::size_t r = 0; r < rows; ++r) {
        text += r < v.size() && v[r] >= 0 ? names[static_cast<std::size_t>(v[r])] : "null";
        text += '\n';
      }
    } else {
      const auto& v = prob[input];
      for (std::size_t r = 0; r < rows; ++r) {
        text += r < v.size() ? json(static_cast<double>(v[r])).dump() : "null";
        text += '\n';
      }
    }
    return text;
  }
};

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
  std::vector<Scores> scores(models.size());
  for (std::size_t k = 0; k < models.size(); ++k) {
    Scores& s = scores[k];
    s.model = models[k]->impl_.get();
    if (!o.classifiers[k].label.empty()) {
      const auto& names = s.model->labels;
      s.label = static_cast<std::int32_t>(std::find(names.begin(), names.end(), o.classifiers[k].label) - names.begin());
      s.k = -1;
    }
    s.prob.resize(parent.inputs.size());
    s.top.resize(parent.inputs.size());
  }
  // A filtered parent: only its own samples are scored (the dropped rows stay null).
  auto drops = dropped_rows(store, parent);
  if (!drops) return drops.error();
  std::vector<std::uint64_t> rows;
  // Each worker parses and scores its blocks of a chunk; the malformed are
  // reported afterwards, in row order, by this thread.
  enum : char { kScored, kMalformed, kDropped };
  std::vector<SampleParser> parsers(static_cast<std::size_t>(r.jobs));
  std::vector<fasttext::Predictions> preds(static_cast<std::size_t>(r.jobs));
  std::vector<char> state;
  std::vector<std::string> why;
  Status st = for_each_raw_chunk(
      parent.inputs,
      [&](RawChunk& c) -> Status {
        const Input& in = parent.inputs[c.input];
        for (auto& s : scores) s.grow(c.input, row_index(in, c.samples.back().row) + 1);
        state.assign(c.samples.size(), kScored);
        why.resize(c.samples.size());
        parallel_blocks(c.samples.size(), r.jobs, 16, [&](int w, std::size_t b, std::size_t e) {
          for (std::size_t i = b; i < e; ++i) {
            const RawSample& s = c.samples[i];
            std::string_view text;
            if (!parsers[static_cast<std::size_t>(w)].parse(c, s, text, nullptr, why[i])) {
              state[i] = kMalformed;
              continue;
            }
            if (!drops->empty() && drops->count({c.input, s.row})) {
              state[i] = kDropped;
              continue;
            }
            for (auto& sc : scores) sc.score(text, c.input, row_index(in, s.row), preds[static_cast<std::size_t>(w)]);
          }
        });
        for (std::size_t i = 0; i < c.samples.size(); ++i) {
          if (state[i] == kScored) ++r.samples;
          else if (state[i] == kMalformed)
            if (Status bad = note_malformed(c, c.samples[i], why[i], o.strict, r.malformed); !bad) return bad;
        }
        return {};
      },
      &rows, r.jobs);
  if (!st) return st.error();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (std::size_t k = 0; k < models.size(); ++k) {
    std::vector<std::string> texts;
    for (std::size_t i = 0; i < rows.size(); ++i) texts.push_back(scores[k].render(i, rows[i]));
    json source = {{"kind", "fasttext"}, {"model", params[k]["model"]}, {"model_xxh3", models[k]->xxh3()}, {"label", o.classifiers[k].label}};
    auto col = write_column_text(parent.inputs, o.classifiers[k].name, r.version.version, texts, source);
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
