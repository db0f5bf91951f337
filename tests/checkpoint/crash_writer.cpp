// ckpt_crash_writer ROOT [--fast FAST] [--keep-last N]
//
// Saves checkpoints 1, 2, 3, ... (or, when ROOT already holds checkpoints, from
// the newest one plus one) until it is killed. Each step holds the blobs of
// crash_data.hpp and meta {"step": step, "pid": <this process>}. After a
// step's wait() returns OK it prints "committed <step>" and flushes stdout, so
// a test that kills it at a random moment knows what must have survived.
//
// A step that another saver committed first (two writers on one root) prints
// "skipped <step>" and the writer goes on with the next step. Any other error
// is printed to stderr and the writer exits with status 1, so a test can tell
// "killed" from "failed".
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "crash_data.hpp"
#include "pacer/checkpoint.hpp"

namespace {

int usage() {
  std::fprintf(stderr, "usage: ckpt_crash_writer ROOT [--fast FAST] [--keep-last N]\n");
  return 2;
}

bool already_committed(const pacer::Error& e) { return e.message.find("already committed") != std::string::npos; }

}  // namespace

int main(int argc, char** argv) {
  namespace crash = pacer::test::crash;
  std::string root;
  std::string fast;
  int keep_last = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--fast" && i + 1 < argc) {
      fast = argv[++i];
    } else if (a == "--keep-last" && i + 1 < argc) {
      char* end = nullptr;
      const long v = std::strtol(argv[++i], &end, 10);
      if (*end != '\0' || v < 0) return usage();
      keep_last = static_cast<int>(v);
    } else if (!a.empty() && a[0] != '-' && root.empty()) {
      root = a;
    } else {
      return usage();
    }
  }
  if (root.empty()) return usage();

  pacer::ckpt::Options opt = crash::options(root, fast, keep_last);
  opt.warn = [](const std::string& s) { std::fprintf(stderr, "warning: %s\n", s.c_str()); };
  auto ck = pacer::ckpt::Checkpointer::open(opt);
  if (!ck) {
    std::fprintf(stderr, "error: %s\n", ck.error().message.c_str());
    return 1;
  }
  const std::uint64_t first = (*ck)->latest().value_or(0) + 1;
  for (std::uint64_t step = first;; ++step) {
    std::vector<std::vector<unsigned char>> buffers = crash::make_step(step);
    const nlohmann::json meta = {{"step", step}, {"pid", static_cast<long>(::getpid())}};
    auto h = (*ck)->save(step, crash::views(step, buffers), meta);
    if (!h) {
      if (already_committed(h.error())) {
        std::printf("skipped %llu\n", static_cast<unsigned long long>(step));
        std::fflush(stdout);
        continue;
      }
      std::fprintf(stderr, "error: save %llu: %s\n", static_cast<unsigned long long>(step), h.error().message.c_str());
      return 1;
    }
    // The buffers are the caller's again once save() returns: scribbling on
    // them must not change what is saved.
    for (auto& b : buffers) std::memset(b.data(), 0xA5, b.size());
    if (pacer::Status st = h->wait(); !st) {
      if (already_committed(st.error())) {
        std::printf("skipped %llu\n", static_cast<unsigned long long>(step));
        std::fflush(stdout);
        continue;
      }
      std::fprintf(stderr, "error: wait %llu: %s\n", static_cast<unsigned long long>(step), st.error().message.c_str());
      return 1;
    }
    std::printf("committed %llu\n", static_cast<unsigned long long>(step));
    std::fflush(stdout);
  }
}
