// Internal to the Python module: one registration function per capability.
#pragma once

#include <pybind11/pybind11.h>

namespace pacer::python {

// The module's exception type; every pacer::Exception becomes one.
pybind11::object& error_type();
void register_checkpoint(pybind11::module_& m);
void register_data(pybind11::module_& m);
void register_telemetry(pybind11::module_& m);
void register_run(pybind11::module_& m);

}  // namespace pacer::python
