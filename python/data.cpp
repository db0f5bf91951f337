// Python face of the data loader: datasets and loaders, samples as bytes; no logic beyond translation.
#include <pybind11/stl.h>

#include <fmt/format.h>

#include <optional>

#include "bindings.hpp"
#include "pacer/data.hpp"

namespace py = pybind11;

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

// {"__key__": [key, ...], ext: [bytes, ...]}; a sample without some field
// has None in that field's list, so every list lines up with the keys.
py::dict batch_dict(const data::Batch& b) {
  py::dict d;
  py::list keys;
  d["__key__"] = keys;
  const std::size_t n = b.samples.size();
  for (std::size_t i = 0; i < n; ++i) {
    const auto& s = b.samples[i];
    keys.append(text(s.key));
    for (const auto& [ext, bytes] : s.fields) {
      py::str e = text(ext);
      py::list col;
      if (d.contains(e)) {
        col = d[e].cast<py::list>();
      } else {
        for (std::size_t k = 0; k < n; ++k) col.append(py::none());
        d[e] = col;
      }
      col[i] = py::bytes(bytes);
    }
  }
  return d;
}

std::shared_ptr<Dataset> open_spec(const std::string& spec) {
  py::gil_scoped_release nogil;  // may scan shards that have no index yet
  return unwrap(Dataset::open(spec));
}

std::shared_ptr<Dataset> open_list(const std::vector<std::string>& shards) {
  py::gil_scoped_release nogil;
  return unwrap(Dataset::open(shards));
}

class PyLoader {
 public:
  PyLoader(std::shared_ptr<Dataset> ds, std::uint64_t batch_size, std::uint64_t seed, int rank, int world_size, bool shuffle,
           bool drop_last, int threads, std::uint64_t prefetch, bool skip_bad, std::uint64_t max_bytes) {
    data::LoaderOptions o;
    o.batch_size = batch_size;
    o.seed = seed;
    o.rank = rank;
    o.world_size = world_size;
    o.shuffle = shuffle;
    o.drop_last = drop_last;
    o.threads = threads;
    o.prefetch_batches = prefetch;
    o.skip_bad = skip_bad;
    o.max_bytes = max_bytes;
    impl_ = unwrap(data::Loader::open(std::move(ds), o));
  }

  // Reader threads may be inside a read: join them without holding the GIL.
  ~PyLoader() {
    py::gil_scoped_release nogil;
    impl_.reset();
  }
  PyLoader(const PyLoader&) = delete;
  PyLoader& operator=(const PyLoader&) = delete;

  // The next batch as a dict, or None at the end of the epoch.
  py::object next() {
    std::optional<Expected<std::optional<data::Batch>>> r;
    {
      py::gil_scoped_release nogil;
      r.emplace(impl_->next());
    }
    if (!*r) throw Exception(r->error());
    const auto& batch = **r;
    if (!batch) return py::none();
    return batch_dict(*batch);
  }

  std::string state() const { return impl_->state().dump(); }

  void load_state(const std::string& s) {
    const auto j = nlohmann::json::parse(s, nullptr, false);
    if (j.is_discarded() || !j.is_object()) throw Exception(Error{ErrorKind::kUsage, "loader state is not a JSON object"});
    py::gil_scoped_release nogil;
    unwrap(impl_->load_state(j));
  }

  void set_epoch(std::uint64_t epoch) {
    py::gil_scoped_release nogil;
    impl_->set_epoch(epoch);
  }

  py::dict stats() const {
    const auto s = impl_->stats();
    py::dict d;
    d["wait_s"] = s.wait_s;
    d["last_wait_s"] = s.last_wait_s;
    d["batches"] = s.batches;
    d["samples"] = s.samples;
    d["bytes"] = s.bytes;
    d["skipped"] = s.skipped;
    d["queue_depth"] = s.queue_depth;
    d["elapsed_s"] = s.elapsed_s;
    return d;
  }

  std::uint64_t batches_per_epoch() const { return impl_->batches_per_epoch(); }

 private:
  std::unique_ptr<data::Loader> impl_;
};

}  // namespace

void register_data(py::module_& m) {
  py::class_<Dataset, std::shared_ptr<Dataset>>(m, "_Dataset", "Opened tar shards; samples numbered across shards")
      .def("__len__", [](const Dataset& d) { return d.size(); })
      .def_property_readonly("shards", &Dataset::shards)
      .def_property_readonly("shard_samples", &Dataset::shard_samples)
      .def("read", [](const Dataset& d, std::uint64_t i) {
        std::optional<Expected<Dataset::Sample>> r;
        {
          py::gil_scoped_release nogil;
          r.emplace(d.read(i));
        }
        if (!*r) throw Exception(r->error());
        return sample_dict(**r);
      }, py::arg("i"));

  py::class_<TokenDataset, std::shared_ptr<TokenDataset>>(m, "_TokenDataset", "A memory-mapped Megatron-Core indexed dataset")
      .def(py::init([](const std::string& prefix) { return unwrap(TokenDataset::open(prefix)); }), py::arg("prefix"))
      .def_property_readonly("dtype", &TokenDataset::dtype)
      .def_property_readonly("documents", &TokenDataset::documents)
      .def_property_readonly("tokens", &TokenDataset::tokens)
      .def("__len__", &TokenDataset::sequences)
      .def("document", &TokenDataset::document, py::arg("d"))
      // A read-only view into the mapping; the array keeps the dataset alive.
      .def("sequence_view", [](std::shared_ptr<TokenDataset> ds, std::uint64_t i) {
        if (i >= ds->sequences()) throw Exception(Error{ErrorKind::kUsage, fmt::format("sequence {} of {}", i, ds->sequences())});
        const auto n = static_cast<py::ssize_t>(ds->length(i) * ds->itemsize());
        return py::memoryview::from_memory(const_cast<void*>(ds->data(i)), n, /*readonly=*/true);
      }, py::keep_alive<0, 1>(), py::arg("i"));
  m.def("_write_token_dataset", [](const std::string& prefix, const std::string& dtype,
                                   const std::vector<std::vector<std::int64_t>>& docs) { unwrap(write_token_dataset(prefix, dtype, docs)); },
        py::arg("prefix"), py::arg("dtype"), py::arg("documents"));
  m.def("_open_dataset", &open_spec, py::arg("spec"));
  m.def("_open_dataset", &open_list, py::arg("shards"));

  py::class_<PyLoader>(m, "_Loader")
      .def(py::init<std::shared_ptr<Dataset>, std::uint64_t, std::uint64_t, int, int, bool, bool, int, std::uint64_t, bool, std::uint64_t>(),
           py::arg("dataset"), py::arg("batch_size"), py::arg("seed"), py::arg("rank"), py::arg("world_size"), py::arg("shuffle"),
           py::arg("drop_last"), py::arg("threads"), py::arg("prefetch"), py::arg("skip_bad"), py::arg("max_bytes"))
      .def("next", &PyLoader::next)
      .def("state", &PyLoader::state)
      .def("load_state", &PyLoader::load_state, py::arg("state"))
      .def("set_epoch", &PyLoader::set_epoch, py::arg("epoch"))
      .def("stats", &PyLoader::stats)
      .def("batches_per_epoch", &PyLoader::batches_per_epoch);
}

}  // namespace pacer::python
