#include "pacer/comm/timed.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "pacer/comm/communicator.hpp"

#ifdef PACER_HAVE_MPI
#include <mpi.h>
#endif

namespace pacer::comm {
namespace {

using Clock = std::chrono::steady_clock;

// Polls without sleeping for the first 200 ms, yielding the CPU between
// polls: MPI moves a large message only while both ends call into it, and a
// round trip of a latency test is microseconds. After that the wait is for a
// slow or hung peer, and naps growing to 20 ms keep it from stealing CPU from
// measurements running beside it.
template <class Poll>
bool poll_until(Poll&& done, Deadline deadline) {
  const auto start = Clock::now();
  auto nap = std::chrono::microseconds(100);
  for (;;) {
    if (done()) return true;
    const auto now = Clock::now();
    if (now >= deadline) return false;
    if (now - start < std::chrono::milliseconds(200)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::min<Clock::duration>(nap, deadline - now));
      nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::milliseconds(20));
    }
  }
}

class SingleTimed final : public TimedComm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  bool send(int, int, std::shared_ptr<const std::string>, Deadline) override { return false; }
  std::optional<std::string> recv(int, int, Deadline) override { return std::nullopt; }
  bool recv_into(int, int, std::span<char>, Deadline) override { return false; }
  bool all_reduce_sum(std::shared_ptr<std::vector<float>>, Deadline) override { return true; }
  Expected<std::unique_ptr<TimedComm>> subset(const std::vector<int>& ranks) override {
    if (ranks != std::vector<int>{0}) return Error{ErrorKind::kRuntime, "subset of a single rank must be {0}"};
    return std::unique_ptr<TimedComm>(new SingleTimed());
  }
  bool abandoned() const override { return false; }
  [[noreturn]] void abort(int code) override { std::_Exit(code); }
};

#ifdef PACER_HAVE_MPI
// Operations left pending at a deadline, with the buffers they still use.
// Shared by a communicator and its subsets.
struct Pending {
  std::vector<MPI_Request> requests;
  std::vector<std::shared_ptr<const void>> buffers;
  bool any() const { return !requests.empty(); }
};

class MpiTimed final : public TimedComm {
 public:
  MpiTimed(MPI_Comm comm, bool owned, std::shared_ptr<Pending> pending)
      : comm_(comm), owned_(owned), pending_(std::move(pending)) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiTimed() override {
    if (pending_->any()) {
      // MPI may still write into these buffers (in MPI_Finalize, or until
      // MPI_Abort), so they and the communicator outlive every owner.
      // Never destroyed: static destructors run before MPI_Finalize's atexit handler.
      static auto* kept = new std::vector<std::shared_ptr<Pending>>();
      kept->push_back(pending_);
      return;
    }
    if (owned_) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  bool send(int peer, int tag, std::shared_ptr<const std::string> data, Deadline deadline) override {
    MPI_Request req;
    MPI_Isend(data->data(), static_cast<int>(data->size()), MPI_BYTE, peer, tag, comm_, &req);
    return finish(req, std::move(data), deadline);
  }

  std::optional<std::string> recv(int peer, int tag, Deadline deadline) override {
    MPI_Message msg;
    MPI_Status st;
    if (!probe(peer, tag, deadline, msg, st)) return std::nullopt;
    int n = 0;
    MPI_Get_count(&st, MPI_BYTE, &n);
    std::string out(static_cast<std::size_t>(n), '\0');
    MPI_Mrecv(out.data(), n, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
    return out;
  }

  bool recv_into(int peer, int tag, std::span<char> buffer, Deadline deadline) override {
    MPI_Message msg;
    MPI_Status st;
    if (!probe(peer, tag, deadline, msg, st)) return false;
    int n = 0;
    MPI_Get_count(&st, MPI_BYTE, &n);
    if (static_cast<std::size_t>(n) != buffer.size()) {
      std::string discard(static_cast<std::size_t>(n), '\0');
      MPI_Mrecv(discard.data(), n, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
      return false;
    }
    MPI_Mrecv(buffer.data(), n, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
    return true;
  }

  bool all_reduce_sum(std::shared_ptr<std::vector<float>> data, Deadline deadline) override {
    MPI_Request req;
    MPI_Iallreduce(MPI_IN_PLACE, data->data(), static_cast<int>(data->size()), MPI_FLOAT, MPI_SUM, comm_, &req);
    return finish(req, std::move(data), deadline);
  }

  Expected<std::unique_ptr<TimedComm>> subset(const std::vector<int>& ranks) override {
    MPI_Group all, part;
    MPI_Comm_group(comm_, &all);
    MPI_Group_incl(all, static_cast<int>(ranks.size()), ranks.data(), &part);
    MPI_Comm sub = MPI_COMM_NULL;
    const int rc = MPI_Comm_create_group(comm_, part, kSubsetTag, &sub);
    MPI_Group_free(&part);
    MPI_Group_free(&all);
    if (rc != MPI_SUCCESS || sub == MPI_COMM_NULL)
      return Error{ErrorKind::kRuntime, fmt::format("rank {}: MPI_Comm_create_group of {} ranks failed", rank_, ranks.size())};
    return std::unique_ptr<TimedComm>(new MpiTimed(sub, true, pending_));
  }

  bool abandoned() const override { return pending_->any(); }
  [[noreturn]] void abort(int code) override {
    // Leaving without MPI_Finalize makes the launcher end the whole job.
    // MPI_Abort would too, but Open MPI 4.1's mpirun was seen to crash or
    // hang after it when the aborting rank had forked probe processes.
    std::fflush(nullptr);
    std::_Exit(code);
  }

 private:
  static constexpr int kSubsetTag = 0x7e57;

  bool probe(int peer, int tag, Deadline deadline, MPI_Message& msg, MPI_Status& st) {
    return poll_until(
        [&] {
          int found = 0;
          MPI_Improbe(peer, tag, comm_, &found, &msg, &st);
          return found != 0;
        },
        deadline);
  }

  bool finish(MPI_Request req, std::shared_ptr<const void> buffer, Deadline deadline) {
    const bool done = poll_until(
        [&] {
          int flag = 0;
          MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
          return flag != 0;
        },
        deadline);
    if (!done) {
      pending_->requests.push_back(req);
      pending_->buffers.push_back(std::move(buffer));
    }
    return done;
  }

  MPI_Comm comm_;
  bool owned_;
  std::shared_ptr<Pending> pending_;
  int rank_ = 0;
  int size_ = 1;
};
#endif

}  // namespace

std::unique_ptr<TimedComm> timed_single_rank() { return std::make_unique<SingleTimed>(); }

Expected<std::unique_ptr<TimedComm>> timed_world() {
#ifdef PACER_HAVE_MPI
  // mpi_world initialises MPI (and finalises it at exit) the one way pacer does.
  auto world = mpi_world();
  if (!world) return world.error();
  return std::unique_ptr<TimedComm>(new MpiTimed(MPI_COMM_WORLD, false, std::make_shared<Pending>()));
#else
  return mpi_world().error();
#endif
}

}  // namespace pacer::comm
