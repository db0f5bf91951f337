#include "pacer/comm/communicator.hpp"

#ifdef PACER_HAVE_MPI
#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#endif

namespace pacer::comm {

#ifdef PACER_HAVE_MPI
namespace {

// MPI_COMM_WORLD or a communicator split from it (which it frees).
class MpiComm final : public Communicator {
 public:
  explicit MpiComm(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiComm() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && !finalized) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void barrier() override { MPI_Barrier(comm_); }
  bool all_ok(bool ok) override {
    int in = ok ? 1 : 0;
    int out = 0;
    MPI_Allreduce(&in, &out, 1, MPI_INT, MPI_MIN, comm_);
    return out == 1;
  }
  std::string broadcast(const std::string& value, int root) override {
    unsigned long long n = value.size();
    MPI_Bcast(&n, 1, MPI_UNSIGNED_LONG_LONG, root, comm_);
    std::string out = rank_ == root ? value : std::string(n, '\0');
    if (n) broadcast_bytes(out.data(), n, root);
    return out;
  }
  void broadcast_bytes(void* data, std::size_t n, int root) override {
    // MPI counts are ints: large buffers go in pieces of 1 GiB.
    constexpr std::size_t kPiece = std::size_t{1} << 30;
    for (std::size_t off = 0; off < n; off += kPiece)
      MPI_Bcast(static_cast<char*>(data) + off, static_cast<int>(std::min(kPiece, n - off)), MPI_BYTE, root, comm_);
  }
  std::unique_ptr<Communicator> split_node() override {
    MPI_Comm node;
    MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node);
    return std::make_unique<MpiComm>(node, true);
  }
  std::unique_ptr<Communicator> split(int color) override {
    MPI_Comm out;
    MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, rank_, &out);
    if (out == MPI_COMM_NULL) return nullptr;
    return std::make_unique<MpiComm>(out, true);
  }

 private:
  MPI_Comm comm_;
  bool owned_ = false;
  int rank_ = 0;
  int size_ = 1;
};

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace

Expected<std::unique_ptr<Communicator>> mpi_world() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
      return Error{ErrorKind::kRuntime, "MPI_Init_thread failed"};
    std::atexit(finalize_at_exit);
  }
  return std::unique_ptr<Communicator>(new MpiComm(MPI_COMM_WORLD, false));
}

bool built_with_mpi() { return true; }
#else
Expected<std::unique_ptr<Communicator>> mpi_world() {
  return Error{ErrorKind::kUsage, "pacer was built without MPI (install libopenmpi-dev and rebuild)"};
}
bool built_with_mpi() { return false; }
#endif

}  // namespace pacer::comm
