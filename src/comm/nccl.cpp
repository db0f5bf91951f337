#include "pacer/comm/collectives.hpp"

#ifdef PACER_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>

#include "pacer/hw/cuda_host.hpp"
#include "pacer/hw/libraries.hpp"
#endif

namespace pacer::comm {

#ifdef PACER_HAVE_NCCL
namespace {

// libnccl and libcudart are loaded at run time (by hw, which vet shares), so
// a pacer built on a CUDA machine still starts (and runs the MPI backend)
// where they are missing.
struct Api {
  void* nccl = nullptr;
#define PACER_FN(name) decltype(&::name) name = nullptr
  PACER_FN(ncclGetUniqueId);
  PACER_FN(ncclCommInitRank);
  PACER_FN(ncclCommDestroy);
  PACER_FN(ncclCommAbort);
  PACER_FN(ncclCommGetAsyncError);
  PACER_FN(ncclGetErrorString);
  PACER_FN(ncclAllReduce);
  PACER_FN(ncclReduceScatter);
  PACER_FN(ncclAllGather);
  PACER_FN(ncclBroadcast);
  PACER_FN(ncclSend);
  PACER_FN(ncclRecv);
  PACER_FN(ncclGroupStart);
  PACER_FN(ncclGroupEnd);
  PACER_FN(cudaGetDeviceCount);
  PACER_FN(cudaSetDevice);
  PACER_FN(cudaStreamCreateWithFlags);
  PACER_FN(cudaStreamDestroy);
  PACER_FN(cudaEventCreateWithFlags);
  PACER_FN(cudaEventRecord);
  PACER_FN(cudaEventQuery);
  PACER_FN(cudaEventDestroy);
  // cuda_runtime.h also declares a template cudaMalloc; name the C one.
  cudaError_t (*cudaMalloc)(void**, size_t) = nullptr;
  PACER_FN(cudaFree);
  PACER_FN(cudaMemcpyAsync);
  PACER_FN(cudaStreamSynchronize);
  PACER_FN(cudaGetErrorString);
#undef PACER_FN
  std::string error;
};

const Api& api() {
  static const Api a = [] {
    Api a;
    const auto& lib = hw::nccl_library();
    if (!lib.handle) {
      a.error = lib.error;
      return a;
    }
    a.nccl = lib.handle;
    // The CUDA runtime hw uses for everything else (PyTorch's when it is
    // loaded), so device pointers and streams agree with the caller's.
    if (Status s = hw::cuda_runtime_loaded(); !s) {
      a.error = s.error().message;
      return a;
    }
    hw::SymbolBinder nccl(a.nccl, "the loaded NCCL");
    auto cuda = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(hw::cuda_runtime_symbol(name));
      if (!fn && a.error.empty()) a.error = std::string("the CUDA runtime lacks ") + name + " (too old?)";
    };
#define PACER_NCCL(name) nccl(a.name, #name)
#define PACER_CUDA(name) cuda(a.name, #name)
    PACER_NCCL(ncclGetUniqueId); PACER_NCCL(ncclCommInitRank); PACER_NCCL(ncclCommDestroy);
    PACER_NCCL(ncclCommAbort); PACER_NCCL(ncclCommGetAsyncError); PACER_NCCL(ncclGetErrorString);
    PACER_NCCL(ncclAllReduce); PACER_NCCL(ncclReduceScatter); PACER_NCCL(ncclAllGather);
    PACER_NCCL(ncclBroadcast); PACER_NCCL(ncclSend); PACER_NCCL(ncclRecv);
    PACER_NCCL(ncclGroupStart); PACER_NCCL(ncclGroupEnd);
    PACER_CUDA(cudaGetDeviceCount); PACER_CUDA(cudaSetDevice); PACER_CUDA(cudaStreamCreateWithFlags);
    PACER_CUDA(cudaStreamDestroy); PACER_CUDA(cudaEventCreateWithFlags); PACER_CUDA(cudaEventRecord);
    PACER_CUDA(cudaEventQuery); PACER_CUDA(cudaEventDestroy); PACER_CUDA(cudaMalloc); PACER_CUDA(cudaFree);
    PACER_CUDA(cudaMemcpyAsync); PACER_CUDA(cudaStreamSynchronize); PACER_CUDA(cudaGetErrorString);
#undef PACER_NCCL
#undef PACER_CUDA
    if (!nccl.ok()) a.error = nccl.error();
    return a;
  }();
  return a;
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kBF16: return ncclBfloat16;
    case DType::kI32: return ncclInt32;
    case DType::kU8: return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : op == ReduceOp::kMax ? ncclMax : ncclMin; }

class NcclRequest final : public Request::Impl {
 public:
  NcclRequest(ncclComm_t comm, cudaEvent_t ev, std::string what, int rank)
      : comm_(comm), ev_(ev), what_(std::move(what)), rank_(rank) {}
  ~NcclRequest() override { api().cudaEventDestroy(ev_); }
  Expected<bool> test() override {
    ncclResult_t async = ncclSuccess;
    api().ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress)
      return Error{ErrorKind::kRuntime, what() + ": " + api().ncclGetErrorString(async)};
    const cudaError_t e = api().cudaEventQuery(ev_);
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) return false;
    return Error{ErrorKind::kRuntime, what() + ": " + api().cudaGetErrorString(e)};
  }
  std::string what() const override { return what_ + " on rank " + std::to_string(rank_); }
  std::string abandon() override {
    // Without the abort the stuck kernel would hold the GPU forever.
    api().ncclCommAbort(comm_);
    return "another rank died, hangs, or called a different collective; the NCCL communicator is aborted";
  }

 private:
  ncclComm_t comm_;
  cudaEvent_t ev_;
  std::string what_;
  int rank_;
};

