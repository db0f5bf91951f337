// The _pacer extension module: registers each capability and the one exception translator.
#include "bindings.hpp"

#include "pacer/core/error.hpp"
#include "pacer/core/host_buffer.hpp"
#include "pacer/version.hpp"

namespace py = pybind11;

namespace pacer::python {

py::object& error_type() {
  static py::object type;
  return type;
}

}  // namespace pacer::python

PYBIND11_MODULE(_pacer, m) {
  m.doc() = "pacer: keep large training runs fast and alive (native part)";
  m.attr("__version__") = pacer::kVersion;
  auto& err = pacer::python::error_type();
  err = py::exception<pacer::Exception>(m, "Error", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const pacer::Exception& e) {
      PyErr_SetString(pacer::python::error_type().ptr(), e.what());
    }
  });
  // Page-aligned memory for arrays filled from disk, without numpy's huge-page
  // advice (which stalls first touch on compaction where THP defrag is
  // "madvise").
  py::class_<pacer::HostBuffer>(m, "HostBuffer", py::buffer_protocol())
      .def(py::init([](std::size_t n) {
        pacer::HostBuffer b(n);
        if (n && !b) throw std::bad_alloc();
        return b;
      }))
      .def("__len__", &pacer::HostBuffer::size)
      .def_buffer([](pacer::HostBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<unsigned char>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {1});
      });
  pacer::python::register_checkpoint(m);
  pacer::python::register_data(m);
  pacer::python::register_telemetry(m);
  pacer::python::register_run(m);
}
