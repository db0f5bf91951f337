#include "pacer/comm/collectives.hpp"

#ifdef PACER_HAVE_MPI
#include <mpi.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#endif

namespace pacer::comm {

#ifdef PACER_HAVE_MPI
namespace {

// bf16 has no MPI type: it travels as MPI_UINT16_T and is reduced by these
// user-defined operations, which accumulate each pair in fp32 and round once.
template <ReduceOp Op>
void bf16_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = from_bf16(a[i]), y = from_bf16(b[i]);
    float r = x + y;
    if constexpr (Op == ReduceOp::kMax) r = x > y ? x : y;
    if constexpr (Op == ReduceOp::kMin) r = x < y ? x : y;
    b[i] = to_bf16(r);
  }
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kF64: return MPI_DOUBLE;
    case DType::kBF16: return MPI_UINT16_T;
    case DType::kI32: return MPI_INT32_T;
    case DType::kU8: return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

// After a timeout, who else is stuck? Every rank that gives up on a
// collective tells every other rank which collective it gave up on, over a
// communicator of its own, and listens for the others for a grace period.
// Ranks that are stuck in the same collective time out at about the same
// time and answer; a rank that died, hangs or is somewhere else stays silent
// or names another collective. That turns "rank 0 timed out" into "rank 3
// never reached all_reduce #17".
struct Census {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  std::uint64_t next = 0;  // collectives issued so far, in call order (the same on every rank)
  static constexpr int kTag = 7301;

  std::string ask(std::uint64_t seq, const std::string& what, double grace_s) const {
    if (comm == MPI_COMM_NULL || size < 2) return "";
    // Small enough to go eagerly, completing even when the peer is dead; the
    // request is freed unwaited, so the buffer lives as long as the process.
    static auto* sent = new std::vector<std::unique_ptr<const std::string>>();
    static std::mutex sent_mu;
    const std::string* buffer;
    {
      std::lock_guard lk(sent_mu);
      sent->push_back(std::make_unique<const std::string>(std::to_string(seq) + " " + what));
      buffer = sent->back().get();
    }
    const std::string& mine = *buffer;
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      MPI_Request r;
      if (MPI_Isend(mine.data(), int(mine.size()), MPI_CHAR, p, kTag, comm, &r) == MPI_SUCCESS) MPI_Request_free(&r);
    }
    std::map<int, std::pair<std::uint64_t, std::string>> heard;
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s);
    while (std::chrono::steady_clock::now() < end && int(heard.size()) < size - 1) {
      int flag = 0;
      MPI_Status st;
      MPI_Iprobe(MPI_ANY_SOURCE, kTag, comm, &flag, &st);
      if (!flag) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      int n = 0;
      MPI_Get_count(&st, MPI_CHAR, &n);
      std::string msg(std::size_t(std::max(n, 0)), '\0');
      MPI_Recv(msg.data(), n, MPI_CHAR, st.MPI_SOURCE, kTag, comm, MPI_STATUS_IGNORE);
      std::istringstream in(msg);
      std::uint64_t theirs = 0;
      in >> theirs;
      std::string op;
      std::getline(in >> std::ws, op);
      heard[st.MPI_SOURCE] = {theirs, op};
    }
    std::vector<int> silent, same;
    std::vector<std::string> elsewhere;
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      auto it = heard.find(p);
      if (it == heard.end()) silent.push_back(p);
      else if (it->second.first == seq) same.push_back(p);
      else elsewhere.push_back(fmt::format("rank {} gave up on collective #{} ({})", p, it->second.first, it->second.second));
    }
    std::vector<std::string> parts;
    if (!silent.empty())
      parts.push_back(fmt::format("{} {} did not reach it (dead, hung, or still computing: silent for {:g} s after this rank gave up)",
                                  silent.size() == 1 ? "rank" : "ranks", fmt::join(silent, ", "), grace_s));
    parts.insert(parts.end(), elsewhere.begin(), elsewhere.end());
    if (!same.empty())
      parts.push_back(fmt::format("{} {} {} stuck in it too", same.size() == 1 ? "rank" : "ranks", fmt::join(same, ", "),
                                  same.size() == 1 ? "is" : "are"));
    if (silent.empty() && elsewhere.empty())
      parts.push_back("every rank reached it: a rank passed different counts or types, or the network failed");
    return fmt::format("collective #{}: {}", seq, fmt::join(parts, "; "));
  }
};

