// Python face of the training-metrics recorder: queue a step, never block; no logic beyond translation.
#include <pybind11/stl.h>

#include <optional>

#include "bindings.hpp"
#include "pacer/telemetry.hpp"

namespace py = pybind11;

namespace pacer::python {

void register_telemetry(py::module_& m) {
  using telemetry::Recorder;
  using telemetry::RecorderOptions;
  using telemetry::StepRecord;
  py::class_<Recorder>(m, "_Recorder")
      .def(py::init([](std::optional<std::string> db, std::optional<int> rank, std::size_t queue_capacity,
                       double flush_interval_s) {
             RecorderOptions o;
             if (db) o.db = *db;
             if (rank) o.rank = *rank;
             o.queue_capacity = queue_capacity;
             o.flush_interval_s = flush_interval_s;
             return unwrap(Recorder::open(o));
           }),
           py::arg("db"), py::arg("rank"), py::arg("queue_capacity"), py::arg("flush_interval_s"))
      .def(
          "step",
          [](Recorder& r, std::int64_t step, std::optional<double> loss, std::optional<double> tokens,
             std::optional<double> data_wait_s, std::optional<double> comm_s, std::optional<double> step_time_s,
             std::optional<double> t, std::string extra_json, std::optional<double> flops) {
            StepRecord s;
            s.step = step;
            s.loss = loss;
            s.tokens = tokens;
            s.data_wait_s = data_wait_s;
            s.comm_s = comm_s;
            s.step_time_s = step_time_s;
            s.t = t.value_or(0);
            s.flops = flops;
            s.extra_json = std::move(extra_json);
            return r.step(std::move(s));
          },
          py::arg("step"), py::arg("loss"), py::arg("tokens"), py::arg("data_wait_s"), py::arg("comm_s"),
          py::arg("step_time_s"), py::arg("t"), py::arg("extra_json"), py::arg("flops") = std::nullopt)
      .def("event", &Recorder::event, py::arg("kind"), py::arg("detail"))
      .def("flush", [](Recorder& r) { call_nogil([&] { return r.flush(); }); })
      .def("close", [](Recorder& r) { call_nogil([&] { r.close(); }); })
      .def_property_readonly("written", &Recorder::written)
      .def_property_readonly("dropped", &Recorder::dropped)
      .def_property_readonly("run_id", &Recorder::run_id)
      .def_property_readonly("rank", &Recorder::rank)
      .def_property_readonly("db", &Recorder::db_path);
}

}  // namespace pacer::python
