// Python face of checkpointing: buffers in, buffers out; no logic beyond translation.
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "pacer/checkpoint.hpp"

namespace py = pybind11;

namespace pacer::python {
namespace {

// One blob from Python: (name, buffer, dtype, shape). The buffer is only read
// inside save(), with the GIL released, while the caller's objects are alive.
using PyBlob = std::tuple<std::string, py::buffer, std::string, std::vector<std::int64_t>>;

class PyCheckpointer {
 public:
  PyCheckpointer(const std::string& root, std::optional<std::string> fast_tier, int keep_last, int keep_every,
                 std::uint64_t staging_bytes, std::uint64_t chunk_bytes) {
    ckpt::Options o;
    o.root = root;
    o.fast_tier = std::move(fast_tier);
    o.keep_last = keep_last;
    o.keep_every = keep_every;
    o.staging_bytes = staging_bytes;
    o.chunk_bytes = chunk_bytes;
    impl_ = unwrap(ckpt::Checkpointer::open(std::move(o)));
  }

  // Background threads may still be finishing a save: let them run without
  // the GIL while this waits for them.
  ~PyCheckpointer() {
    py::gil_scoped_release nogil;
    impl_.reset();
  }
  PyCheckpointer(const PyCheckpointer&) = delete;
  PyCheckpointer& operator=(const PyCheckpointer&) = delete;

  ckpt::SaveHandle save(std::uint64_t step, const std::vector<PyBlob>& blobs, const std::string& meta_json) {
    std::vector<ckpt::BlobView> views;
    std::vector<py::buffer_info> infos;
    infos.reserve(blobs.size());
    for (const auto& [name, buf, dtype, shape] : blobs) {
      infos.push_back(buf.request());
      const auto& info = infos.back();
      ckpt::BlobView v;
      v.name = name;
      v.data = info.ptr;
      v.size = static_cast<std::uint64_t>(info.size * info.itemsize);
      v.dtype = dtype;
      v.shape = shape;
      views.push_back(std::move(v));
    }
    auto meta = nlohmann::json::parse(meta_json, nullptr, false);
    if (meta.is_discarded()) throw Exception(Error{ErrorKind::kUsage, "meta is not valid JSON"});
    py::gil_scoped_release nogil;
    return unwrap(impl_->save(step, views, meta));
  }

  std::optional<std::uint64_t> latest() {
    py::gil_scoped_release nogil;
    return impl_->latest();
  }

  ckpt::Reader open_reader(std::optional<std::uint64_t> step) {
    py::gil_scoped_release nogil;
    return unwrap(impl_->open_reader(step));
  }

  std::vector<ckpt::Reader> candidates(std::optional<std::uint64_t> step) {
    py::gil_scoped_release nogil;
    return impl_->candidates(step);
  }

  void flush() {
    py::gil_scoped_release nogil;
    unwrap(impl_->flush());
  }

 private:
  std::unique_ptr<ckpt::Checkpointer> impl_;
};

}  // namespace

void register_checkpoint(py::module_& m) {
  py::class_<ckpt::SaveHandle>(m, "SaveHandle", "The state of one asynchronous save")
      .def_property_readonly("step", &ckpt::SaveHandle::step)
      .def("done", &ckpt::SaveHandle::done)
      .def("wait", [](ckpt::SaveHandle& h) {
        py::gil_scoped_release nogil;
        unwrap(h.wait());
      }, "Block until the checkpoint is durable and committed")
      .def("wait_persistent", [](ckpt::SaveHandle& h) {
        py::gil_scoped_release nogil;
        unwrap(h.wait_persistent());
      }, "Also wait for the copy to the persistent tier");

  py::class_<ckpt::Reader>(m, "Reader", "One committed checkpoint; every read is checksummed")
      .def_property_readonly("step", [](const ckpt::Reader& r) { return r.manifest().step; })
      .def_property_readonly("dir", &ckpt::Reader::dir)
      .def_property_readonly("meta_json", [](const ckpt::Reader& r) { return r.manifest().meta.dump(); })
      .def("blobs", [](const ckpt::Reader& r) {
        std::vector<std::tuple<std::string, std::string, std::vector<std::int64_t>, std::uint64_t>> out;
        for (const auto& b : r.logical_blobs()) out.emplace_back(b.name, b.dtype, b.shape, b.size);
        return out;
      })
      .def("read_into", [](ckpt::Reader& r, const std::string& name, py::buffer dst) {
        py::buffer_info info = dst.request(true);
        const auto size = static_cast<std::uint64_t>(info.size * info.itemsize);
        py::gil_scoped_release nogil;
        unwrap(r.read(name, info.ptr, size, 0));
      }, py::arg("name"), py::arg("dst"))
      .def("verify", [](ckpt::Reader& r) {
        py::gil_scoped_release nogil;
        unwrap(r.verify_all());
      });

  py::class_<PyCheckpointer>(m, "_Checkpointer")
      .def(py::init<const std::string&, std::optional<std::string>, int, int, std::uint64_t, std::uint64_t>(),
           py::arg("root"), py::arg("fast_tier") = py::none(), py::arg("keep_last") = 3, py::arg("keep_every") = 0,
           py::arg("staging_bytes") = 1ull << 30, py::arg("chunk_bytes") = 64ull << 20)
      .def("save", &PyCheckpointer::save)
      .def("latest", &PyCheckpointer::latest)
      .def("open_reader", &PyCheckpointer::open_reader, py::arg("step") = py::none())
      .def("candidates", &PyCheckpointer::candidates, py::arg("step") = py::none())
      .def("flush", &PyCheckpointer::flush);

  m.def("optimal_interval", &ckpt::optimal_interval, py::arg("save_cost_s"), py::arg("mtbf_s"),
        "Daly's optimal checkpoint interval in seconds");
}

}  // namespace pacer::python
