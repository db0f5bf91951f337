// Python face of checkpointing: buffers in, buffers out; no logic beyond translation.
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "pacer/checkpoint.hpp"
#include "pacer/comm/communicator.hpp"
#include "pacer/core/host_buffer.hpp"

namespace py = pybind11;
using namespace pybind11::literals;

namespace pacer::python {
namespace {

// One blob from Python: (name, data, dtype, shape, layout, shard_offset,
// global_size, global_shape). `data` is a buffer, or (device, pointer, bytes)
// for CUDA memory. Both are only read inside save(), with the GIL released,
// while the caller's objects are alive.
using PyBlob = std::tuple<std::string, py::object, std::string, std::vector<std::int64_t>, std::string, std::uint64_t,
                          std::uint64_t, std::vector<std::int64_t>>;

// A Communicator whose collectives are a Python object's methods (rank, size,
// barrier, all_ok, broadcast, split_node, split): pacer.checkpoint's
// torch.distributed communicator. The C++ commit calls it without the GIL and
// must never see a Python exception: a failing call is a failed collective
// (all_ok false, broadcast an error on the ranks that receive).
class PyCommunicator final : public comm::Communicator {
 public:
  explicit PyCommunicator(py::object obj) : obj_(std::move(obj)) {
    rank_ = obj_.attr("rank")().cast<int>();
    size_ = obj_.attr("size")().cast<int>();
  }
  ~PyCommunicator() override {
    py::gil_scoped_acquire gil;
    obj_ = py::object();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void barrier() override {
    py::gil_scoped_acquire gil;
    try {
      obj_.attr("barrier")();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("pacer communicator barrier");
    }
  }

  bool all_ok(bool ok) override {
    py::gil_scoped_acquire gil;
    try {
      return obj_.attr("all_ok")(ok).cast<bool>();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("pacer communicator all_ok");
    } catch (const std::exception&) {
    }
    return false;
  }

  std::string broadcast(const std::string& value, int root) override {
    py::gil_scoped_acquire gil;
    try {
      return obj_.attr("broadcast")(py::bytes(value), root).cast<std::string>();
    } catch (py::error_already_set& e) {
      std::string what = e.what();
      if (rank_ == root) return value;
      return "rank " + std::to_string(rank_) + ": broadcast failed: " + what;
    } catch (const std::exception& e) {
      if (rank_ == root) return value;
      return "rank " + std::to_string(rank_) + ": broadcast failed: " + e.what();
    }
  }

  std::unique_ptr<comm::Communicator> split_node() override { return wrap(call_split("split_node", py::none())); }
  std::unique_ptr<comm::Communicator> split(int color) override { return wrap(call_split("split", py::int_(color))); }

 private:
  py::object call_split(const char* method, py::object arg) {
    py::gil_scoped_acquire gil;
    try {
      if (!py::hasattr(obj_, method)) return py::none();
      return arg.is_none() ? obj_.attr(method)() : obj_.attr(method)(arg);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable(method);
      return py::none();
    }
  }
  static std::unique_ptr<comm::Communicator> wrap(py::object o) {
    py::gil_scoped_acquire gil;
    if (o.is_none()) return nullptr;
    return std::make_unique<PyCommunicator>(std::move(o));
  }

  py::object obj_;
  int rank_ = 0;
  int size_ = 1;
};

class PyCheckpointer {
 public:
  // comm: None (one rank), "mpi" (MPI_COMM_WORLD) or a Python communicator.
  PyCheckpointer(const std::string& root, std::optional<std::string> fast_tier, int keep_last, int keep_every,
                 std::uint64_t staging_bytes, std::uint64_t chunk_bytes, py::object comm, std::uint64_t overflow_bytes) {
    if (py::isinstance<py::str>(comm) && comm.cast<std::string>() == "mpi") {
      comm_ = unwrap(comm::mpi_world());
    } else if (!comm.is_none()) {
      comm_ = std::make_unique<PyCommunicator>(comm);
    }
    ckpt::Options o;
    o.root = root;
    o.fast_tier = std::move(fast_tier);
    o.keep_last = keep_last;
    o.keep_every = keep_every;
    o.staging_bytes = staging_bytes;
    o.chunk_bytes = chunk_bytes;
    o.overflow_bytes = overflow_bytes;
    o.comm = comm_.get();
    impl_ = call_nogil([&] { return ckpt::Checkpointer::open(std::move(o)); });  // opening may already be collective
  }

  // Background threads may still be finishing a save: let them run without
  // the GIL while this waits for them.
  ~PyCheckpointer() {
    call_nogil([&] { impl_.reset(); });
  }
  PyCheckpointer(const PyCheckpointer&) = delete;
  PyCheckpointer& operator=(const PyCheckpointer&) = delete;

  int rank() const { return comm_ ? comm_->rank() : 0; }
  int size() const { return comm_ ? comm_->size() : 1; }

