// Runs under mpirun with several ranks: pacer bcast's file, directory and in-memory broadcasts, and its failures.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <memory>
#include <string>

#include "pacer/comm/bcast.hpp"

namespace fs = std::filesystem;
using pacer::comm::BcastOptions;

namespace {

int failures = 0;

void check(bool ok, const std::string& what, int rank) {
  if (!ok) {
    std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, what.c_str());
    ++failures;
  }
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void spit(const fs::path& p, const std::string& data) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << data;
}

std::string random_bytes(std::size_t n, unsigned seed) {
  std::mt19937_64 g(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(g());
  return s;
}

// Delegates to MPI but damages the bytes of one broadcast on every rank but
// the root, as a faulty link would: bcast must notice and fail everywhere.
class Corrupting final : public pacer::comm::Communicator {
 public:
  Corrupting(std::unique_ptr<pacer::comm::Communicator> inner, int damage_call)
      : inner_(std::move(inner)), damage_call_(damage_call) {}
  Corrupting(pacer::comm::Communicator* borrowed, int damage_call) : borrowed_(borrowed), damage_call_(damage_call) {}
  int rank() const override { return c().rank(); }
  int size() const override { return c().size(); }
  void barrier() override { c().barrier(); }
  bool all_ok(bool ok) override { return c().all_ok(ok); }
  std::string broadcast(const std::string& v, int root) override { return c().broadcast(v, root); }
  void broadcast_bytes(void* data, std::size_t n, int root) override {
    c().broadcast_bytes(data, n, root);
    if (++calls_ == damage_call_ && rank() != root && n > 16) static_cast<char*>(data)[n / 2] ^= 0x5a;
  }
  std::unique_ptr<pacer::comm::Communicator> split_node() override {
    auto s = c().split_node();
    return s ? std::make_unique<Corrupting>(std::move(s), damage_call_) : nullptr;
  }
  std::unique_ptr<pacer::comm::Communicator> split(int color) override {
    auto s = c().split(color);
    return s ? std::make_unique<Corrupting>(std::move(s), damage_call_) : nullptr;
  }

 private:
  pacer::comm::Communicator& c() const { return borrowed_ ? *borrowed_ : *inner_; }
  std::unique_ptr<pacer::comm::Communicator> inner_;
  pacer::comm::Communicator* borrowed_ = nullptr;
  int damage_call_;
  int calls_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: bcast_ranks WORKDIR\n");
    return 2;
  }
  auto world = pacer::unwrap(pacer::comm::mpi_world());
  const int r = world->rank();
  const fs::path base = argv[1];
  const fs::path src_dir = base / "src";
  if (r == 0) {
    fs::remove_all(base);
    // Sizes that are not multiples of the chunk, an empty file, nested directories.
    spit(src_dir / "model.bin", random_bytes(1000003, 1));
    spit(src_dir / "shards" / "rank-00001.bin", random_bytes(77777, 2));
    spit(src_dir / "shards" / "deep" / "meta.json", "{\"step\": 42}\n");
    spit(src_dir / "empty", "");
  }
  world->barrier();

  // A file, every rank its own "node" (4 writers), small chunks: many pipelined chunks.
  {
    BcastOptions o;
    o.chunk_bytes = 4096;
    o.ranks_per_node = 1;
    const fs::path dst = base / ("file-node" + std::to_string(r));
    auto st = pacer::comm::broadcast_path(*world, (src_dir / "model.bin").string(), dst.string(), o);
    check(st.has_value(), "file bcast: " + (st ? std::string() : st.error().message), r);
    if (st) {
      check(slurp(dst) == slurp(src_dir / "model.bin"), "file copy differs from the source", r);
      check(st->writer && st->nodes == world->size(), "every rank a writer", r);
      check(st->bytes_read == (r == 0 ? 1000003u : 0u), "only rank 0 reads the source", r);
      check(st->chunks == (1000003 + 4095) / 4096, "chunk count", r);
    }
  }
  // A directory, two ranks per "node": ranks 0 and 2 write, 1 and 3 do not.
  {
    BcastOptions o;
    o.chunk_bytes = 10000;
    o.ranks_per_node = 2;
    const int node = r / 2;
    const fs::path dst = base / ("dir-node" + std::to_string(node));
    auto st = pacer::comm::broadcast_path(*world, src_dir.string(), dst.string(), o);
    check(st.has_value(), "dir bcast: " + (st ? std::string() : st.error().message), r);
    if (st) {
      check(st->writer == (r % 2 == 0), "one writer per node", r);
      check(st->files == 4, "four files", r);
    }
    world->barrier();
    for (const char* f : {"model.bin", "shards/rank-00001.bin", "shards/deep/meta.json", "empty"})
      check(fs::exists(dst / f) && slurp(dst / f) == slurp(src_dir / f), std::string("dir copy of ") + f, r);
    bool leftovers = false;
    for (const auto& e : fs::directory_iterator(base))
      if (e.path().filename().string().find(".partial-") != std::string::npos) leftovers = true;
    check(!leftovers, "no partial directories left", r);
    // The same directory again (a requeued job): every node finds it whole, nothing is replaced.
    auto again = pacer::comm::broadcast_path(*world, src_dir.string(), dst.string(), o);
    check(again.has_value(), "a second bcast onto the same copy: " + (again ? std::string() : again.error().message), r);
    if (again && again->writer) check(again->unchanged && again->bytes_written == 0, "the same copy is left alone", r);
    // One node's copy differs: that node replaces its copy, the other leaves its own.
    world->barrier();
    if (r == 2) spit(dst / "shards" / "deep" / "meta.json", "{\"step\": 41}\n");
    world->barrier();
    auto third = pacer::comm::broadcast_path(*world, src_dir.string(), dst.string(), o);
    check(third.has_value(), "a bcast onto a differing copy: " + (third ? std::string() : third.error().message), r);
    if (third && r == 0) check(!third->unchanged && third->bytes_written == 0, "node 0 kept its copy", r);
    if (third && r == 2) check(third->bytes_written > 0, "node 1 replaced its copy", r);
    world->barrier();
    check(slurp(dst / "shards" / "deep" / "meta.json") == slurp(src_dir / "shards" / "deep" / "meta.json"),
          "the differing copy was replaced", r);
  }
  // In memory: every rank gets the bytes.
  {
    BcastOptions o;
    o.chunk_bytes = 65536;
    auto bytes = pacer::comm::broadcast_file(*world, (src_dir / "shards" / "rank-00001.bin").string(), o);
    check(bytes.has_value() && *bytes == slurp(src_dir / "shards" / "rank-00001.bin"), "in-memory bcast", r);
  }
  // A missing source: every rank gets the same error, nobody hangs.
  {
    auto st = pacer::comm::broadcast_path(*world, (base / "nosuch").string(), (base / "x").string());
    check(!st.has_value() && st.error().message.find("nosuch") != std::string::npos, "missing source named", r);
  }
  // A chunk damaged on the wire: every rank fails, the damaged chunk is named,
  // and no copy is put in place.
  {
    Corrupting faulty(world.get(), 3);
    BcastOptions o;
    o.chunk_bytes = 4096;
    o.ranks_per_node = 1;
    const fs::path dst = base / ("damaged-node" + std::to_string(r));
    auto st = pacer::comm::broadcast_path(faulty, (src_dir / "model.bin").string(), dst.string(), o);
    check(!st.has_value(), "a damaged chunk fails the bcast", r);
    if (!st && r != 0)
      check(st.error().message.find("arrived damaged") != std::string::npos, "damage named: " + st.error().message, r);
    check(!fs::exists(dst), "no copy from damaged chunks", r);
  }
  const bool all = world->all_ok(failures == 0);
  if (r == 0) std::printf("%s: bcast on %d ranks\n", all ? "OK" : "FAILED", world->size());
  return all ? 0 : 1;
}