// MPI's non-blocking collectives (libnbc in Open MPI) run their own
// schedules, measured 1.5-3x slower than the tuned blocking algorithms on
// shared memory. So a request starts lazily: test() starts the non-blocking
// collective (the overlap path), while wait() on a request nobody tested runs
// the blocking one. A wait with a timeout must be able to give up, so it
// always takes the non-blocking path.
class MpiRequest final : public Request::Impl {
 public:
  using Start = std::function<int(MPI_Request*)>;
  using Blocking = std::function<int()>;
  MpiRequest(Start start, Blocking blocking, std::string what, int rank, std::shared_ptr<const Census> census, std::uint64_t seq)
      : start_(std::move(start)),
        blocking_(std::move(blocking)),
        what_(std::move(what)),
        rank_(rank),
        census_(std::move(census)),
        seq_(seq) {}
  ~MpiRequest() override {
    // Abandoned after a timeout. MPI forbids freeing a non-blocking
    // collective's request, so it is parked (and leaked) instead: the job is
    // expected to end, and MPI may still complete it if the peers arrive.
    if (req_ != MPI_REQUEST_NULL) {
      static auto* parked = new std::vector<MPI_Request>();
      parked->push_back(req_);
    }
  }
  Expected<bool> test() override {
    if (!started_) {
      started_ = true;
      if (start_(&req_) != MPI_SUCCESS) return fail("failed to start");
    }
    int done = 0;
    if (MPI_Test(&req_, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return fail("failed");
    return done != 0;
  }
  Status wait(double timeout_s) override {
    timeout_s_ = timeout_s;
    if (started_ || timeout_s > 0) return Request::Impl::wait(timeout_s);
    started_ = true;
    if (blocking_() != MPI_SUCCESS) return fail("failed");
    return {};
  }
  std::string what() const override { return what_ + " on rank " + std::to_string(rank_); }
  std::string abandon() override {
    // Long enough for the other stuck ranks' own timeouts to fire.
    return census_ ? census_->ask(seq_, what_, std::clamp(0.25 * timeout_s_, 0.5, 5.0)) : "";
  }

 private:
  Error fail(const std::string& how) { return Error{ErrorKind::kRuntime, what() + " " + how}; }
  Start start_;
  Blocking blocking_;
  MPI_Request req_ = MPI_REQUEST_NULL;
  bool started_ = false;
  std::string what_;
  int rank_;
  std::shared_ptr<const Census> census_;
  std::uint64_t seq_;
  double timeout_s_ = 0;
};

class MpiCollectives final : public Collectives {
 public:
  MpiCollectives() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    MPI_Op_create(&bf16_reduce<ReduceOp::kSum>, 1, &bf16_ops_[0]);
    MPI_Op_create(&bf16_reduce<ReduceOp::kMax>, 1, &bf16_ops_[1]);
    MPI_Op_create(&bf16_reduce<ReduceOp::kMin>, 1, &bf16_ops_[2]);
    auto census = std::make_shared<Census>();
    census->rank = rank_;
    census->size = size_;
    // Collective: every rank opens its Collectives together, as with MPI_Init.
    MPI_Comm_dup(MPI_COMM_WORLD, &census->comm);
    // A send to a dead peer must come back as an error code, not abort this rank.
    MPI_Comm_set_errhandler(census->comm, MPI_ERRORS_RETURN);
    census_ = census;
  }
  ~MpiCollectives() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      for (auto& op : bf16_ops_) MPI_Op_free(&op);
      // Marks it for deallocation and sets the handle to MPI_COMM_NULL, which
      // a request parked after a timeout (sharing the Census) then sees.
      MPI_Comm_free(&census_->comm);
    }
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }
  bool other_threads_may_call() const override {
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    return level >= MPI_THREAD_SERIALIZED;
  }

  Expected<Request> all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) override {
    if (auto e = check_count("all_reduce", count)) return *e;
    const void* in = send == recv ? MPI_IN_PLACE : send;
    const MPI_Datatype dt = mpi_type(t);
    const MPI_Op o = mpi_op(t, op);
    const int c = int(count);
    return wrap([=](MPI_Request* r) { return MPI_Iallreduce(in, recv, c, dt, o, MPI_COMM_WORLD, r); },
                [=] { return MPI_Allreduce(in, recv, c, dt, o, MPI_COMM_WORLD); }, "all_reduce", count, t);
  }
  Expected<Request> reduce_scatter(const void* send, void* recv, std::size_t n, DType t, ReduceOp op) override {
    if (auto e = check_count("reduce_scatter", n * size_)) return *e;
    const MPI_Datatype dt = mpi_type(t);
    const MPI_Op o = mpi_op(t, op);
    const int c = int(n);
    return wrap([=](MPI_Request* r) { return MPI_Ireduce_scatter_block(send, recv, c, dt, o, MPI_COMM_WORLD, r); },
                [=] { return MPI_Reduce_scatter_block(send, recv, c, dt, o, MPI_COMM_WORLD); }, "reduce_scatter",
                n * size_, t);
  }
  Expected<Request> all_gather(const void* send, void* recv, std::size_t n, DType t) override {
    if (auto e = check_count("all_gather", n * size_)) return *e;
    const MPI_Datatype dt = mpi_type(t);
    const int c = int(n);
    return wrap([=](MPI_Request* r) { return MPI_Iallgather(send, c, dt, recv, c, dt, MPI_COMM_WORLD, r); },
                [=] { return MPI_Allgather(send, c, dt, recv, c, dt, MPI_COMM_WORLD); }, "all_gather", n * size_, t);
  }
  Expected<Request> broadcast(void* buf, std::size_t n, DType t, int root) override {
    if (auto e = check_count("broadcast", n)) return *e;
    if (root < 0 || root >= size_)
      return Error{ErrorKind::kUsage, "broadcast root " + std::to_string(root) + " outside " + std::to_string(size_) + " ranks"};
    const MPI_Datatype dt = mpi_type(t);
    const int c = int(n);
    return wrap([=](MPI_Request* r) { return MPI_Ibcast(buf, c, dt, root, MPI_COMM_WORLD, r); },
                [=] { return MPI_Bcast(buf, c, dt, root, MPI_COMM_WORLD); }, "broadcast", n, t);
  }
  Expected<Request> all_to_all(const void* send, void* recv, std::size_t n, DType t) override {
    if (auto e = check_count("all_to_all", n * size_)) return *e;
    const MPI_Datatype dt = mpi_type(t);
    const int c = int(n);
    return wrap([=](MPI_Request* r) { return MPI_Ialltoall(send, c, dt, recv, c, dt, MPI_COMM_WORLD, r); },
                [=] { return MPI_Alltoall(send, c, dt, recv, c, dt, MPI_COMM_WORLD); }, "all_to_all", n * size_, t);
  }

 private:
  MPI_Op mpi_op(DType t, ReduceOp op) const {
    if (t == DType::kBF16) return bf16_ops_[static_cast<int>(op)];
    return op == ReduceOp::kSum ? MPI_SUM : op == ReduceOp::kMax ? MPI_MAX : MPI_MIN;
  }
  std::optional<Error> check_count(const char* what, std::size_t count) const {
    if (count > static_cast<std::size_t>(INT_MAX))
      return Error{ErrorKind::kUsage, std::string(what) + " of " + std::to_string(count) +
                                          " elements: MPI counts stop at 2^31-1; split the buffer"};
    return std::nullopt;
  }
  Request wrap(MpiRequest::Start start, MpiRequest::Blocking blocking, const char* what, std::size_t count, DType t) {
    return Request(std::make_unique<MpiRequest>(std::move(start), std::move(blocking),
                                                std::string(what) + " of " + std::to_string(count) + " " + dtype_name(t) + " elements",
                                                rank_, census_, ++census_->next));
  }

  int rank_ = 0, size_ = 1;
  MPI_Op bf16_ops_[3]{};
  std::shared_ptr<Census> census_;
};

}  // namespace

Expected<std::unique_ptr<Collectives>> mpi_collectives() {
  // mpi_world() initialises MPI once per process with the thread level pacer needs.
  auto world = mpi_world();
  if (!world) return world.error();
  return std::unique_ptr<Collectives>(new MpiCollectives());
}
#else
Expected<std::unique_ptr<Collectives>> mpi_collectives() {
  return Error{ErrorKind::kUsage, "pacer was built without MPI (install libopenmpi-dev and rebuild)"};
}
#endif

}  // namespace pacer::comm
