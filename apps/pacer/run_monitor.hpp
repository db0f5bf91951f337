// `pacer run --monitor`: CMD under `pacer monitor`, on one node or on every node of `--nodes`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pacer::cli {

// This executable, so that `pacer monitor` can be started around CMD.
std::string self_exe();
// CMD under `pacer monitor --db DB --run-id ID --interval I --` (the run exists already).
std::vector<std::string> monitored(const std::string& db, std::int64_t run_id, const std::string& interval,
                                   const std::vector<std::string>& argv);
// One node's catalog of a `pacer run --nodes --monitor` job: DB with "-NODE"
// before its ".db" (pacer-4242.db -> pacer-4242-n1.db, the name `pacer
// monitor` gives a node's file of a multi-node job).
std::string node_catalog(const std::string& db, const std::string& node);

}  // namespace pacer::cli
