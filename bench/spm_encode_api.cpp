// Which libsentencepiece call encodes lines fastest, alone and on every thread: Encode(text, &ids)
// (what spm_encode does: a SentencePieceText built and freed per line), EncodeAsIds (the same,
// returning the vector) and Encode into one reused SentencePieceText (what pacer shard tokenize
// does). Rounds alternate the three; each thread encodes its own slice of the lines.
//   g++ -O2 -std=c++20 bench/spm_encode_api.cpp -o /tmp/spm_encode_api $(pkg-config --cflags --libs sentencepiece) -pthread
//   /tmp/spm_encode_api MODEL TEXT [THREADS] [ROUNDS]
#include <sentencepiece_processor.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// Ids summed, so no call can be optimised away and the three can be checked against each other.
using Encoder = unsigned long long (*)(const sentencepiece::SentencePieceProcessor&, const std::vector<std::string>&, std::size_t, std::size_t);

unsigned long long encode_ids(const sentencepiece::SentencePieceProcessor& sp, const std::vector<std::string>& lines, std::size_t lo, std::size_t hi) {
  unsigned long long sum = 0;
  std::vector<int> ids;
  for (std::size_t i = lo; i < hi; ++i) {
    ids.clear();
    if (!sp.Encode(lines[i], &ids).ok()) std::abort();
    for (int id : ids) sum += static_cast<unsigned>(id);
  }
  return sum;
}

unsigned long long encode_as_ids(const sentencepiece::SentencePieceProcessor& sp, const std::vector<std::string>& lines, std::size_t lo, std::size_t hi) {
  unsigned long long sum = 0;
  for (std::size_t i = lo; i < hi; ++i)
    for (int id : sp.EncodeAsIds(lines[i])) sum += static_cast<unsigned>(id);
  return sum;
}

unsigned long long encode_reused(const sentencepiece::SentencePieceProcessor& sp, const std::vector<std::string>& lines, std::size_t lo, std::size_t hi) {
  unsigned long long sum = 0;
  sentencepiece::ImmutableSentencePieceText spt;
  for (std::size_t i = lo; i < hi; ++i) {
    if (!sp.Encode(lines[i], spt.mutable_proto()).ok()) std::abort();
    const std::size_t n = spt.pieces_size();
    for (std::size_t k = 0; k < n; ++k) sum += spt.pieces(static_cast<int>(k)).id();
  }
  return sum;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s MODEL TEXT [THREADS] [ROUNDS]\n", argv[0]);
    return 2;
  }
  sentencepiece::SentencePieceProcessor sp;
  if (!sp.Load(argv[1]).ok()) return 2;
  std::ifstream in(argv[2], std::ios::binary);
  std::vector<std::string> lines;
  std::size_t bytes = 0;
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) bytes += l.size() + 1, lines.push_back(std::move(l));
  const int threads = argc > 3 ? std::stoi(argv[3]) : 1;
  const int rounds = argc > 4 ? std::stoi(argv[4]) : 5;
  const char* names[] = {"Encode(text, &ids)", "EncodeAsIds(text)", "Encode(text, reused SentencePieceText)"};
  const Encoder fns[] = {encode_ids, encode_as_ids, encode_reused};
  std::vector<double> secs[3];
  unsigned long long sums[3] = {};
  for (int r = 0; r < rounds; ++r)
    for (int j = 0; j < 3; ++j) {
      const int k = (j + r) % 3;  // who goes first rotates
      std::vector<unsigned long long> part(threads);
      const auto t0 = Clock::now();
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t)
        ts.emplace_back([&, t] { part[t] = fns[k](sp, lines, lines.size() * t / threads, lines.size() * (t + 1) / threads); });
      for (auto& t : ts) t.join();
      secs[k].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      unsigned long long s = 0;
      for (auto p : part) s += p;
      sums[k] = s;
    }
  std::printf("%zu lines, %zu bytes, %d thread(s), %d rounds; MB/s of text: median [min-max]\n", lines.size(), bytes, threads, rounds);
  for (int k = 0; k < 3; ++k) {
    auto v = secs[k];
    std::sort(v.begin(), v.end());
    std::printf("%-42s %8.2f [%.2f-%.2f]  ids sum %llu\n", names[k], bytes / v[v.size() / 2] / 1e6, bytes / v.back() / 1e6, bytes / v.front() / 1e6, sums[k]);
  }
  return sums[0] == sums[1] && sums[1] == sums[2] ? 0 : 1;
}
