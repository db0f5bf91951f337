// What the curate steps share inside src/curate.
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/curate.hpp"

namespace pacer::curate {

// A new version derived from `parent` by `step`: its id is over the parent,
// the step and `identity` (the parameters that decide its content: checksums,
// not paths); `parameters` is what the manifest records. Inputs and columns
// are the parent's.
Manifest derive(const Manifest& parent, const std::string& step, const nlohmann::json& identity, nlohmann::json parameters);

// The (input, row) of every sample the filter steps in m's lineage dropped.
Expected<std::set<std::pair<std::size_t, std::uint64_t>>> dropped_rows(const Store& store, const Manifest& m);

// Where a row's value sits in a column: JSON-lines rows are 1-based lines.
inline std::size_t row_index(const Input& in, std::uint64_t row) { return in.kind == "jsonl" ? static_cast<std::size_t>(row - 1) : row; }

// Empty columns (null per row) for every input.
std::vector<std::vector<nlohmann::json>> null_columns(const std::vector<std::uint64_t>& rows);

// Adds (or replaces, by name) a column of `m`.
void set_column(Manifest& m, Column c);

// The number of worker threads for `jobs` (0: every CPU this process may use).
int worker_count(int jobs);

// Runs fn(begin, end) over [0, n) in blocks on `threads` threads.
void parallel_blocks(std::size_t n, int threads, std::size_t block, const std::function<void(std::size_t, std::size_t)>& fn);

}  // namespace pacer::curate