  ckpt::SaveHandle save(std::uint64_t step, const std::vector<PyBlob>& blobs, const std::string& meta_json,
                        std::uintptr_t cuda_stream, bool defer_device_copies) {
    std::vector<ckpt::BlobView> views;
    std::vector<py::buffer_info> infos;
    infos.reserve(blobs.size());
    for (const auto& [name, data, dtype, shape, layout, shard_offset, global_size, global_shape] : blobs) {
      ckpt::BlobView v;
      v.name = name;
      if (py::isinstance<py::tuple>(data)) {
        auto t = data.cast<std::tuple<int, std::uintptr_t, std::uint64_t>>();
        v.device = std::get<0>(t);
        v.data = reinterpret_cast<const void*>(std::get<1>(t));
        v.size = std::get<2>(t);
      } else {
        infos.push_back(py::reinterpret_borrow<py::buffer>(data).request());
        const auto& info = infos.back();
        v.data = info.ptr;
        v.size = static_cast<std::uint64_t>(info.size * info.itemsize);
      }
      v.dtype = dtype;
      v.shape = shape;
      if (layout == "shard") {
        v.layout = ckpt::Layout::kShard;
        v.shard_offset = shard_offset;
        v.global_size = global_size;
        v.global_shape = global_shape;
      } else if (layout != "replicated") {
        throw Exception(Error{ErrorKind::kUsage, "blob '" + name + "': unknown layout '" + layout + "'"});
      }
      views.push_back(std::move(v));
    }
    auto meta = nlohmann::json::parse(meta_json, nullptr, false);
    if (meta.is_discarded()) throw Exception(Error{ErrorKind::kUsage, "meta is not valid JSON"});
    ckpt::SaveOptions so;
    so.cuda_stream = cuda_stream;
    so.defer_device_copies = defer_device_copies;
    return call_nogil([&] { return impl_->save(step, views, meta, so); });
  }

  std::optional<std::uint64_t> latest() {
    return call_nogil([&] { return impl_->latest(); });
  }

  ckpt::Reader open_reader(std::optional<std::uint64_t> step) {
    return call_nogil([&] { return impl_->open_reader(step); });
  }

  std::vector<ckpt::Reader> candidates(std::optional<std::uint64_t> step) {
    return call_nogil([&] { return impl_->candidates(step); });
  }

  void flush() {
    call_nogil([&] { return impl_->flush(); });
  }

  void reserve(int device) { impl_->reserve(device); }

  py::dict stats() const {
    const auto s = impl_->stats();
    return py::dict("saves"_a = s.saves, "bytes_staged"_a = s.bytes_staged, "staging_bytes"_a = s.staging_bytes,
                    "pinned_bytes"_a = s.pinned_bytes, "overflow_bytes"_a = s.overflow_bytes, "pool_waits"_a = s.pool_waits,
                    "blocked_s"_a = s.blocked_s);
  }

