// Data: WebDataset tar shards with an index, and a deterministic, resumable, prefetching loader.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"

namespace pacer::data {

// ---------------------------------------------------------------------------
// Tar shards

// One regular file inside a tar archive: its name (pax and GNU long names
// resolved) and where its bytes are.
struct TarMember {
  std::string name;
  std::uint64_t header_offset = 0;  // of its (first) header block, for error messages
  std::uint64_t offset = 0;         // of its data
  std::uint64_t size = 0;
};

// Reads every header of a tar file (POSIX ustar, pax extended headers, GNU
// long names; base-256 sizes). Directories, links and pax global headers are
// skipped. A truncated archive, a bad header checksum or a member whose name
// is absolute or contains "..", is an error naming the shard and the offset.
Expected<std::vector<TarMember>> scan_tar(const std::string& path);

// One WebDataset sample: consecutive members sharing a key, the name up to the
// first '.' of its file name ("dir/000017.jpg" -> key "dir/000017", ext "jpg").
struct Field {
  std::string ext;
  std::uint64_t offset = 0;
  std::uint64_t size = 0;
};
struct SampleEntry {
  std::string key;
  std::vector<Field> fields;
};
std::vector<SampleEntry> group_samples(const std::vector<TarMember>& members);

// The index of one shard, stored beside it as SHARD.pidx (binary, see
// docs/data.md). `samples` is enough to open a dataset; the entries are read
// only when the shard is used.
struct ShardIndex {
  std::string shard;
  std::uint64_t shard_bytes = 0;
  std::uint64_t samples = 0;
  std::vector<SampleEntry> entries;  // empty when only the header was read
};
std::string index_path(const std::string& shard);
// Scans the shard and writes its index atomically.
Expected<ShardIndex> build_index(const std::string& shard);
// Reads SHARD.pidx; with `header_only` just the sample count. An index that
// does not match the shard's size is an error (the shard changed).
Expected<ShardIndex> read_index(const std::string& shard, bool header_only);
// read_index, or build_index when the index is missing (and writable).
Expected<ShardIndex> load_or_build_index(const std::string& shard, bool header_only);

// ---------------------------------------------------------------------------
// Datasets

// Expands "train-{000000..000099}.tar", "a-{x,y}.tar" and shell globs to
// paths, in order. A spec naming a .json file is read as a pack manifest.
Expected<std::vector<std::string>> expand_shard_spec(const std::string& spec);

// An opened set of shards: samples are numbered 0..size()-1 across shards in
// shard order. Thread-safe for reads.
class Dataset {
 public:
  static Expected<std::shared_ptr<Dataset>> open(const std::string& spec);
  static Expected<std::shared_ptr<Dataset>> open(const std::vector<std::string>& shards);
  ~Dataset();

  std::uint64_t size() const { return total_; }
  const std::vector<std::string>& shards() const { return shards_; }
  const std::vector<std::uint64_t>& shard_samples() const { return counts_; }

  struct Sample {
    std::string key;
    std::vector<std::pair<std::string, std::string>> fields;  // ext, bytes
  };
  // Reads global sample i. Blocks on I/O; safe from several threads.
  Expected<Sample> read(std::uint64_t i) const;

  struct Impl;

 private:
  Dataset() = default;
  std::vector<std::string> shards_;
  std::vector<std::uint64_t> counts_;
  std::vector<std::uint64_t> starts_;
  std::uint64_t total_ = 0;
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------
// Order: a seeded permutation of [0, n) computed per index (no table in
// memory): a Feistel network on the next power of four, cycle-walking into
// range. Same seed and epoch, same order; a new order each epoch.
class Permutation {
 public:
  Permutation(std::uint64_t n, std::uint64_t seed, std::uint64_t epoch);
  std::uint64_t operator()(std::uint64_t i) const;
  std::uint64_t size() const { return n_; }

 private:
  std::uint64_t n_;
  unsigned half_bits_ = 1;
  std::uint64_t keys_[4];
};

// Which global positions of an epoch a rank reads. Global batch g holds
// positions [g*B*W, (g+1)*B*W); rank r takes the r-th run of B within it. The
// last, partial global batch (kept unless drop_last) is split evenly, so every
// position is read by exactly one rank, and the split depends only on the
// global batch size: resuming with another world size at the same global
// batch reads every remaining sample exactly once.
struct Partition {
  std::uint64_t samples = 0;
  std::uint64_t batch_size = 0;  // per rank
  int rank = 0;
  int world_size = 1;
  bool drop_last = false;

  std::uint64_t global_batch() const { return batch_size * static_cast<std::uint64_t>(world_size); }
  // Global batches in an epoch.
  std::uint64_t batches() const;
  // Positions this rank reads in global batch g.
  std::pair<std::uint64_t, std::uint64_t> range(std::uint64_t g) const;
};

struct LoaderOptions {
  std::uint64_t batch_size = 32;
  std::uint64_t seed = 0;
  int rank = 0;
  int world_size = 1;
  bool shuffle = true;
  bool drop_last = false;
  int threads = 2;                        // reader threads
  std::uint64_t prefetch_batches = 4;     // batches read ahead
  std::uint64_t max_bytes = 512ull << 20; // bound on bytes held in prefetched batches
  bool skip_bad = false;                  // skip unreadable samples (counted) instead of failing
  bool loop = false;                      // start the next epoch instead of ending
};

struct Batch {
  std::uint64_t epoch = 0;
  std::uint64_t global_batch = 0;
  std::vector<Dataset::Sample> samples;
};

struct LoaderStats {
  std::uint64_t batches = 0;
  std::uint64_t samples = 0;
  std::uint64_t bytes = 0;
  std::uint64_t skipped = 0;
  double wait_s = 0;        // time the consumer waited for data, total
  double last_wait_s = 0;   // for the last batch
  double elapsed_s = 0;     // since the first next()
  std::uint64_t queue_depth = 0;  // batches ready when the last one was taken
};

// Reads batches for one rank in the order the Permutation and Partition give,
// with reader threads ahead of the consumer. next() blocks; the loader is
// used from one consumer thread. state() is a few integers from which a new
// loader (any world size with the same global batch) continues exactly.
class Loader {
 public:
  static Expected<std::unique_ptr<Loader>> open(std::shared_ptr<Dataset> ds, LoaderOptions options);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // The next batch, or nothing at the end of the epoch (unless `loop`).
  Expected<std::optional<Batch>> next();
  nlohmann::json state() const;      // {"seed", "epoch", "position", "global_batch"}
  Status load_state(const nlohmann::json& state);
  // Starts epoch `epoch` from its beginning.
  void set_epoch(std::uint64_t epoch);
  LoaderStats stats() const;
  std::uint64_t batches_per_epoch() const;

  struct Impl;

 private:
  explicit Loader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pacer::data
