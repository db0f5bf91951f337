#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <thread>
#include <cstring>

#include "pacer/comm/collectives.hpp"

namespace pacer::comm {

std::size_t dtype_bytes(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kBF16: return 2;
    case DType::kI32: return 4;
    case DType::kU8: return 1;
  }
  return 1;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "fp32";
    case DType::kF64: return "fp64";
    case DType::kBF16: return "bf16";
    case DType::kI32: return "int32";
    case DType::kU8: return "uint8";
  }
  return "?";
}

Expected<DType> parse_dtype(const std::string& name) {
  for (DType t : {DType::kF32, DType::kF64, DType::kBF16, DType::kI32, DType::kU8})
    if (name == dtype_name(t)) return t;
  if (name == "float32" || name == "float") return DType::kF32;
  if (name == "bfloat16") return DType::kBF16;
  if (name == "fp16" || name == "float16") return DType::kBF16;  // same width; sums of fp16 are not modelled separately
  return Error{ErrorKind::kUsage, "unknown dtype '" + name + "' (expected fp32, fp64, bf16, int32 or uint8)"};
}

std::uint16_t to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

float from_bf16(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

Status Request::Impl::wait(double timeout_s) {
  // Polling rather than a blocking wait: a deadline can name a stuck
  // collective, and yielding leaves the core to the computation it overlaps.
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    auto r = test();
    if (!r) return r.error();
    if (*r) return {};
    if (timeout_s > 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_s) {
      // abandon() says what it found out (MPI: which ranks never arrived)
      // or did (NCCL: the communicator is aborted).
      const std::string found = abandon();
      return Error{ErrorKind::kRuntime, what() + " did not complete within " + fmt::format("{:g}", timeout_s) + " s: " +
                                            (found.empty() ? "another rank died, hangs, or called a different collective" : found)};
    }
    std::this_thread::yield();
  }
}

Request::~Request() {
  if (impl_) (void)impl_->wait(0);
}

Expected<bool> Request::test() {
  if (!impl_) return true;
  auto r = impl_->test();
  if (!r) {
    impl_.reset();
    return r.error();
  }
  if (*r) impl_.reset();
  return *r;
}

Status Request::wait(double timeout_s) {
  if (!impl_) return {};
  Status s = impl_->wait(timeout_s);
  impl_.reset();
  return s;
}

Expected<void*> Collectives::allocate(std::size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
  if (!p) return Error{ErrorKind::kRuntime, "out of host memory allocating " + std::to_string(bytes) + " bytes"};
  return p;
}
void Collectives::release(void* p) { std::free(p); }
Status Collectives::copy_from_host(void* dst, const void* src, std::size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
  return {};
}
Status Collectives::copy_to_host(void* dst, const void* src, std::size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
  return {};
}

Status all_reduce_host(Collectives& comm, std::vector<double>& values, ReduceOp op, double timeout_s) {
  if (values.empty()) return {};
  const std::size_t bytes = values.size() * sizeof(double);
  auto buf = comm.allocate(bytes);
  if (!buf) return buf.error();
  Status st = comm.copy_from_host(*buf, values.data(), bytes);
  if (st) {
    auto r = comm.all_reduce(*buf, *buf, values.size(), DType::kF64, op);
    st = r ? r->wait(timeout_s) : Status(r.error());
  }
  if (st) st = comm.copy_to_host(values.data(), *buf, bytes);
  comm.release(*buf);
  return st;
}

namespace {

class SingleCollectives final : public Collectives {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "single"; }
  Expected<Request> all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp) override {
    return copy(send, recv, count * dtype_bytes(t));
  }
  Expected<Request> reduce_scatter(const void* send, void* recv, std::size_t n, DType t, ReduceOp) override {
    return copy(send, recv, n * dtype_bytes(t));
  }
  Expected<Request> all_gather(const void* send, void* recv, std::size_t n, DType t) override {
    return copy(send, recv, n * dtype_bytes(t));
  }
  Expected<Request> broadcast(void*, std::size_t, DType, int root) override {
    if (root != 0) return Error{ErrorKind::kUsage, "broadcast root " + std::to_string(root) + " outside a world of 1 rank"};
    return Request{};
  }
  Expected<Request> all_to_all(const void* send, void* recv, std::size_t n, DType t) override {
    return copy(send, recv, n * dtype_bytes(t));
  }

 private:
  static Request copy(const void* send, void* recv, std::size_t bytes) {
    if (send != recv && bytes) std::memmove(recv, send, bytes);
    return Request{};
  }
};

}  // namespace

std::unique_ptr<Collectives> single_rank_collectives() { return std::make_unique<SingleCollectives>(); }

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return true;
  return false;
}

Expected<std::unique_ptr<Collectives>> open_collectives(const std::string& backend) {
  if (backend == "single") return single_rank_collectives();
  if (backend == "mpi") {
    // A process started without a launcher is a world of one: no MPI
    // singleton start-up (which needs a working runtime) for it.
    if (!built_with_mpi() || !launched_by_mpi()) return single_rank_collectives();
    return mpi_collectives();
  }
  if (backend == "nccl") {
    auto world = mpi_world();
    if (!world) return world.error();
    // The bootstrap communicator only carries the unique id; MPI stays
    // initialised for the process's lifetime, so it can go.
    return nccl_collectives(**world);
  }
  return Error{ErrorKind::kUsage, "unknown backend '" + backend + "' (expected mpi or nccl)"};
}

}  // namespace pacer::comm