 private:
  std::unique_ptr<comm::Communicator> comm_;  // outlives impl_, which uses it
  std::unique_ptr<ckpt::Checkpointer> impl_;
};

}  // namespace

void register_checkpoint(py::module_& m) {
  py::class_<ckpt::SaveHandle>(m, "SaveHandle", "The state of one asynchronous save")
      .def_property_readonly("step", &ckpt::SaveHandle::step)
      .def("done", &ckpt::SaveHandle::done)
      .def("wait", [](ckpt::SaveHandle& h) { call_nogil([&] { return h.wait(); }); },
           "Block until the checkpoint is durable and committed")
      .def("wait_persistent", [](ckpt::SaveHandle& h) { call_nogil([&] { return h.wait_persistent(); }); },
           "Also wait for the copy to the persistent tier")
      .def("copied", &ckpt::SaveHandle::copied, "Whether the device tensors' copies have landed (deferred saves)")
      .def("wait_copied", [](ckpt::SaveHandle& h) { call_nogil([&] { return h.wait_copied(); }); },
           "Block until the device tensors' copies have landed")
      .def("order_before", [](ckpt::SaveHandle& h, std::uintptr_t stream) { call_nogil([&] { return h.order_before(stream); }); },
           py::arg("cuda_stream"), "Make work queued later on cuda_stream wait (on the GPU) for the copies");

  py::class_<ckpt::Reader>(m, "Reader", "One committed checkpoint; every read is checksummed")
      .def_property_readonly("step", [](const ckpt::Reader& r) { return r.manifest().step; })
      .def_property_readonly("dir", &ckpt::Reader::dir)
      .def_property_readonly("world_size", [](const ckpt::Reader& r) { return r.manifest().world_size; })
      .def_property_readonly("chunk_bytes", [](const ckpt::Reader& r) { return r.manifest().chunk_bytes; })
      .def_property_readonly("meta_json", [](const ckpt::Reader& r) { return r.manifest().meta.dump(); })
      .def("blobs", [](const ckpt::Reader& r) {
        std::vector<std::tuple<std::string, std::string, std::vector<std::int64_t>, std::uint64_t>> out;
        for (const auto& b : r.logical_blobs()) out.emplace_back(b.name, b.dtype, b.shape, b.size);
        return out;
      })
      .def("read_into", [](ckpt::Reader& r, const std::string& name, py::buffer dst, std::uint64_t offset) {
        py::buffer_info info = dst.request(true);
        const auto size = static_cast<std::uint64_t>(info.size * info.itemsize);
        call_nogil([&] { return r.read(name, info.ptr, size, offset); });
      }, py::arg("name"), py::arg("dst"), py::arg("offset") = 0,
         "Fill dst with the bytes of blob `name` from byte `offset`, checking each against its checksum")
      .def("verify", [](ckpt::Reader& r) { call_nogil([&] { return r.verify_all(); }); });

  py::class_<PyCheckpointer>(m, "_Checkpointer")
      .def(py::init<const std::string&, std::optional<std::string>, int, int, std::uint64_t, std::uint64_t, py::object, std::uint64_t>(),
           py::arg("root"), py::arg("fast_tier") = py::none(), py::arg("keep_last") = 3, py::arg("keep_every") = 0,
           py::arg("staging_bytes") = 1ull << 30, py::arg("chunk_bytes") = 64ull << 20, py::arg("comm") = py::none(),
           py::arg("overflow_bytes") = 0)
      .def_property_readonly("rank", &PyCheckpointer::rank)
      .def_property_readonly("size", &PyCheckpointer::size)
      .def("save", &PyCheckpointer::save, py::arg("step"), py::arg("blobs"), py::arg("meta_json"),
           py::arg("cuda_stream") = 0, py::arg("defer_device_copies") = false)
      .def("latest", &PyCheckpointer::latest)
      .def("open_reader", &PyCheckpointer::open_reader, py::arg("step") = py::none())
      .def("candidates", &PyCheckpointer::candidates, py::arg("step") = py::none())
      .def("flush", &PyCheckpointer::flush)
      .def("stats", &PyCheckpointer::stats)
      .def("reserve", &PyCheckpointer::reserve, py::arg("device") = -1);

  m.def("_prune", [](const std::string& root, int keep_last, int keep_every, bool remove_damaged, bool dry_run) {
    ckpt::PruneOptions o;
    o.keep_last = keep_last;
    o.keep_every = keep_every;
    o.remove_damaged = remove_damaged;
    o.dry_run = dry_run;
    const ckpt::PruneResult r = call_nogil([&] { return ckpt::prune(root, o); });
    py::list damaged;
    for (const auto& e : r.damaged) damaged.append(py::make_tuple(e.path, e.problem));
    py::list partial;
    for (const auto& e : r.removed_partial) partial.append(py::make_tuple(e.path, e.problem));
    return py::dict("newest_valid"_a = r.newest_valid ? py::cast(*r.newest_valid) : py::none(), "removed"_a = r.removed,
                    "kept"_a = r.kept, "damaged"_a = damaged, "removed_damaged"_a = r.removed_damaged, "busy"_a = r.busy,
                    "removed_partial"_a = partial);
  }, py::arg("root"), py::arg("keep_last"), py::arg("keep_every"), py::arg("remove_damaged"), py::arg("dry_run"));
  m.def("_export_safetensors", [](const std::string& root, std::optional<std::uint64_t> step, const std::string& out_dir,
                                  const std::string& prefix, std::uint64_t max_shard_bytes) {
    ckpt::ExportOptions o;
    o.prefix = prefix;
    o.max_shard_bytes = max_shard_bytes;
    const ckpt::ExportResult r = call_nogil([&] { return ckpt::export_safetensors(root, step, out_dir, o); });
    return py::dict("step"_a = r.step, "files"_a = r.files, "tensors"_a = r.tensors, "bytes"_a = r.bytes,
                    "skipped"_a = r.skipped);
  }, py::arg("root"), py::arg("step"), py::arg("out_dir"), py::arg("prefix"), py::arg("max_shard_bytes"));
  m.def("optimal_interval", &ckpt::optimal_interval, py::arg("save_cost_s"), py::arg("mtbf_s"),
        "Daly's optimal checkpoint interval in seconds");
  m.def("dtype_size", &ckpt::dtype_size, py::arg("dtype"), "Bytes per element of a blob dtype; 0 when unknown");
  m.def("built_with_mpi", &comm::built_with_mpi);
  m.def("_prefault", [](py::buffer dst) {
    py::buffer_info info = dst.request(true);
    void* p = info.ptr;
    const auto size = static_cast<std::size_t>(info.size * info.itemsize);
    py::gil_scoped_release nogil;
    return prefault_for_write(p, size);
  }, py::arg("dst"), "Fault the pages of a writable buffer in ahead of a read into it; False where the kernel cannot");
  m.def("_advise_huge_pages", [](py::buffer dst) {
    py::buffer_info info = dst.request(true);
    return advise_huge_pages(info.ptr, static_cast<std::size_t>(info.size * info.itemsize));
  }, py::arg("dst"), "Advise the 2 MiB-aligned interior of a writable buffer, not yet written, as huge pages; False where nothing was");
}

}  // namespace pacer::python
