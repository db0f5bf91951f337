// Python face of the port allocator: a lease of ports held until handed over.
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "pacer/run.hpp"
#include "pacer/run/ports.hpp"

namespace py = pybind11;

namespace pacer::python {

void register_run(py::module_& m) {
  m.def(
      "_run_heartbeat",
      [](std::optional<std::uint64_t> step) { unwrap(run::heartbeat(step)); },
      py::arg("step") = py::none());
  py::class_<run::PortLease>(m, "PortLease")
      .def_static(
          "acquire",
          [](int count, std::optional<std::uint64_t> job, std::optional<int> local_rank, int first, int last,
             int per_rank, int ranks_per_job) {
            auto scope = unwrap(run::port_scope_from_env());
            if (job) {
              scope.job = *job;
              scope.job_from = "job=";
            }
            if (local_rank) {
              scope.local_rank = *local_rank;
              scope.rank_from = "local_rank=";
            }
            run::PortPlan plan;
            plan.first = first;
            plan.last = last;
            plan.per_rank = per_rank;
            plan.ranks_per_job = ranks_per_job;
            return unwrap(run::PortLease::acquire(count, scope, plan));
          },
          py::arg("count"), py::arg("job") = py::none(), py::arg("local_rank") = py::none(),
          py::arg("first") = run::PortPlan{}.first, py::arg("last") = run::PortPlan{}.last,
          py::arg("per_rank") = run::PortPlan{}.per_rank, py::arg("ranks_per_job") = run::PortPlan{}.ranks_per_job)
      .def_property_readonly("ports", &run::PortLease::ports)
      .def("release", &run::PortLease::release, py::arg("port"))
      .def("release_all", &run::PortLease::release_all)
      .def("take_fd", &run::PortLease::take_fd, py::arg("port"));
}

}  // namespace pacer::python
