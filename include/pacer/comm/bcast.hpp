// Broadcast of a file or directory: read once, sent in checksummed chunks over MPI, written once per node.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "pacer/comm/communicator.hpp"
#include "pacer/core/error.hpp"

namespace pacer::comm {

struct BcastOptions {
  std::uint64_t chunk_bytes = 16ull << 20;  // pipelining and checksum granularity
  // 0: the ranks sharing memory form a node; n > 0: consecutive groups of n
  // ranks do (several "nodes" on one host, for tests).
  int ranks_per_node = 0;
};

// What one rank did.
struct BcastStats {
  std::uint64_t files = 0;
  std::uint64_t bytes = 0;          // payload broadcast (all files)
  std::uint64_t bytes_read = 0;     // read from the source by this rank (the root only)
  std::uint64_t bytes_written = 0;  // written by this rank (one rank per node)
  std::uint64_t chunks = 0;
  std::uint64_t xxh3 = 0;           // XXH3-64 of every file's bytes in order (every rank that received them)
  int nodes = 1;                    // writers: one per node
  bool writer = false;
  bool unchanged = false;           // every node's DST held the same bytes already: nothing was replaced
  double seconds = 0;
};

// Collective over `world`: rank 0 reads `src` (a file, or a directory whose
// regular files, and symlinks to regular files wherever they point, are sent
// with their relative paths; a symlink to a directory or a special file is an
// error) and broadcasts it in chunks to one rank per node (the lowest rank on
// each node), which writes `dst` on its node: a file is written beside dst and
// renamed over it, a directory is written as dst.partial-* and renamed to dst.
// A dst that exists is compared as the chunks arrive: the same bytes (and
// the same files, sizes and modes) leave it untouched (`unchanged`); any
// difference replaces it whole in one rename (a directory: RENAME_EXCHANGE).
// Every chunk carries its XXH3-64 and is checked on arrival; rank 0 checks
// that no source file changed (size, mtime, ctime, inode) between listing and
// the last chunk. A mismatch, a change or a write error on any node fails the
// call on every rank, and then no node puts its copy in place. Blocking; call
// from one thread per rank.
Expected<BcastStats> broadcast_path(Communicator& world, const std::string& src, const std::string& dst,
                                    const BcastOptions& options = {});

// Collective: rank 0 reads the file `src` once; every rank returns its bytes,
// checked chunk by chunk as above.
Expected<std::string> broadcast_file(Communicator& world, const std::string& src, const BcastOptions& options = {});

// Every rank reading SRC itself instead (`pacer bcast --compare`), timed
// between two barriers: what a broadcast saves the source.
struct ReadComparison {
  std::uint64_t bytes_read = 0;  // by all ranks together
  double seconds = 0;
};

// One broadcast as rank 0 reports it: the record of `pacer bcast --json`
// (schema pacer.bcast/1, fields in docs/run.md).
struct BcastReport {
  std::string src;
  std::string dst;
  int ranks = 1;
  std::uint64_t chunk_bytes = 0;
  BcastStats stats;                                 // rank 0's
  std::optional<ReadComparison> every_rank_reads;  // null in the record when not measured
};
nlohmann::json to_json(const BcastReport& r);

}  // namespace pacer::comm
