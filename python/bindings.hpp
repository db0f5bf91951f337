// Internal to the Python module: one registration function per capability.
#pragma once

#include <pybind11/pybind11.h>

#include <optional>
#include <type_traits>
#include <utility>

#include "pacer/core/error.hpp"

namespace pacer::python {

// The module's exception type; every pacer::Exception becomes one.
pybind11::object& error_type();
void register_checkpoint(pybind11::module_& m);
void register_data(pybind11::module_& m);
void register_telemetry(pybind11::module_& m);
void register_run(pybind11::module_& m);

template <class T>
struct is_expected : std::false_type {};
template <class T>
struct is_expected<Expected<T>> : std::true_type {};

// Runs f() with the GIL released, for C++ work that blocks (I/O, collectives,
// joining threads) so Python threads keep running meanwhile. The result is
// handed back with the GIL held again, because turning it into Python objects
// needs the GIL: an Expected is unwrapped and a Status checked (an error
// raises pacer.Error), anything else is returned as it is.
template <class F>
auto call_nogil(F&& f) {
  using R = std::invoke_result_t<F&>;
  if constexpr (std::is_void_v<R>) {
    pybind11::gil_scoped_release nogil;
    f();
  } else {
    std::optional<R> r;
    {
      pybind11::gil_scoped_release nogil;
      r.emplace(f());
    }
    if constexpr (std::is_same_v<R, Status>) {
      unwrap(*r);
    } else if constexpr (is_expected<R>::value) {
      return unwrap(std::move(*r));
    } else {
      return std::move(*r);
    }
  }
}

}  // namespace pacer::python
