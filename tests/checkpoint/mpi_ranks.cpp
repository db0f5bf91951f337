// Checkpoints across real MPI ranks: every rank saves its shard, the step
// commits only when all are durable, and any rank count can read it back.
// Run as: mpirun -np N ckpt_mpi_test ROOT
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "pacer/checkpoint.hpp"
#include "pacer/comm/communicator.hpp"

namespace {

std::vector<unsigned char> logical_bytes(std::size_t n) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131 + 7) ^ (i >> 8));
  return v;
}

int failures = 0;
void check(bool ok, const std::string& what, int rank) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, what.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s ROOT\n", argv[0]);
    return 2;
  }
  auto comm = pacer::comm::mpi_world().value();
  const int rank = comm->rank();
  const int size = comm->size();
  const std::string root = argv[1];
  if (rank == 0) std::filesystem::remove_all(root);
  comm->barrier();

  pacer::ckpt::Options o;
  o.root = root;
  o.chunk_bytes = 4096;
  o.staging_bytes = 32 * 1024;
  o.comm = comm.get();
  auto ck = pacer::ckpt::Checkpointer::open(o).value();

  // Uneven shards of one logical blob.
  const std::uint64_t total = 40000 + 1000 * static_cast<std::uint64_t>(size);
  const auto whole = logical_bytes(total);
  std::vector<std::uint64_t> bounds(static_cast<std::size_t>(size) + 1);
  for (int r = 0; r <= size; ++r) bounds[static_cast<std::size_t>(r)] = total * static_cast<std::uint64_t>(r) * static_cast<std::uint64_t>(r) / (static_cast<std::uint64_t>(size) * static_cast<std::uint64_t>(size));
  const std::uint64_t lo = bounds[static_cast<std::size_t>(rank)];
  const std::uint64_t hi = bounds[static_cast<std::size_t>(rank) + 1];
  pacer::ckpt::BlobView shard;
  shard.name = "weights";
  shard.data = whole.data() + lo;
  shard.size = hi - lo;
  shard.dtype = "uint8";
  shard.shape = {static_cast<std::int64_t>(hi - lo)};
  shard.layout = pacer::ckpt::Layout::kShard;
  shard.shard_offset = lo;
  shard.global_size = total;
  shard.global_shape = {static_cast<std::int64_t>(total)};
  std::vector<pacer::ckpt::BlobView> blobs = {shard};
  // Replicated: every rank passes it, one rank writes it.
  const std::string note = "the same on every rank";
  pacer::ckpt::BlobView rep;
  rep.name = "note";
  rep.data = note.data();
  rep.size = note.size();
  blobs.push_back(rep);

  auto h = ck->save(100, blobs, {{"world", size}});
  check(h.has_value(), "save(100)", rank);
  if (h) {
    pacer::Status st = h->wait();
    check(st.ok(), "wait(100): " + (st ? std::string() : st.error().message), rank);
  }
  comm->barrier();

  // A save where one rank fails: every rank returns, nothing commits.
  std::vector<pacer::ckpt::BlobView> bad = {shard};
  if (rank == size - 1) bad[0].dtype = "float33";
  auto h2 = ck->save(101, bad);
  bool committed = h2.has_value() && h2->wait().ok();
  check(!committed, "step 101 committed although a rank failed", rank);
  comm->barrier();
  check(!std::filesystem::exists(std::filesystem::path(root) / pacer::ckpt::step_dir_name(101)), "step 101 directory exists", rank);
  check(ck->latest() == std::optional<std::uint64_t>(100), "latest() is 100", rank);

  // Every rank reads the whole blob, then a resharded slice as if there were
  // size + 1 ranks.
  auto reader = pacer::ckpt::Reader::open((std::filesystem::path(root) / pacer::ckpt::step_dir_name(100)).string());
  check(reader.has_value(), "Reader::open", rank);
  if (reader) {
    check(reader->manifest().world_size == size, "world_size recorded", rank);
    std::vector<unsigned char> all(total);
    check(reader->read("weights", all.data(), total).ok() && all == whole, "whole logical blob", rank);
    const std::uint64_t n = static_cast<std::uint64_t>(size) + 1;
    const std::uint64_t a = total * static_cast<std::uint64_t>(rank) / n;
    const std::uint64_t b = total * (static_cast<std::uint64_t>(rank) + 1) / n;
    std::vector<unsigned char> slice(b - a);
    check(reader->read("weights", slice.data(), b - a, a).ok() && std::equal(slice.begin(), slice.end(), whole.begin() + static_cast<long>(a)),
          "resharded slice", rank);
    std::string got(note.size(), '\0');
    check(reader->read("note", got.data(), got.size()).ok() && got == note, "replicated blob", rank);
  }
  ck.reset();

  // A fast tier per "node" (even and odd ranks: two directories): wait()
  // commits on the fast tiers, the flushers commit on the persistent tier,
  // and each rank loads its own shard back.
  pacer::ckpt::Options f = o;
  f.fast_tier = root + "-fast-" + std::to_string(rank % 2);
  if (rank < 2) std::filesystem::remove_all(*f.fast_tier);
  comm->barrier();
  auto fck = pacer::ckpt::Checkpointer::open(f).value();
  auto h3 = fck->save(200, blobs, {{"world", size}});
  check(h3.has_value(), "save(200) with a fast tier", rank);
  if (h3) {
    pacer::Status st = h3->wait();
    check(st.ok(), "wait(200): " + (st ? std::string() : st.error().message), rank);
    st = h3->wait_persistent();
    check(st.ok(), "wait_persistent(200): " + (st ? std::string() : st.error().message), rank);
  }
  auto whole200 = pacer::ckpt::Reader::open((std::filesystem::path(root) / pacer::ckpt::step_dir_name(200)).string());
  check(whole200.has_value() && whole200->complete() && whole200->manifest().files.size() == static_cast<std::size_t>(size),
        "step 200 on the persistent tier holds every rank's file", rank);
  std::vector<unsigned char> mine(hi - lo);
  auto got = fck->load([&](const pacer::ckpt::Reader::Logical& l) -> pacer::ckpt::LoadTarget {
    if (l.name == "weights") return {mine.data(), lo, hi - lo};
    return {};
  }, 200);
  check(got.has_value() && std::equal(mine.begin(), mine.end(), whole.begin() + static_cast<long>(lo)), "own shard of step 200 loads", rank);
  fck.reset();
  comm->barrier();
  if (rank < 2) std::filesystem::remove_all(*f.fast_tier);

  const bool all_ok = comm->all_ok(failures == 0);
  if (rank == 0) std::printf("%s: checkpoint across %d MPI ranks\n", all_ok ? "OK" : "FAILED", size);
  return all_ok ? 0 : 1;
}
