// Token batches from pacer's loader copied to the GPU: pinned (pin_memory) against pageable
// buffers, the copies checked against the host. Prints one JSON object. Run on a GPU machine.
// Build (see bench/README.md): nvcc -O2 -std=c++20 -arch=sm_90 -Iinclude -Ibuild/generated bench/loader_h2d.cu \
//   build/lib/libpacer_data.a build/lib/libpacer_hw.a build/lib/libpacer_core.a -lxxhash -lfmt -ldl -o loader_h2d
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <vector>

#include "pacer/data.hpp"

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(3);
  }
}

struct Result {
  double seconds = 0;
  std::uint64_t bytes = 0;
  bool pinned = false;
  bool verified = true;
};

// Reads one epoch; each batch's tokens go to the device on a stream while the
// loader reads the next. The last batch of each pair is copied back and compared.
Result run(std::shared_ptr<pacer::data::TokenDataset> ds, bool pin, std::uint64_t seq_len, std::uint64_t batch) {
  pacer::data::LoaderOptions o;
  o.batch_size = batch;
  o.seq_len = seq_len;
  o.pack = true;
  o.threads = 4;
  o.prefetch_batches = 4;
  o.pin_memory = pin;
  auto loader = pacer::unwrap(pacer::data::Loader::open(ds, o));
  const std::size_t bytes_per = batch * seq_len * sizeof(std::int64_t);
  std::int64_t* dev[2];
  check(cudaMalloc(&dev[0], bytes_per), "cudaMalloc");
  check(cudaMalloc(&dev[1], bytes_per), "cudaMalloc");
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");
  Result r;
  std::optional<pacer::data::Batch> in_flight;  // its buffer must live until its copy is done
  std::vector<std::int64_t> back(batch * seq_len);
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 0;; ++k) {
    auto b = pacer::unwrap(loader->next());
    if (!b) break;
    r.pinned = b->buffer->pinned();
    const std::size_t n = b->rows * b->cols * sizeof(std::int64_t);
    check(cudaMemcpyAsync(dev[k % 2], b->tokens(), n, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
    if (k % 16 == 0) {  // spot check: the device holds exactly the batch's tokens
      check(cudaMemcpyAsync(back.data(), dev[k % 2], n, cudaMemcpyDeviceToHost, stream), "copy back");
      check(cudaStreamSynchronize(stream), "sync");
      r.verified = r.verified && std::equal(back.begin(), back.begin() + static_cast<long>(n / 8), b->tokens());
    }
    r.bytes += n;
    check(cudaStreamSynchronize(stream), "sync");  // the previous copy: its batch may go back to the pool
    in_flight = std::move(*b);
  }
  check(cudaStreamSynchronize(stream), "sync");
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  cudaFree(dev[0]);
  cudaFree(dev[1]);
  cudaStreamDestroy(stream);
  return r;
}

// Raw H2D of one 64 MiB buffer, pinned and pageable: the ceiling for the above.
double raw_h2d(bool pinned) {
  const std::size_t n = 64u << 20;
  void* host = nullptr;
  std::vector<unsigned char> pageable;
  if (pinned) check(cudaMallocHost(&host, n), "cudaMallocHost");
  else {
    pageable.assign(n, 1);
    host = pageable.data();
  }
  void* dev = nullptr;
  check(cudaMalloc(&dev, n), "cudaMalloc");
  std::vector<double> t;
  for (int i = 0; i < 7; ++i) {
    const auto a = std::chrono::steady_clock::now();
    check(cudaMemcpy(dev, host, n, cudaMemcpyHostToDevice), "cudaMemcpy");
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  cudaFree(dev);
  if (pinned) cudaFreeHost(host);
  return double(n) / t[t.size() / 2] / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : "/tmp/pacer-loader-h2d";
  std::filesystem::create_directories(dir);
  // 20,000 documents of 64..4095 random tokens (never all zeros), about 40 M tokens.
  std::mt19937_64 rng(1);
  std::vector<std::vector<std::int64_t>> docs(20000);
  for (auto& d : docs) {
    d.resize(64 + rng() % 4032);
    for (auto& t : d) t = static_cast<std::int64_t>(1 + rng() % 50000);
  }
  pacer::unwrap(pacer::data::write_token_dataset(dir + "/docs", "uint16", docs));
  auto ds = pacer::unwrap(pacer::data::TokenDataset::open(dir + "/docs"));
  check(cudaSetDevice(0), "cudaSetDevice");
  run(ds, true, 4096, 16);  // warm-up: page cache, CUDA context
  std::vector<Result> pinned, pageable;
  for (int i = 0; i < 3; ++i) {
    pinned.push_back(run(ds, true, 4096, 16));
    pageable.push_back(run(ds, false, 4096, 16));
  }
  auto med = [](std::vector<Result> v) {
    std::sort(v.begin(), v.end(), [](const Result& a, const Result& b) { return a.seconds < b.seconds; });
    return v[v.size() / 2];
  };
  const Result p = med(pinned), q = med(pageable);
  std::printf("{\"schema\": \"pacer.bench.loader_h2d/1\", \"tokens\": %llu, \"seq_len\": 4096, \"batch\": 16,\n"
              " \"pinned\": {\"buffers_pinned\": %s, \"seconds\": %.4f, \"gb_per_s\": %.2f, \"verified\": %s},\n"
              " \"pageable\": {\"buffers_pinned\": %s, \"seconds\": %.4f, \"gb_per_s\": %.2f, \"verified\": %s},\n"
              " \"raw_h2d_gb_per_s\": {\"pinned\": %.2f, \"pageable\": %.2f}}\n",
              static_cast<unsigned long long>(ds->tokens()), p.pinned ? "true" : "false", p.seconds, double(p.bytes) / p.seconds / 1e9,
              p.verified ? "true" : "false", q.pinned ? "true" : "false", q.seconds, double(q.bytes) / q.seconds / 1e9,
              q.verified ? "true" : "false", raw_h2d(true), raw_h2d(false));
  std::filesystem::remove_all(dir);
  return p.verified && q.verified && p.pinned ? 0 : 1;
}