class NcclCollectives final : public Collectives {
 public:
  NcclCollectives(ncclComm_t comm, cudaStream_t stream, int rank, int size)
      : comm_(comm), stream_(stream), rank_(rank), size_(size) {}
  ~NcclCollectives() override {
    api().ncclCommDestroy(comm_);
    api().cudaStreamDestroy(stream_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  bool device_buffers() const override { return true; }

  Expected<Request> all_reduce(const void* send, void* recv, std::size_t n, DType t, ReduceOp op) override {
    return enqueue("all_reduce", n, t, api().ncclAllReduce(send, recv, n, nccl_type(t), nccl_op(op), comm_, stream_));
  }
  Expected<Request> reduce_scatter(const void* send, void* recv, std::size_t n, DType t, ReduceOp op) override {
    return enqueue("reduce_scatter", n * size_, t,
                   api().ncclReduceScatter(send, recv, n, nccl_type(t), nccl_op(op), comm_, stream_));
  }
  Expected<Request> all_gather(const void* send, void* recv, std::size_t n, DType t) override {
    return enqueue("all_gather", n * size_, t, api().ncclAllGather(send, recv, n, nccl_type(t), comm_, stream_));
  }
  Expected<Request> broadcast(void* buf, std::size_t n, DType t, int root) override {
    if (root < 0 || root >= size_)
      return Error{ErrorKind::kUsage, "broadcast root " + std::to_string(root) + " outside " + std::to_string(size_) + " ranks"};
    return enqueue("broadcast", n, t, api().ncclBroadcast(buf, buf, n, nccl_type(t), root, comm_, stream_));
  }
  Expected<Request> all_to_all(const void* send, void* recv, std::size_t n, DType t) override {
    const std::size_t block = n * dtype_bytes(t);
    ncclResult_t r = api().ncclGroupStart();
    for (int p = 0; p < size_ && r == ncclSuccess; ++p) {
      r = api().ncclSend(static_cast<const char*>(send) + p * block, n, nccl_type(t), p, comm_, stream_);
      if (r == ncclSuccess) r = api().ncclRecv(static_cast<char*>(recv) + p * block, n, nccl_type(t), p, comm_, stream_);
    }
    const ncclResult_t end = api().ncclGroupEnd();
    return enqueue("all_to_all", n * size_, t, r != ncclSuccess ? r : end);
  }

  Expected<void*> allocate(std::size_t bytes) override {
    void* p = nullptr;
    if (auto e = api().cudaMalloc(&p, std::max<std::size_t>(bytes, 1)); e != cudaSuccess)
      return Error{ErrorKind::kRuntime, "cudaMalloc of " + std::to_string(bytes) + " bytes on rank " +
                                            std::to_string(rank_) + ": " + api().cudaGetErrorString(e)};
    return p;
  }
  void release(void* p) override { api().cudaFree(p); }
  Status copy_from_host(void* dst, const void* src, std::size_t bytes) override { return copy(dst, src, bytes); }
  Status copy_to_host(void* dst, const void* src, std::size_t bytes) override { return copy(dst, src, bytes); }

 private:
  // On the collectives' own stream, then waited for. A plain cudaMemcpy from
  // pageable memory may return before its DMA has landed, and the legacy
  // stream it runs on does not order a non-blocking stream's kernels after
  // it: a collective then read the buffer's old contents (intermittent
  // wrong all-reduce results at 1-4 MiB on an H200).
  Status copy(void* dst, const void* src, std::size_t bytes) {
    cudaError_t e = api().cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_);
    if (e == cudaSuccess) e = api().cudaStreamSynchronize(stream_);
    if (e != cudaSuccess)
      return Error{ErrorKind::kRuntime, std::string("cudaMemcpy on rank ") + std::to_string(rank_) + ": " + api().cudaGetErrorString(e)};
    return {};
  }
  Expected<Request> enqueue(const char* what, std::size_t n, DType t, ncclResult_t r) {
    const std::string name = std::string(what) + " of " + std::to_string(n) + " " + dtype_name(t) + " elements";
    if (r != ncclSuccess)
      return Error{ErrorKind::kRuntime, name + " on rank " + std::to_string(rank_) + ": " + api().ncclGetErrorString(r)};
    cudaEvent_t ev;
    api().cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    api().cudaEventRecord(ev, stream_);
    return Request(std::make_unique<NcclRequest>(comm_, ev, name, rank_));
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_, size_;
};

int local_rank(int rank) {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK", "MPI_LOCALRANKID"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return rank;
}

}  // namespace

Expected<std::unique_ptr<Collectives>> nccl_collectives(Communicator& bootstrap, int device) {
  const Api& a = api();
  const std::string where = " on rank " + std::to_string(bootstrap.rank());
  if (!a.error.empty()) return Error{ErrorKind::kRuntime, a.error + where};
  int ngpu = 0;
  if (a.cudaGetDeviceCount(&ngpu) != cudaSuccess || ngpu == 0)
    return Error{ErrorKind::kRuntime, "no CUDA GPU visible" + where};
  if (device < 0) device = local_rank(bootstrap.rank()) % ngpu;
  if (auto e = a.cudaSetDevice(device); e != cudaSuccess)
    return Error{ErrorKind::kRuntime, "cudaSetDevice(" + std::to_string(device) + ")" + where + ": " + a.cudaGetErrorString(e)};
  ncclUniqueId id{};
  std::string raw;
  if (bootstrap.rank() == 0) {
    if (auto r = a.ncclGetUniqueId(&id); r != ncclSuccess)
      return Error{ErrorKind::kRuntime, std::string("ncclGetUniqueId") + where + ": " + a.ncclGetErrorString(r)};
    raw.assign(reinterpret_cast<const char*>(&id), sizeof id);
  }
  raw = bootstrap.broadcast(raw, 0);
  std::memcpy(&id, raw.data(), sizeof id);
  ncclComm_t comm;
  if (auto r = a.ncclCommInitRank(&comm, bootstrap.size(), id, bootstrap.rank()); r != ncclSuccess)
    return Error{ErrorKind::kRuntime, std::string("ncclCommInitRank") + where + ": " + a.ncclGetErrorString(r)};
  cudaStream_t stream;
  a.cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  return std::unique_ptr<Collectives>(new NcclCollectives(comm, stream, bootstrap.rank(), bootstrap.size()));
}
bool built_with_nccl() { return true; }
#else
Expected<std::unique_ptr<Collectives>> nccl_collectives(Communicator& bootstrap, int) {
  return Error{ErrorKind::kUsage, "pacer was built without NCCL (needs CUDA and nccl.h at build time; rank " +
                                      std::to_string(bootstrap.rank()) + ")"};
}
bool built_with_nccl() { return false; }
#endif

}  // namespace pacer::comm
