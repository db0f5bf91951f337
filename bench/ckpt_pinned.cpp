// Saves one checkpoint and prints the checkpointer's stats as JSON: run on a
// GPU machine to see the staging memory page-locked through cudaHostRegister.
// Build: g++ -O2 -std=c++20 -Iinclude -Ibuild/generated bench/ckpt_pinned.cpp \
//          build/lib/libpacer_checkpoint.a build/lib/libpacer_comm.a build/lib/libpacer_hw.a \
//          build/lib/libpacer_core.a -lxxhash -lfmt -lmpi -ldl -lpthread -o ckpt_pinned
#include <cstdio>
#include <filesystem>
#include <vector>

#include "pacer/checkpoint.hpp"

int main(int argc, char** argv) {
  const std::string root = argc > 1 ? argv[1] : "/tmp/pacer-pinned-probe";
  std::filesystem::remove_all(root);
  pacer::ckpt::Options o;
  o.root = root;
  o.staging_bytes = 256ull << 20;
  auto ck = pacer::unwrap(pacer::ckpt::Checkpointer::open(o));
  std::vector<float> w(32u << 20);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 977) * 0.5f + 1.0f;
  pacer::ckpt::BlobView b;
  b.name = "w";
  b.data = w.data();
  b.size = w.size() * sizeof(float);
  b.dtype = "float32";
  b.shape = {static_cast<std::int64_t>(w.size())};
  pacer::unwrap(pacer::unwrap(ck->save(1, {b})).wait());
  const auto s = ck->stats();
  std::printf("{\"saves\": %llu, \"bytes_staged\": %llu, \"staging_bytes\": %llu, \"pinned_bytes\": %llu, \"blocked_s\": %.4f}\n",
              static_cast<unsigned long long>(s.saves), static_cast<unsigned long long>(s.bytes_staged),
              static_cast<unsigned long long>(s.staging_bytes), static_cast<unsigned long long>(s.pinned_bytes), s.blocked_s);
  ck.reset();
  std::filesystem::remove_all(root);
  return 0;
}
