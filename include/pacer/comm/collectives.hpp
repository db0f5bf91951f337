// Data collectives on buffers (all-reduce, reduce-scatter, all-gather, broadcast, all-to-all), non-blocking, over MPI or NCCL.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pacer/comm/communicator.hpp"
#include "pacer/core/error.hpp"

namespace pacer::comm {

// Element types the collectives move. kBF16 is the upper half of an IEEE
// float (round to nearest even on conversion); MPI sums it through a
// user-defined operation that accumulates each pair in fp32.
enum class DType { kF32, kF64, kBF16, kI32, kU8 };
std::size_t dtype_bytes(DType t);
const char* dtype_name(DType t);
Expected<DType> parse_dtype(const std::string& name);  // "fp32", "fp64", "bf16", "int32", "uint8"

enum class ReduceOp { kSum, kMax, kMin };

// One collective in flight. Move-only. The buffers passed to the call that
// returned it must stay alive and untouched until wait() returns or test()
// returns true. A default-constructed Request is complete.
class Request {
 public:
  class Impl {
   public:
    virtual ~Impl() = default;
    // True when complete; an error when the collective failed.
    virtual Expected<bool> test() = 0;
    // "all_reduce of N fp32 elements on rank R", for errors.
    virtual std::string what() const = 0;
    // Called once a wait has timed out; returns what was done about it.
    virtual std::string abandon() { return ""; }
    // Blocks until complete, polling test() (which also drives MPI's
    // progress); a timeout error naming the operation and this rank after
    // `timeout_s` seconds when timeout_s > 0.
    virtual Status wait(double timeout_s);
  };

  Request() = default;
  explicit Request(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
  Request(Request&&) noexcept = default;
  Request& operator=(Request&&) noexcept = default;
  // A request dropped while in flight is waited for: MPI and NCCL would write
  // into buffers the caller may already have freed otherwise.
  ~Request();

  Expected<bool> test();
  // After a failure or timeout the collective is abandoned: its buffers must
  // not be reused and the job should end (the other ranks are stuck in it).
  Status wait(double timeout_s = 0);
  bool pending() const { return impl_ != nullptr; }

 private:
  std::unique_ptr<Impl> impl_;
};

// Collectives on data buffers. Every rank calls the same collectives in the
// same order with the same counts and dtypes (mismatches are undefined in MPI
// and NCCL; the GradientReducer checks its layout across ranks once). Calls
// return at once with a Request. Buffers live where device_buffers() says:
// host memory for MPI, GPU memory for NCCL. Counts are elements. An instance
// is used from one thread at a time.
class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;  // "single", "mpi", "nccl"
  virtual bool device_buffers() const { return false; }
  // Whether a thread other than the one that initialised the backend may
  // make its calls (one at a time): false for MPI initialised below
  // MPI_THREAD_SERIALIZED by someone else. GradientReducer's progress thread
  // needs it.
  virtual bool other_threads_may_call() const { return true; }

  // recv[i] = op over ranks of send[i], i < count. send == recv is in place.
  virtual Expected<Request> all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) = 0;
  // recv = this rank's slice (recv_count elements) of the reduction of send
  // (size() * recv_count elements).
  virtual Expected<Request> reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType t,
                                           ReduceOp op) = 0;
  // recv = the send buffers (send_count elements each) of ranks 0..size()-1, in order.
  virtual Expected<Request> all_gather(const void* send, void* recv, std::size_t send_count, DType t) = 0;
  // buf of rank `root`, on every rank.
  virtual Expected<Request> broadcast(void* buf, std::size_t count, DType t, int root) = 0;
  // Block j of send (count elements) goes to rank j; recv block j comes from rank j.
  virtual Expected<Request> all_to_all(const void* send, void* recv, std::size_t count, DType t) = 0;

  // Buffers of the kind the collectives take (host or device), and copies
  // between host and those buffers, so callers stay backend-agnostic.
  virtual Expected<void*> allocate(std::size_t bytes);
  virtual void release(void* p);
  virtual Status copy_from_host(void* dst, const void* src, std::size_t bytes);
  virtual Status copy_to_host(void* dst, const void* src, std::size_t bytes);
};

// Blocking all-reduce of a few host values (layout checks, timing
// summaries), through the backend's own buffers. Collective.
Status all_reduce_host(Collectives& comm, std::vector<double>& values, ReduceOp op, double timeout_s = 0);

// A world of one rank: collectives copy send to recv and complete at once.
std::unique_ptr<Collectives> single_rank_collectives();

// Over MPI_COMM_WORLD (initialising MPI like mpi_world()). Collective: every
// rank opens it, in the same order as its other collectives (it duplicates
// the world communicator for the timeout census, docs/comm.md). Non-blocking
// collectives progress when the Request is tested or waited for; see
// docs/comm.md for why callers test from time to time.
Expected<std::unique_ptr<Collectives>> mpi_collectives();

// Over NCCL on GPU `device` (-1: local rank modulo GPU count), with the
// unique id broadcast through `bootstrap` (an MPI world). Fails with a clear
// error when pacer was built without NCCL or libnccl/libcudart cannot be
// loaded.
Expected<std::unique_ptr<Collectives>> nccl_collectives(Communicator& bootstrap, int device = -1);
bool built_with_nccl();

// True when an MPI launcher (mpirun, srun with PMI/PMIx) started this process.
bool launched_by_mpi();

// "mpi" (a single rank when pacer has no MPI or was not started by an MPI
// launcher), "nccl" or "single".
Expected<std::unique_ptr<Collectives>> open_collectives(const std::string& backend);

// bf16 <-> fp32 (round to nearest even; NaN stays NaN).
std::uint16_t to_bf16(float f);
float from_bf16(std::uint16_t b);

}  // namespace pacer::comm
