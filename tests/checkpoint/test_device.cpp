// Device blobs: CUDA memory copied into the staging pool on a side stream after the producer stream; GPU tests skip without one.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include "blobs.hpp"
#include "pacer/checkpoint.hpp"
#include "pacer/hw/cuda_host.hpp"
#include "test_util.hpp"
#include "thread_comm.hpp"

namespace pacer::ckpt {
namespace {

namespace fs = std::filesystem;
using test::contains;
using test::TempDir;
using test_blobs::pattern;
using test_blobs::read_all;
using test_blobs::small_options;
using test_blobs::view;

constexpr int kHostToDevice = 1;  // cudaMemcpyHostToDevice

// The runtime calls the tests make, from the same dlopen'd runtime the
// checkpointer copies with.
struct Cuda {
  int (*alloc)(void**, std::size_t) = nullptr;
  int (*release)(void*) = nullptr;
  int (*copy)(void*, const void*, std::size_t, int) = nullptr;
  int (*memset_async)(void*, int, std::size_t, void*) = nullptr;
  int (*stream_create)(void**, unsigned) = nullptr;
  int (*stream_destroy)(void*) = nullptr;
  int (*stream_synchronize)(void*) = nullptr;
  int (*launch_host_func)(void*, void (*)(void*), void*) = nullptr;
  int (*get_device)(int*) = nullptr;
  int (*set_device)(int) = nullptr;
  int (*get_device_count)(int*) = nullptr;
};

template <class Fn>
bool load(Fn& fn, const char* name) {
  fn = reinterpret_cast<Fn>(hw::cuda_runtime_symbol(name));
  return fn != nullptr;
}

// The runtime, or nothing when there is no usable GPU (the test skips).
std::optional<Cuda> gpu() {
  if (!hw::cuda_device_usable(0)) return std::nullopt;
  Cuda c;
  const bool all = load(c.alloc, "cudaMalloc") && load(c.release, "cudaFree") && load(c.copy, "cudaMemcpy") &&
                   load(c.memset_async, "cudaMemsetAsync") && load(c.stream_create, "cudaStreamCreateWithFlags") &&
                   load(c.stream_destroy, "cudaStreamDestroy") && load(c.stream_synchronize, "cudaStreamSynchronize") &&
                   load(c.launch_host_func, "cudaLaunchHostFunc") && load(c.get_device, "cudaGetDevice") &&
                   load(c.set_device, "cudaSetDevice") && load(c.get_device_count, "cudaGetDeviceCount");
  if (!all) return std::nullopt;
  return c;
}

#define REQUIRE_GPU(c)                                                    \
  auto c##_opt = gpu();                                                   \
  if (!c##_opt) GTEST_SKIP() << "no CUDA runtime or GPU: " << hw::cuda_device_usable(0).error().message; \
  Cuda& c = *c##_opt

// Device memory holding `bytes`, freed at scope exit.
struct DeviceBuffer {
  DeviceBuffer(const Cuda& c, const std::vector<unsigned char>& bytes) : cuda(c), size(bytes.size()) {
    EXPECT_EQ(cuda.alloc(&ptr, std::max<std::size_t>(size, 1)), 0);
    if (size) {
      EXPECT_EQ(cuda.copy(ptr, bytes.data(), size, kHostToDevice), 0);
    }
  }
  ~DeviceBuffer() { cuda.release(ptr); }
  BlobView blob(const std::string& name) const {
    BlobView v;
    v.name = name;
    v.data = ptr;
    v.size = size;
    v.device = 0;
    return v;
  }
  const Cuda& cuda;
  void* ptr = nullptr;
  std::size_t size = 0;
};

TEST(CheckpointerDevice, BlobOnADeviceThatIsNotThereIsAnErrorNamingIt) {
  TempDir dir("pacer-ckpt-dev-");
  auto ck = Checkpointer::open(small_options(dir.path())).value();
  const auto host = pattern(5000, 1);
  BlobView b = view("model/w", host);
  b.device = 4096;  // no machine has this device: with CUDA or without
  auto h = ck->save(1, {view("other", host), b});
  ASSERT_FALSE(h);
  EXPECT_TRUE(contains(h.error().message, "blob 'model/w'")) << h.error().message;
  EXPECT_TRUE(contains(h.error().message, "device 4096")) << h.error().message;
  EXPECT_TRUE(list(dir.path(), false).empty()) << "a refused save leaves nothing";
  EXPECT_FALSE(ck->latest());
}

TEST(CheckpointerDevice, WithoutCudaADeviceBlobIsAnErrorNamingIt) {
  if (hw::cuda_device_usable(0)) GTEST_SKIP() << "a GPU is here: see the device tests";
  TempDir dir("pacer-ckpt-dev-");
  auto ck = Checkpointer::open(small_options(dir.path())).value();
  const auto host = pattern(5000, 1);
  BlobView b = view("optim/exp_avg", host);
  b.device = 0;
  auto h = ck->save(1, {b});
  ASSERT_FALSE(h);
  const std::string& msg = h.error().message;
  EXPECT_TRUE(contains(msg, "blob 'optim/exp_avg' is CUDA memory of device 0")) << msg;
  EXPECT_TRUE(contains(msg, "CUDA")) << msg;
  EXPECT_TRUE(list(dir.path(), false).empty());
  // The checkpointer still saves host blobs.
  ASSERT_TRUE(ck->save(1, {view("x", host)})->wait());
}

TEST(CheckpointerDevice, SavesDeviceBlobsByteForByte) {
  REQUIRE_GPU(cuda);
  TempDir dir("pacer-ckpt-dev-");
  auto ck = Checkpointer::open(small_options(dir.path())).value();  // 64 KiB of staging in 4 KiB chunks
  const auto a = pattern(10001, 1);
  const auto big = pattern(300000, 2);  // several times the staging pool
  const auto host = pattern(7000, 3);
  DeviceBuffer da(cuda, a), dbig(cuda, big), dempty(cuda, {});
  auto h = ck->save(3, {da.blob("a"), view("host", host), dbig.blob("big"), dempty.blob("empty")});
  ASSERT_TRUE(h) << h.error().message;
  // save() has returned: the copies have landed, the caller may overwrite its tensors.
  const std::vector<unsigned char> zeros(big.size(), 0);
  ASSERT_EQ(cuda.copy(dbig.ptr, zeros.data(), zeros.size(), kHostToDevice), 0);
  ASSERT_TRUE(h->wait());
  auto r = ck->open_reader(3).value();
  EXPECT_EQ(read_all(r, "a", a.size()), a);
  EXPECT_EQ(read_all(r, "big", big.size()), big);
  EXPECT_EQ(read_all(r, "host", host.size()), host);
  EXPECT_EQ(r.logical_blobs().size(), 4u);
  const auto s = ck->stats();
  EXPECT_EQ(s.bytes_staged, a.size() + big.size() + host.size());
  EXPECT_GT(s.pinned_bytes, 0u) << "staging is page-locked, for asynchronous copies";
  // The bytes on disk, read without the reader: the blob sits at its offset.
  for (const auto& b : r.manifest().blobs) {
    if (b.name != "big") continue;
    std::ifstream f(r.dir() + "/" + b.file, std::ios::binary);
    f.seekg(static_cast<std::streamoff>(b.offset));
    std::vector<unsigned char> raw(big.size());
    f.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size()));
    EXPECT_EQ(raw, big);
  }
}

void sleep_300ms(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }

// The producer stream's pending work (held back 300 ms, then a memset) comes
// before the copy: the checkpoint has the memset's bytes, not the older ones.
TEST(CheckpointerDevice, CopiesWaitForTheProducerStream) {
  REQUIRE_GPU(cuda);
  void* created = nullptr;
  ASSERT_EQ(cuda.stream_create(&created, 0x1), 0);
  for (void* producer : {created, static_cast<void*>(nullptr)}) {
    SCOPED_TRACE(producer ? "a stream of the caller's" : "the legacy default stream");
    TempDir dir("pacer-ckpt-dev-");
    Options o = small_options(dir.path());
    o.staging_bytes = 1u << 20;
    auto ck = Checkpointer::open(o).value();
    const std::vector<unsigned char> old_bytes(512u << 10, 0x11);
    DeviceBuffer d(cuda, old_bytes);
    ASSERT_EQ(cuda.launch_host_func(producer, sleep_300ms, nullptr), 0);
    ASSERT_EQ(cuda.memset_async(d.ptr, 0xab, d.size, producer), 0);
    SaveOptions so;
    so.cuda_stream = reinterpret_cast<std::uintptr_t>(producer);
    auto h = ck->save(1, {d.blob("w")}, nlohmann::json::object(), so);
    ASSERT_TRUE(h) << h.error().message;
    ASSERT_TRUE(h->wait());
    auto r = ck->open_reader(1).value();
    EXPECT_EQ(read_all(r, "w", d.size), std::vector<unsigned char>(d.size, 0xab));
    ASSERT_EQ(cuda.stream_synchronize(producer), 0);
  }
  cuda.stream_destroy(created);
}

TEST(CheckpointerDevice, TheCallersCurrentDeviceIsRestored) {
  REQUIRE_GPU(cuda);
  int count = 0;
  ASSERT_EQ(cuda.get_device_count(&count), 0);
  if (count < 2) GTEST_SKIP() << "needs two GPUs";
  TempDir dir("pacer-ckpt-dev-");
  auto ck = Checkpointer::open(small_options(dir.path())).value();
  ASSERT_EQ(cuda.set_device(0), 0);
  const auto a = pattern(20000, 4);
  DeviceBuffer d(cuda, a);
  ASSERT_EQ(cuda.set_device(1), 0);
  ASSERT_TRUE(ck->save(1, {d.blob("w")})->wait());
  int now = -1;
  ASSERT_EQ(cuda.get_device(&now), 0);
  EXPECT_EQ(now, 1);
  auto r = ck->open_reader(1).value();
  EXPECT_EQ(read_all(r, "w", a.size()), a);
  ASSERT_EQ(cuda.set_device(0), 0);
}

// Data parallel on the GPU: two ranks hold the same device tensors; each
// copies and writes only its share.
TEST(CheckpointerDevice, ReplicatedDeviceBlobsAreSpreadAcrossRanks) {
  REQUIRE_GPU(cuda);
  TempDir dir("pacer-ckpt-dev-");
  const auto w = pattern((3u << 20) + 4096 * 3 + 100, 5);
  const auto small = pattern(50000, 6);
  test::ThreadWorld world(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto comm = world.rank(r);
      Options o = small_options(dir.path());
      o.chunk_bytes = 64u << 10;
      o.staging_bytes = 512u << 10;
      o.comm = comm.get();
      auto ck = Checkpointer::open(o).value();
      DeviceBuffer dw(cuda, w), ds(cuda, small);
      auto h = ck->save(2, {dw.blob("model/w"), ds.blob("model/b")});
      Status st = h ? h->wait() : Status(h.error());
      if (!st) errors[static_cast<std::size_t>(r)] = st.error().message;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  auto r = Reader::open(dir.path() + "/" + step_dir_name(2)).value();
  EXPECT_EQ(read_all(r, "model/w", w.size()), w);
  EXPECT_EQ(read_all(r, "model/b", small.size()), small);
  for (int k = 0; k < 2; ++k) {
    const auto size = fs::file_size(fmt::format("{}/rank-{:05d}.bin", r.dir(), k));
    EXPECT_LT(size, w.size() * 3 / 4) << "rank " << k << " wrote about half";
  }
}

}  // namespace
}  // namespace pacer::ckpt
