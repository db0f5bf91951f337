// Python face of the data loader: datasets and loaders, samples as bytes; no logic beyond translation.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <fmt/format.h>

#include <optional>

#include "bindings.hpp"
#include "pacer/data.hpp"
#include "pacer/data/tokenize.hpp"

namespace py = pybind11;
using namespace pybind11::literals;

namespace pacer::python {
namespace {

using data::Dataset;
using data::TokenDataset;
using data::write_token_dataset;

// Keys and extensions come from file names, which need not be UTF-8.
py::str text(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "surrogateescape");
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

py::dict sample_dict(const Dataset::Sample& s) {
  py::dict d;
  d["__key__"] = text(s.key);
  for (const auto& [ext, bytes] : s.fields) d[text(ext)] = py::bytes(bytes);
  return d;
}

// Keeps a batch's buffer alive for Python: memoryviews and arrays over it
// hold a reference, and the buffer returns to the loader's pool when the last
// one is gone.
struct BufferOwner {
  std::shared_ptr<data::BatchBuffer> buffer;
};

// {"__key__": [key, ...], ext: [value, ...]}; a sample without some field
// has None in that field's list, so every list lines up with the keys. Values
// are read-only memoryviews into the batch's buffer, or bytes with `copy`.
py::dict sample_batch(data::Batch& b, bool copy) {
  py::dict d;
  const std::size_t n = b.keys.size();
  py::list keys(n);
  for (std::size_t i = 0; i < n; ++i) keys[i] = text(b.keys[i]);
  d["__key__"] = keys;
  std::vector<py::list> cols;
  for (const auto& e : b.exts) {
    py::list col(n);
    for (std::size_t i = 0; i < n; ++i) col[i] = py::none();
    d[text(e)] = col;
    cols.push_back(col);
  }
  py::object base;
  if (!copy && !b.fields.empty()) {
    py::object owner = py::cast(BufferOwner{b.buffer});
    base = py::reinterpret_steal<py::object>(PyMemoryView_FromObject(owner.ptr()));
    if (!base) throw py::error_already_set();
  }
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t k = b.first_field[i]; k < b.first_field[i + 1]; ++k) {
      const data::BatchField& f = b.fields[k];
      PyObject* v = copy ? PyBytes_FromStringAndSize(reinterpret_cast<const char*>(b.buffer->data()) + f.offset, static_cast<Py_ssize_t>(f.size))
                         : PySequence_GetSlice(base.ptr(), static_cast<Py_ssize_t>(f.offset), static_cast<Py_ssize_t>(f.offset + f.size));
      if (!v) throw py::error_already_set();
      cols[f.ext][i] = py::reinterpret_steal<py::object>(v);
    }
  return d;
}

template <class T>
py::array_t<T> vector_array(std::vector<T>&& v) {
  auto* owned = new std::vector<T>(std::move(v));
  py::capsule free_it(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>({static_cast<py::ssize_t>(owned->size())}, owned->data(), free_it);
}

// {"tokens": int64 [rows, cols], "position_ids": int32 [rows, cols] (both
// views of the batch's buffer), "cu_seqlens", "documents", "lengths"}.
py::dict token_batch(data::Batch& b) {
  py::object owner = py::cast(BufferOwner{b.buffer});
  const auto rows = static_cast<py::ssize_t>(b.rows), cols = static_cast<py::ssize_t>(b.cols);
  py::dict d;
  d["tokens"] = py::array_t<std::int64_t>({rows, cols}, b.tokens(), owner);
  d["position_ids"] = py::array_t<std::int32_t>({rows, cols}, b.position_ids(), owner);
  if (b.has_labels) {
    d["labels"] = py::array_t<std::int64_t>({rows, cols}, b.labels(), owner);
    d["loss_mask"] = py::array_t<std::uint8_t>({rows, cols}, b.loss_mask(), owner);
  }
  d["cu_seqlens"] = vector_array(std::move(b.cu_seqlens));
  d["documents"] = vector_array(std::move(b.documents));
  d["lengths"] = vector_array(std::move(b.lengths));
  return d;
}

// A Python callable as a tokenizer: encode_batch(list[str]) returns
// (ids: bytes of int64, lengths: bytes of uint64), one length per document.
// Each encoding thread calls it with the GIL held; the callable hands the
// batch to a worker process and waits without it (pacer.data.tokenize).
class PyTokenizer final : public data::Tokenizer {
 public:
  PyTokenizer(py::object encode_batch, std::uint64_t vocab_size, std::optional<std::int64_t> eos, nlohmann::json identity)
      : fn_(std::move(encode_batch)), vocab_size_(vocab_size), eos_(eos), identity_(std::move(identity)) {}
  ~PyTokenizer() override {
    py::gil_scoped_acquire gil;
    fn_ = py::object();
  }
  Status encode(const std::vector<std::string_view>& docs, std::vector<std::int64_t>& ids,
                std::vector<std::uint64_t>& lengths) const override {
    py::gil_scoped_acquire gil;
    try {
      py::list batch(docs.size());
      for (std::size_t i = 0; i < docs.size(); ++i) batch[i] = py::str(docs[i].data(), docs[i].size());  // valid UTF-8 by now
      py::tuple r = fn_(batch);
      const std::string id_bytes = r[0].cast<std::string>(), len_bytes = r[1].cast<std::string>();
      if (id_bytes.size() % 8 || len_bytes.size() % 8)
        return Error{ErrorKind::kRuntime, "the tokenizer's batch result is not whole int64 ids and uint64 lengths"};
      const std::size_t n = ids.size(), m = lengths.size();
      ids.resize(n + id_bytes.size() / 8);
      lengths.resize(m + len_bytes.size() / 8);
      if (!id_bytes.empty()) std::memcpy(ids.data() + n, id_bytes.data(), id_bytes.size());
      if (!len_bytes.empty()) std::memcpy(lengths.data() + m, len_bytes.data(), len_bytes.size());
    } catch (py::error_already_set& e) {
      return Error{ErrorKind::kRuntime, fmt::format("the tokenizer raised {}", e.what())};
    } catch (const py::cast_error& e) {
      return Error{ErrorKind::kRuntime, fmt::format("the tokenizer's batch result: {}", e.what())};
    }
    return {};
  }
  std::uint64_t vocab_size() const override { return vocab_size_; }
  std::optional<std::int64_t> eos_id() const override { return eos_; }
  nlohmann::json identity() const override { return identity_; }

 private:
  py::object fn_;
  std::uint64_t vocab_size_;
  std::optional<std::int64_t> eos_;
  nlohmann::json identity_;
};

// pacer.data.tokenize's C++ half: `model` (a SentencePiece file), `vocab`
// (the test vocabulary) or `encode_batch` (a PyTokenizer). Returns the
// --json record as text.
std::string tokenize(const std::vector<std::string>& inputs, const std::string& prefix, const py::dict& opt) {
  data::TokenizeOptions o;
  o.inputs = inputs;
  o.prefix = prefix;
  o.field = opt["field"].cast<std::string>();
  o.document_per_file = opt["document_per_file"].cast<bool>();
  o.threads = opt["threads"].cast<int>();
  o.chunk_bytes = opt["chunk_bytes"].cast<std::size_t>();
  o.append_eod = opt["append_eod"].cast<bool>();
  if (!opt["eod_id"].is_none()) o.eod_id = opt["eod_id"].cast<std::int64_t>();
  o.bad_utf8 = unwrap(data::parse_bad_utf8(opt["bad_utf8"].cast<std::string>()));
  std::unique_ptr<data::Tokenizer> tok;
  if (!opt["model"].is_none()) {
    tok = unwrap(data::load_sentencepiece(opt["model"].cast<std::string>()));
  } else if (!opt["vocab"].is_none()) {
    tok = unwrap(data::load_vocabulary(opt["vocab"].cast<std::string>()));
  } else {
    std::optional<std::int64_t> eos;
    if (!opt["eos_id"].is_none()) eos = opt["eos_id"].cast<std::int64_t>();
    auto id = unwrap(data::external_identity("callable", opt["name"].cast<std::string>(), opt["model_file"].cast<std::string>()));
    tok = std::make_unique<PyTokenizer>(opt["encode_batch"], opt["vocab_size"].cast<std::uint64_t>(), eos, std::move(id));
  }
  return data::to_json(call_nogil([&] { return data::tokenize(o, *tok); })).dump();
}

std::shared_ptr<Dataset> open_spec(const std::string& spec) {
  return call_nogil([&] { return Dataset::open(spec); });  // may scan shards that have no index yet
}

std::shared_ptr<Dataset> open_list(const std::vector<std::string>& shards) {
  return call_nogil([&] { return Dataset::open(shards); });
}

data::LoaderOptions loader_options(const py::dict& kw) {
  data::LoaderOptions o;
  for (auto [k, v] : kw) {
    const std::string key = py::cast<std::string>(k);
    // pybind11's own message ("Unable to cast Python instance") names neither the option nor the value.
    try {
    if (key == "batch_size") o.batch_size = py::cast<std::uint64_t>(v);
    else if (key == "seed") o.seed = py::cast<std::uint64_t>(v);
    else if (key == "rank") o.rank = py::cast<int>(v);
    else if (key == "world_size") o.world_size = py::cast<int>(v);
    else if (key == "shuffle") o.shuffle = py::cast<bool>(v);
    else if (key == "drop_last") o.drop_last = py::cast<bool>(v);
    else if (key == "threads") o.threads = py::cast<int>(v);
    else if (key == "prefetch") o.prefetch_batches = py::cast<std::uint64_t>(v);
    else if (key == "max_bytes") o.max_bytes = py::cast<std::uint64_t>(v);
    else if (key == "skip_bad") o.skip_bad = py::cast<bool>(v);
    else if (key == "pin_memory") o.pin_memory = py::cast<bool>(v);
    else if (key == "seq_len") o.seq_len = py::cast<std::uint64_t>(v);
    else if (key == "pack") o.pack = py::cast<bool>(v);
    else if (key == "pack_window") o.pack_window = py::cast<std::uint64_t>(v);
    else if (key == "bucket_window") o.bucket_window = py::cast<std::uint64_t>(v);
    else if (key == "pad_id") o.pad_id = py::cast<std::int64_t>(v);
    else throw Exception(Error{ErrorKind::kUsage, fmt::format("unknown loader option '{}'", key)});
    } catch (const py::cast_error&) {
      throw Exception(Error{ErrorKind::kUsage, fmt::format("loader option {}={}: {}", key, py::str(py::repr(v)).cast<std::string>(),
                                                           key == "shuffle" || key == "drop_last" || key == "skip_bad" || key == "pin_memory" || key == "pack"
                                                               ? "not a bool"
                                                               : key == "pad_id" ? "not a 64-bit integer" : "not a non-negative integer in range")});
    }
  }
  return o;
}

class PyLoader {
 public:
  PyLoader(std::shared_ptr<Dataset> ds, const py::dict& options, bool copy) : copy_(copy) {
    impl_ = unwrap(data::Loader::open(std::move(ds), loader_options(options)));
  }
  PyLoader(std::shared_ptr<TokenDataset> ds, const py::dict& options) : tokens_(true) {
    impl_ = unwrap(data::Loader::open(std::move(ds), loader_options(options)));
  }
  PyLoader(const data::Blend& blend, const py::dict& options, bool copy) : copy_(copy), tokens_(!blend.token_datasets.empty()), blend_(true) {
    const auto o = loader_options(options);
    impl_ = call_nogil([&] { return data::Loader::open(blend, o); });  // may plan every dataset's first packed epoch
  }

  // Reader threads may be inside a read: join them without holding the GIL.
  ~PyLoader() {
    call_nogil([&] { impl_.reset(); });
  }
  PyLoader(const PyLoader&) = delete;
  PyLoader& operator=(const PyLoader&) = delete;

  // (batch dict, pinned) or None at the end of the epoch.
  py::object next() {
    std::optional<data::Batch> batch = call_nogil([&] { return impl_->next(); });
    if (!batch) return py::none();
    const bool pinned = batch->buffer && batch->buffer->pinned();
    // By the loader's kind, not the batch's rows: an empty last batch of a token loader still has "tokens".
    // Blends say which of their datasets each sample or row came from.
    py::object from;
    if (blend_) from = vector_array(std::vector<std::int32_t>(batch->datasets));
    py::dict d = tokens_ ? token_batch(*batch) : sample_batch(*batch, copy_);
    if (blend_) d[tokens_ ? "datasets" : "__dataset__"] = from;
    return py::make_tuple(d, pinned);
  }

  std::string state() const { return impl_->state().dump(); }

  void load_state(const std::string& s) {
    const auto j = nlohmann::json::parse(s, nullptr, false);
    if (j.is_discarded() || !j.is_object()) throw Exception(Error{ErrorKind::kUsage, "loader state is not a JSON object"});
    call_nogil([&] { return impl_->load_state(j); });
  }

  void set_epoch(std::uint64_t epoch) {
    call_nogil([&] { impl_->set_epoch(epoch); });
  }

  py::dict stats() const {
    const auto s = impl_->stats();
    return py::dict("wait_s"_a = s.wait_s, "last_wait_s"_a = s.last_wait_s, "batches"_a = s.batches,
                    "samples"_a = s.samples, "bytes"_a = s.bytes, "skipped"_a = s.skipped, "queue_depth"_a = s.queue_depth,
                    "consumer_reads"_a = s.consumer_reads,
                    "elapsed_s"_a = s.elapsed_s, "tokens"_a = s.tokens, "padding"_a = s.padding,
                    "truncated"_a = s.truncated, "padding_fraction"_a = s.padding_fraction());
  }

  std::uint64_t batches_per_epoch() const {
    return call_nogil([&] { return impl_->batches_per_epoch(); });  // a packed epoch's plan may be computed here
  }

 private:
  std::unique_ptr<data::Loader> impl_;
  bool copy_ = false;
  bool tokens_ = false;
  bool blend_ = false;
};

data::Blend make_blend(const py::list& datasets, const std::vector<double>& weights, std::uint64_t samples_per_epoch) {
  data::Blend b;
  for (auto d : datasets) {
    if (py::isinstance<Dataset>(d)) b.datasets.push_back(py::cast<std::shared_ptr<Dataset>>(d));
    else b.token_datasets.push_back(py::cast<std::shared_ptr<TokenDataset>>(d));
  }
  b.weights = weights;
  b.samples_per_epoch = samples_per_epoch;
  return b;
}

}  // namespace

void register_data(py::module_& m) {
  py::class_<Dataset, std::shared_ptr<Dataset>>(m, "_Dataset", "Opened tar shards; samples numbered across shards")
      .def("__len__", [](const Dataset& d) { return d.size(); })
      .def_property_readonly("shards", &Dataset::shards, "The shard paths, in order")
      .def_property_readonly("name", &Dataset::name, "What it was opened from (the spec, or its shards), as messages name it")
      .def_property_readonly("shard_samples", &Dataset::shard_samples, "The number of samples in each shard")
      .def("read", [](const Dataset& d, std::uint64_t i) {
        return sample_dict(call_nogil([&] { return d.read(i); }));
      }, py::arg("i"), "{'__key__': key, ext: bytes, ...} of sample i (0 <= i < len)");

  py::class_<TokenDataset, std::shared_ptr<TokenDataset>>(m, "_TokenDataset", "A Megatron-Core indexed dataset (PREFIX.bin + PREFIX.idx)")
      .def(py::init([](const std::string& prefix) { return unwrap(TokenDataset::open(prefix)); }), py::arg("prefix"),
           "Opens PREFIX.bin and PREFIX.idx (the .bin is read with pread, never mapped)")
      .def_property_readonly("dtype", &TokenDataset::dtype, "The token dtype, a numpy name")
      .def_property_readonly("prefix", &TokenDataset::prefix, "PREFIX of PREFIX.bin and PREFIX.idx")
      .def_property_readonly("documents", &TokenDataset::documents, "Documents in the dataset")
      .def_property_readonly("tokens", &TokenDataset::tokens, "Tokens over all sequences")
      .def_property_readonly("has_loss_mask", [](const TokenDataset& d) { return d.loss_mask() != nullptr; },
                             "An SFT dataset: PREFIX.mask.bin/.idx holds its loss mask")
      .def("__len__", &TokenDataset::sequences)
      .def("document", &TokenDataset::document, py::arg("d"), "(first, end): document d is sequences first..end-1")
      // A copy read with pread: a view into a mapping would SIGBUS once the .bin is truncated.
      .def("sequence_bytes", [](const TokenDataset& ds, std::uint64_t i) {
        return py::bytes(call_nogil([&] { return ds.bytes(i); }));
      }, py::arg("i"), "Sequence i's bytes (a copy)");
  m.def("_write_token_dataset", [](const std::string& prefix, const std::string& dtype,
                                   const std::vector<std::vector<std::int64_t>>& docs) { unwrap(write_token_dataset(prefix, dtype, docs)); },
        py::arg("prefix"), py::arg("dtype"), py::arg("documents"));
  m.def("_blend_weights", [](const std::vector<double>& weights, const std::vector<std::string>& names) {
    return unwrap(data::BlendSchedule::make(weights, names)).weights();
  }, py::arg("weights"), py::arg("names"), "The weights as the schedule rounds them; bad weights raise pacer.Error naming the dataset");
  m.def("_write_sft_dataset", [](const std::string& prefix, const std::string& dtype, const std::vector<std::vector<std::int64_t>>& docs,
                                 const std::vector<std::vector<std::uint8_t>>& masks) { unwrap(data::write_sft_dataset(prefix, dtype, docs, masks)); },
        py::arg("prefix"), py::arg("dtype"), py::arg("documents"), py::arg("masks"));
  m.def("_tokenize", &tokenize, py::arg("inputs"), py::arg("prefix"), py::arg("options"),
        "pacer.data.tokenize's C++ half; returns the pacer.shard.tokenize/2 record as JSON text");
  m.def("_open_dataset", &open_spec, py::arg("spec"));
  m.def("_open_dataset", &open_list, py::arg("shards"));

  py::class_<BufferOwner>(m, "_BatchBuffer", py::buffer_protocol(), "A batch's bytes; views into it keep it alive")
      .def_buffer([](BufferOwner& o) {
        return py::buffer_info(o.buffer->data(), 1, py::format_descriptor<unsigned char>::format(), 1,
                               {static_cast<py::ssize_t>(o.buffer->size())}, {1}, /*readonly=*/true);
      });

  // pacer.data.Loader (python/pacer/data.py) is the documented face of these.
  py::class_<PyLoader>(m, "_Loader", "The C++ loader behind pacer.data.Loader")
      .def(py::init<std::shared_ptr<Dataset>, const py::dict&, bool>(), py::arg("dataset"), py::arg("options"), py::arg("copy"),
           "Over tar shards; options: the dict pacer.data.Loader builds; copy: values as bytes, not memoryviews")
      .def(py::init<std::shared_ptr<TokenDataset>, const py::dict&>(), py::arg("dataset"), py::arg("options"),
           "Over a token dataset; options: the dict pacer.data.Loader builds")
      .def(py::init([](const py::list& datasets, const std::vector<double>& weights, std::uint64_t samples_per_epoch, const py::dict& options,
                       bool copy) { return std::make_unique<PyLoader>(make_blend(datasets, weights, samples_per_epoch), options, copy); }),
           py::arg("datasets"), py::arg("weights"), py::arg("samples_per_epoch"), py::arg("options"), py::arg("copy"),
           "Over a blend: datasets of one kind (_Dataset or _TokenDataset), their weights, positions per epoch (0: their items together)")
      .def("next", &PyLoader::next, "(batch, pinned) of this rank, or None at the end of the epoch; waits without the GIL")
      .def("state", &PyLoader::state, "The state as JSON text (schema pacer.loader/1): where the next batch starts")
      .def("load_state", &PyLoader::load_state, py::arg("state"), "Continues from a state() text; a mismatch raises pacer.Error")
      .def("set_epoch", &PyLoader::set_epoch, py::arg("epoch"), "Start epoch `epoch` from its beginning")
      .def("stats", &PyLoader::stats, "Counters and wait times (pacer.data.Loader.stats)")
      .def("batches_per_epoch", &PyLoader::batches_per_epoch, "Batches of this rank per epoch");
}

}  // namespace pacer::python
