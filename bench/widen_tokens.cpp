// Widening int32 token ids to int64 out of a shuffled Megatron .bin: the
// library's TokenDataset::copy_tokens (AVX2 where the CPU has it) against the
// plain loop it used before, compiled by GCC at -O2 as the library is, over
// the same mapping and document order. Alternating rounds, medians.
//
//   g++ -O2 -std=c++20 -pthread -Iinclude -Ibuild/generated bench/widen_tokens.cpp -Lbuild/lib -lpacer -Wl,-rpath,$PWD/build/lib \
//       -lfmt -o /tmp/widen_tokens && /tmp/widen_tokens PREFIX [ROUNDS]
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "pacer/data.hpp"

namespace {

[[gnu::noinline]] void plain(const std::int32_t* src, std::size_t n, std::int64_t* out) {
  for (std::size_t i = 0; i < n; ++i) out[i] = src[i];
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s PREFIX [ROUNDS]   (an int32 token dataset)\n", argv[0]);
    return 2;
  }
  const std::string prefix = argv[1];
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  auto ds = pacer::data::TokenDataset::open(prefix);
  if (!ds || (*ds)->dtype() != "int32") {
    std::fprintf(stderr, "%s: not an int32 token dataset\n", prefix.c_str());
    return 2;
  }
  const int fd = ::open((prefix + ".bin").c_str(), O_RDONLY);
  struct stat st {};
  ::fstat(fd, &st);
  const auto* bin = static_cast<const unsigned char*>(::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0));
  // Each document's byte offset, from the library's own reads of its length.
  const std::uint64_t docs = (*ds)->documents();
  std::vector<std::uint64_t> order(docs), len(docs), at(docs);
  std::uint64_t off = 0;
  for (std::uint64_t d = 0; d < docs; ++d) {
    len[d] = (*ds)->document_tokens(d);
    at[d] = off;
    off += len[d] * 4;
  }
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(1));
  volatile unsigned char sink = 0;
  for (std::uint64_t i = 0; i < static_cast<std::uint64_t>(st.st_size); i += 4096) sink = sink + bin[i];
  std::vector<std::int64_t> out(1 << 16);
  auto pass = [&](bool library, int threads) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        std::vector<std::int64_t> buf(1 << 16);
        std::uint64_t furthest = 0;  // the file's size is checked once per pass, as the loader checks it once per batch
        for (std::uint64_t i = static_cast<std::uint64_t>(t); i < docs; i += static_cast<std::uint64_t>(threads)) {
          const std::uint64_t d = order[i];
          for (std::uint64_t done = 0; done < len[d];) {
            const std::uint64_t k = std::min<std::uint64_t>(len[d] - done, buf.size());
            if (library) (void)(*ds)->copy_tokens(d, done, k, buf.data(), &furthest);
            else plain(reinterpret_cast<const std::int32_t*>(bin + at[d]) + done, k, buf.data());
            done += k;
          }
        }
        if (library) (void)(*ds)->check_size(furthest);
      });
    for (auto& t : ts) t.join();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::printf("%s: %llu documents, %.1f MB; %d rounds alternated, medians [min]\n", prefix.c_str(), static_cast<unsigned long long>(docs), st.st_size / 1e6, rounds);
  for (int threads : {1, 2}) {
    std::vector<double> lib, pl;
    for (int r = 0; r < rounds; ++r) {
      pl.push_back(pass(false, threads));
      lib.push_back(pass(true, threads));
    }
    std::printf("threads %d: plain loop %.4f s [%.4f], copy_tokens %.4f s [%.4f]: %.2fx\n", threads, median(pl), *std::min_element(pl.begin(), pl.end()), median(lib),
                *std::min_element(lib.begin(), lib.end()), median(pl) / median(lib));
  }
  return 0;
}
