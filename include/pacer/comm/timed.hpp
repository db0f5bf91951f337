// Messages between ranks that give up at a deadline, for work that must end within a hard bound.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pacer/core/error.hpp"

namespace pacer::comm {

using Deadline = std::chrono::steady_clock::time_point;

// Point-to-point messages and an all-reduce, each of which returns at its
// deadline whether or not the peer answered. This is what lets `pacer vet
// --cluster` end within a Slurm health-check bound when one node hangs: a
// blocking collective would wait for the hung rank forever.
//
// Waiting polls, first yielding between polls for 200 ms (MPI moves data
// only while both ends call into it; latency tests need microseconds), then
// sleeping up to 20 ms between polls, so a rank that waits long does not
// steal CPU from measurements running beside it. An instance is used from one
// thread at a time. Messages with the same (peer, tag) arrive in send order.
class TimedComm {
 public:
  virtual ~TimedComm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Sends `data` to `peer`. False when the send had not completed at the
  // deadline; it stays pending (MPI cannot cancel a send), keeps `data` alive
  // and `abandoned()` becomes true.
  virtual bool send(int peer, int tag, std::shared_ptr<const std::string> data, Deadline deadline) = 0;
  // The next message from `peer` with `tag`, of any length; nullopt at the deadline.
  virtual std::optional<std::string> recv(int peer, int tag, Deadline deadline) = 0;
  // A message of exactly `buffer.size()` bytes into `buffer`; false at the
  // deadline or when the message has another length. A receive is posted only
  // once the message is there, so nothing is left pending at a deadline.
  virtual bool recv_into(int peer, int tag, std::span<char> buffer, Deadline deadline) = 0;

  // Element-wise sum of `*data` over every rank of this communicator, in
  // place. False at the deadline (the operation is left pending, keeps `data`
  // alive, and `abandoned()` becomes true).
  virtual bool all_reduce_sum(std::shared_ptr<std::vector<float>> data, Deadline deadline) = 0;

  // A communicator of the given ranks of this one (ascending, this rank among
  // them). Only those ranks take part, so ranks that stopped answering cannot
  // block it; every listed rank must call it with the same list.
  virtual Expected<std::unique_ptr<TimedComm>> subset(const std::vector<int>& ranks) = 0;

  // True once an operation was left pending at its deadline. Finalising MPI
  // then may block on the peer that never answered, so the caller should end
  // with `abort`.
  virtual bool abandoned() const = 0;
  // Ends this process now with exit status `code`, without MPI_Finalize,
  // which makes the launcher end every other rank of the job (mpirun always;
  // srun with --kill-on-bad-exit or --wait). mpirun reports such an exit as
  // 1 when `code` is 0.
  [[noreturn]] virtual void abort(int code) = 0;
};

// Every rank of MPI_COMM_WORLD (initialising MPI like `mpi_world`). Fails
// when pacer was built without MPI.
Expected<std::unique_ptr<TimedComm>> timed_world();
// A world of one rank: sends to itself are not supported; all-reduce is a no-op.
std::unique_ptr<TimedComm> timed_single_rank();

}  // namespace pacer::comm
