// What pacer::run::heartbeat costs a C++ training thread; run by bench/heartbeat_cost.py.
// Prints one JSON object: median/min/max ns per call over rounds, heartbeat(step) against an empty loop
// and a clock_gettime(CLOCK_MONOTONIC) peer.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "pacer/run.hpp"

namespace {

double ns_per_call(long calls, void (*f)(long)) {
  const auto t0 = std::chrono::steady_clock::now();
  f(calls);
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / calls;
}

void beat(long n) {
  for (long i = 0; i < n; ++i) (void)pacer::run::heartbeat(static_cast<std::uint64_t>(i));
}
void clock(long n) {
  timespec ts{};
  for (long i = 0; i < n; ++i) {
    clock_gettime(CLOCK_MONOTONIC, &ts);
    asm volatile("" : : "r"(ts.tv_nsec) : "memory");
  }
}

}  // namespace

int main(int argc, char** argv) {
  const long calls = argc > 1 ? std::atol(argv[1]) : 10'000'000;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  if (auto s = pacer::run::heartbeat(0); !s) {
    std::fprintf(stderr, "%s\n", s.error().message.c_str());
    return 3;
  }
  std::vector<double> b, c;
  for (int r = 0; r < rounds; ++r) {
    if (r % 2) {
      b.push_back(ns_per_call(calls, beat));
      c.push_back(ns_per_call(calls, clock));
    } else {
      c.push_back(ns_per_call(calls, clock));
      b.push_back(ns_per_call(calls, beat));
    }
  }
  auto stat = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return std::vector<double>{v[v.size() / 2], v.front(), v.back()};
  };
  const auto sb = stat(b), sc = stat(c);
  std::printf("{\"heartbeat(step)\": {\"median_ns\": %.2f, \"min_ns\": %.2f, \"max_ns\": %.2f}, "
              "\"clock_gettime(CLOCK_MONOTONIC)\": {\"median_ns\": %.2f, \"min_ns\": %.2f, \"max_ns\": %.2f}}\n",
              sb[0], sb[1], sb[2], sc[0], sc[1], sc[2]);
  return 0;
}
