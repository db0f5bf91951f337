#include "pacer/comm/communicator.hpp"

#ifdef PACER_HAVE_MPI
#include <mpi.h>

#include <cstdlib>
#endif

namespace pacer::comm {

#ifdef PACER_HAVE_MPI
namespace {

class MpiWorld final : public Communicator {
 public:
  MpiWorld() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void barrier() override { MPI_Barrier(MPI_COMM_WORLD); }
  bool all_ok(bool ok) override {
    int in = ok ? 1 : 0;
    int out = 0;
    MPI_Allreduce(&in, &out, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    return out == 1;
  }
  std::string broadcast(const std::string& value, int root) override {
    unsigned long long n = value.size();
    MPI_Bcast(&n, 1, MPI_UNSIGNED_LONG_LONG, root, MPI_COMM_WORLD);
    std::string out = rank_ == root ? value : std::string(n, '\0');
    if (n) MPI_Bcast(out.data(), static_cast<int>(n), MPI_CHAR, root, MPI_COMM_WORLD);
    return out;
  }

 private:
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
  return std::unique_ptr<Communicator>(new MpiWorld());
}

bool built_with_mpi() { return true; }
#else
Expected<std::unique_ptr<Communicator>> mpi_world() {
  return Error{ErrorKind::kUsage, "pacer was built without MPI (install libopenmpi-dev and rebuild)"};
}
bool built_with_mpi() { return false; }
#endif

}  // namespace pacer::comm
