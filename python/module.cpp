// The _pacer extension module: registers each capability and the one exception translator.
#include "bindings.hpp"

#include "pacer/core/error.hpp"
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
  pacer::python::register_checkpoint(m);
}
