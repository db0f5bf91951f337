// The one communicator pacer uses across ranks: MPI when built with it, a single rank otherwise.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "pacer/core/error.hpp"

namespace pacer::comm {

// Collective operations every rank must call in the same order. Calls are
// blocking. An instance is used from one thread at a time.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void barrier() = 0;
  // True on every rank when `ok` is true on every rank.
  virtual bool all_ok(bool ok) = 0;
  // `value` of rank `root`, on every rank.
  virtual std::string broadcast(const std::string& value, int root) = 0;
  // `n` bytes of rank `root` into `data` on every rank (every rank passes the
  // same n). The default goes through broadcast(); MPI sends the bytes as they are.
  virtual void broadcast_bytes(void* data, std::size_t n, int root);
  // The ranks on this node (sharing memory), ordered by rank; nullptr where
  // the communicator cannot tell nodes apart.
  virtual std::unique_ptr<Communicator> split_node();
  // The ranks that passed the same `color` (>= 0), ordered by rank; nullptr
  // for a negative color or where splitting is not supported.
  virtual std::unique_ptr<Communicator> split(int color);
};

// A world of one rank: every collective returns at once.
std::unique_ptr<Communicator> single_rank();

// MPI_COMM_WORLD. Initialises MPI (and finalises it at exit) unless the
// caller already did. Fails when pacer was built without MPI.
Expected<std::unique_ptr<Communicator>> mpi_world();
bool built_with_mpi();

}  // namespace pacer::comm
