// Checkpoints: async, multi-tier, crash-consistent and checksummed saves of named blobs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"

namespace pacer {
class HostBuffer;
}
namespace pacer::comm {
class Communicator;
}

namespace pacer::ckpt {

inline constexpr const char* kManifestSchema = "pacer.ckpt/1";
inline constexpr const char* kManifestName = "MANIFEST.json";
// A larger manifest is refused unread (about 3 million blob entries).
inline constexpr std::uint64_t kMaxManifestBytes = 1ull << 30;

// Element types a blob may declare; "bytes" is opaque data.
// Names follow numpy (float32, int64, ...) plus "bfloat16" and torch's complex32 and float8 names.
std::size_t dtype_size(const std::string& dtype);  // 0 for an unknown dtype
bool valid_dtype(const std::string& dtype);

enum class Layout {
  kReplicated,  // one copy of the whole blob (with several ranks: every rank passes it, the writing is spread)
  kShard,       // this rank's byte range of one logical blob shared by ranks
};

// A caller's buffer to save. Borrowed only until save() returns: the bytes are
// copied into staging memory before that.
struct BlobView {
  std::string name;
  const void* data = nullptr;
  std::uint64_t size = 0;  // bytes
  std::string dtype = "bytes";
  std::vector<std::int64_t> shape;  // of this blob (this shard, for shards)
  Layout layout = Layout::kReplicated;
  // Shards: these bytes are [shard_offset, shard_offset + size) of a logical
  // blob of global_size bytes and global_shape.
  std::uint64_t shard_offset = 0;
  std::uint64_t global_size = 0;
  std::vector<std::int64_t> global_shape;
  // >= 0: `data` is CUDA device memory on that device ordinal. save() copies
  // it into pinned staging on a side stream that first waits for
  // SaveOptions::cuda_stream, and returns once the copies have landed.
  int device = -1;
};

struct SaveOptions {
  // The stream (a cudaStream_t) whose queued work produces the device blobs;
  // the copies are ordered after it. 0: the legacy default stream.
  std::uintptr_t cuda_stream = 0;
  // save() returns once the device blobs' copies are queued, not landed: the
  // copies run while the caller computes (forward and backward read the
  // weights, they do not write them). Until SaveHandle::copied(), the device
  // blobs must not be written: order the stream that writes them (the
  // optimizer step's) after the copies with SaveHandle::order_before(), or
  // block with wait_copied(). A staging pool smaller than the save lands the
  // copies that run it dry before returning, as without this.
  bool defer_device_copies = false;
};

// One blob as recorded in a manifest.
struct BlobInfo {
  std::string name;
  int rank = 0;
  std::string file;        // data file inside the checkpoint directory
  std::uint64_t offset = 0;  // of the blob in that file
  std::uint64_t size = 0;
  std::string dtype = "bytes";
  std::vector<std::int64_t> shape;
  Layout layout = Layout::kReplicated;
  std::uint64_t shard_offset = 0;
  std::uint64_t global_size = 0;
  std::vector<std::int64_t> global_shape;
  std::vector<std::uint64_t> chunk_hashes;  // XXH3-64 of each chunk_bytes piece
};

struct Manifest {
  std::uint64_t step = 0;
  std::string created_at;
  int world_size = 1;
  std::uint64_t chunk_bytes = 0;
  nlohmann::json meta = nlohmann::json::object();
  std::vector<BlobInfo> blobs;
  std::vector<std::pair<std::string, std::uint64_t>> files;  // name, size
  // The ranks whose parts this copy holds, when not all world_size of them:
  // a node's fast tier holds only the parts of the ranks on that node.
  // Empty: every rank's part (every copy on the persistent tier).
  std::vector<int> ranks;
};

nlohmann::json to_json(const Manifest& m);
// Parses and checks a manifest; the error names `source` and what is wrong.
Expected<Manifest> manifest_from_json(const std::string& text, const std::string& source);

// "step-000000000042" for step 42.
std::string step_dir_name(std::uint64_t step);
std::optional<std::uint64_t> parse_step_dir_name(const std::string& name);

// One committed checkpoint, opened for reading. Every byte read is checked
// against its chunk's checksum; a mismatch is an error naming the blob, the
// file and the offset. read() and verify_all() may run on several threads at
// once (each read opens its own descriptor). While any copy of a Reader lives
// it holds a shared lock (flock) on its step's manifest: retention, prune and
// the fast-tier flush, in this process or another, leave that step alone.
class Reader {
 public:
  static Expected<Reader> open(const std::string& step_dir);
  // A manifest already in memory (one rank's part) over the files in dir;
  // the files' sizes are checked as open() checks them.
  static Expected<Reader> open(const std::string& dir, Manifest manifest);
  const Manifest& manifest() const { return manifest_; }
  const std::string& dir() const { return dir_; }
  // Holds every rank's part (see Manifest::ranks).
  bool complete() const { return manifest_.ranks.empty(); }

  // Logical blobs: replicated blobs and shard groups merged, by name.
  struct Logical {
    std::string name;
    std::string dtype;
    std::vector<std::int64_t> shape;
    std::uint64_t size = 0;
  };
  std::vector<Logical> logical_blobs() const;

  // Reads `size` bytes of logical blob `name` starting at byte `offset` into
  // dst; shards are assembled by byte range, so a checkpoint saved by N ranks
  // can be read by any number of ranks.
  Status read(const std::string& name, void* dst, std::uint64_t size, std::uint64_t offset = 0);
  // Whether this copy holds all of [offset, offset + size) of blob `name`
  // (a node's partial copy may lack other ranks' shards and blobs).
  bool covers(const std::string& name, std::uint64_t size, std::uint64_t offset = 0) const;
  // Reads and checks every byte of every blob.
  Status verify_all();
  // verify_all() of a share: the stored blobs i with i % ranks == rank, for
  // several ranks checking one step together.
  Status verify_share(int rank, int ranks);

 private:
  struct File;
  // Both open()s end here, with the step's lock already taken.
  static Expected<Reader> open_locked(const std::string& dir, Manifest manifest, std::shared_ptr<const int> lock);
  Expected<std::shared_ptr<File>> open_file(const std::string& name) const;
  // scratch: two buffers kept across calls (verify_all), or nullptr.
  Status read_piece(const BlobInfo& b, std::uint64_t from, std::uint64_t len, unsigned char* dst, HostBuffer* scratch = nullptr);
  std::string dir_;
  Manifest manifest_;
  std::shared_ptr<const int> dir_lock_;  // the locked manifest's descriptor, shared by copies
};

// What a directory of checkpoints holds, for `pacer ckpt ls` and retention.
struct Entry {
  std::uint64_t step = 0;
  std::string path;
  std::uint64_t bytes = 0;
  bool partial = false;    // a .partial-* directory: a save that never committed
  bool committed = false;  // a step directory whose manifest and file sizes check
  bool verified = false;   // every checksum checked and right (only with verify)
  bool damaged = false;    // a .damaged-* directory: a damaged step that save() moved aside
  std::string problem;     // why not committed or not valid
};
// Committed checkpoints and leftovers (partial and moved-aside damaged
// directories) under root, newest first. With `verify`, every byte of each
// committed checkpoint is checked.
std::vector<Entry> list(const std::string& root, bool verify);

// The records of `pacer ckpt ls` (schema pacer.ckpt.ls/1) and `pacer ckpt
// verify` (pacer.ckpt.verify/1) over the root `dir`; fields in docs/checkpoint.md.
nlohmann::json to_json(const Entry& e);
struct ListReport {
  std::string dir;
  std::vector<Entry> checkpoints;  // as list() returns them
};
nlohmann::json to_json(const ListReport& r);
struct VerifyReport {
  std::string dir;
  std::vector<Entry> checkpoints;  // those checked, each listed with verify
  // Every checkpoint checked verified ("verdict": "pass").
  bool ok() const;
};
nlohmann::json to_json(const VerifyReport& r);

// How long a .partial-* directory of another host must have been left
// untouched before a newer committed step lets cleanup remove it: well beyond
// the gaps of a live saver (its writes, the default flush_timeout_s of 600 s
// that rank 0 waits for the other ranks' copies).
inline constexpr double kStalePartialS = 3600;

// Retention, by hand (`pacer ckpt prune`) or after each save. Only valid
// steps count: the steps are checked from the newest down until one verifies
// (every checksum); that step and every older committed one are the
// candidates, and of those the newest keep_last, every multiple of keep_every
// (when > 0) and always the newest stay. Newer steps that fail verification,
// and step directories whose manifest or files do not check, are damaged:
// reported and left alone unless remove_damaged. A step a Reader holds is
// skipped (busy) and left for the next prune. Verification results are
// cached per process, keyed by the step directory, its manifest and its
// files' sizes and modification times.
struct PruneOptions {
  int keep_last = 3;  // at least 1
  int keep_every = 0;
  bool remove_damaged = false;  // also remove damaged steps and moved-aside .damaged-* directories
  bool dry_run = false;         // decide and report, remove nothing
  // A .partial-* directory of another host (or of a dead saver of this one)
  // is removed once a step at or after its own is committed and nothing in
  // it changed for this long (a live saver writes into it all the time).
  double stale_partial_s = kStalePartialS;
};
struct PruneResult {
  std::optional<std::uint64_t> newest_valid;  // the step that verified; never removed
  std::vector<std::uint64_t> removed;         // removed (dry run: would be), newest first
  std::vector<std::uint64_t> kept;            // candidates that stay, newest first
  std::vector<Entry> damaged;                 // damaged steps and moved-aside directories, each with its problem
  std::vector<std::string> removed_damaged;   // with remove_damaged: the damaged directories removed (dry run: would be)
  std::vector<std::uint64_t> busy;            // would be removed but a Reader holds them: left for the next prune
  std::vector<Entry> removed_partial;         // stale .partial-* directories removed (dry run: would be); problem: why
};
Expected<PruneResult> prune(const std::string& root, const PruneOptions& options);
// The record of `pacer ckpt prune` (schema pacer.ckpt.prune/1) for prune(dir, {.dry_run = dry_run, ...}).
nlohmann::json to_json(const PruneResult& r, const std::string& dir, bool dry_run);

// Model weights in the safetensors format (the Hugging Face layout): the
// numeric blobs whose name starts with `<prefix>/`, each named by the rest of
// its name (prefix "": every numeric blob under its own name; "bytes" blobs
// are left out). One `model.safetensors`, or, above max_shard_bytes,
// `model-00001-of-0000N.safetensors` files and `model.safetensors.index.json`.
// Each file is written atomically and read back (header parsed, every
// tensor's bytes compared with the checkpoint's) before the next; stale files
// of an earlier export in out_dir are removed once the new set is complete.
struct ExportOptions {
  std::string prefix = "model";
  std::uint64_t max_shard_bytes = 5'000'000'000;  // "5GB", as in Hugging Face's save_pretrained
};
struct ExportResult {
  std::uint64_t step = 0;
  std::vector<std::string> files;  // written, in order (the index last, when sharded)
  std::uint64_t tensors = 0;
  std::uint64_t bytes = 0;  // tensor data, headers excluded
  std::vector<std::string> skipped;  // newer steps passed over as damaged, each with why
};
// The safetensors dtype name for a checkpoint dtype, or "" when it has none.
std::string safetensors_dtype(const std::string& dtype);
Expected<ExportResult> export_safetensors(Reader& reader, const std::string& out_dir, const ExportOptions& options);
// The given step under root, or the newest one that reads back whole (a
// damaged newer step is passed over and listed in `skipped`).
Expected<ExportResult> export_safetensors(const std::string& root, std::optional<std::uint64_t> step, const std::string& out_dir,
                                          const ExportOptions& options);
// The record of `pacer ckpt export` (schema pacer.ckpt.export/1) for an export of root `dir` into `out_dir`.
nlohmann::json to_json(const ExportResult& r, const std::string& dir, const std::string& out_dir);

struct Options {
  std::string root;                      // persistent tier (shared file system)
  std::optional<std::string> fast_tier;  // node-local disk or /dev/shm
  int keep_last = 3;                     // per tier; 0 keeps all
  int keep_every = 0;
  std::uint64_t staging_bytes = 1ull << 30;  // copy budget; save() blocks when it is full
  // Ordinary (never page-locked) memory that staging may take beyond
  // staging_bytes when a checkpoint is larger than the pool, so that save()
  // copies and returns instead of waiting for the disk to free the pool.
  // Allocated in chunk_bytes buffers by the first save that needs them, at
  // most this much, and kept for later saves; each is handed back to the
  // kernel lazily (MADV_FREE) once written. 0: save() waits for the writer.
  std::uint64_t overflow_bytes = 0;
  std::uint64_t chunk_bytes = 64ull << 20;   // staging and checksum granularity
  bool pin_staging = true;               // page-lock staging with cudaHostRegister where CUDA exists
  comm::Communicator* comm = nullptr;    // several ranks: a collective commit (nullptr: one rank)
  // Several ranks with a fast tier: how long rank 0's flusher waits for every
  // rank's copy to reach the persistent tier before it gives the step up
  // (it stays on the fast tiers) and reports the error on every rank.
  double flush_timeout_s = 600;
  // Warnings (a corrupt checkpoint skipped, a failed tier flush), one line
  // each. Default: stderr.
  std::function<void(const std::string&)> warn;
};

class Checkpointer;

// Where Checkpointer::load puts one logical blob: bytes [offset, offset +
// size) of it go to data. data == nullptr: the blob is not read.
struct LoadTarget {
  void* data = nullptr;
  std::uint64_t offset = 0;
  std::uint64_t size = 0;
};
// Asked once per logical blob of the copy about to be read (and again, for
// the next copy, when one fails); may allocate.
using LoadDestination = std::function<LoadTarget(const Reader::Logical&)>;

// The state of one save. wait() blocks until the checkpoint is durable and
// committed on its first tier (and, with several ranks, on every rank).
class SaveHandle {
 public:
  SaveHandle() = default;
  std::uint64_t step() const;
  bool done() const;
  Status wait();
  // Also waits for the copy to the persistent tier (when there is a fast tier).
  Status wait_persistent();
  // SaveOptions::defer_device_copies: whether the device blobs' copies have
  // landed (true for a save that did not defer); blocking until they have; and
  // ordering work queued afterwards on `cuda_stream` (a cudaStream_t) after
  // them without blocking. The first error of a copy.
  bool copied() const;
  Status wait_copied() const;
  Status order_before(std::uintptr_t cuda_stream) const;

  struct State;

 private:
  friend class Checkpointer;
  explicit SaveHandle(std::shared_ptr<State> s) : state_(std::move(s)) {}
  std::shared_ptr<State> state_;
};

// Saves and restores checkpoints under one root. Saves run on background
// threads; the public methods are safe to call from one thread at a time
// (the training loop). Destruction waits for every save and flush.
class Checkpointer {
 public:
  static Expected<std::unique_ptr<Checkpointer>> open(Options options);
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Copies the blobs into staging memory and returns; background writers make
  // them durable. Blocks while the staging budget is full. Errors: a bad
  // argument (duplicate name, unknown dtype, size mismatch) or a step already
  // committed. Failures while writing surface through the handle.
  Expected<SaveHandle> save(std::uint64_t step, const std::vector<BlobView>& blobs,
                            const nlohmann::json& meta = nlohmann::json::object(), const SaveOptions& save_options = {});

  // The newest step that verifies on any tier (corrupt ones are skipped with a
  // warning), or nothing.
  std::optional<std::uint64_t> latest();
  // Reads the given step, or the newest that reads back whole, once: each
  // byte is checked against its checksum as it arrives, several reads in
  // flight. A copy that fails (a checksum, a short file) is skipped with a
  // warning and the next candidate is read into fresh targets; a node's
  // partial fast-tier copy is used when it holds every byte asked for.
  // Returns the copy that was read (its manifest and meta).
  Expected<Reader> load(const LoadDestination& dest, std::optional<std::uint64_t> step = std::nullopt);
  // Opens a checkpoint after checking every checksum (reading every byte):
  // the given step, or the latest. Reading its blobs afterwards reads them a
  // second time; load() reads once.
  Expected<Reader> open_reader(std::optional<std::uint64_t> step = std::nullopt);
  // Every complete copy whose manifest and file sizes check, newest step
  // first and the fast tier first within a step, without reading the data:
  // for loaders that verify as they read (Reader::read) and fall back to the
  // next candidate on an error.
  std::vector<Reader> candidates(std::optional<std::uint64_t> step = std::nullopt);

  // Waits for every save and tier flush; returns the first error seen.
  Status flush();

  // Makes the whole staging pool ready in a background thread: allocated,
  // faulted in and, for copies from CUDA device `device` (>= 0), page-locked.
  // Without it the first save pays for that (seconds for a GPU state of many
  // GiB). Returns at once; a second call does nothing. The memory stays
  // with the Checkpointer, as after any save that filled the pool.
  void reserve(int device = -1);

  struct Stats {
    std::uint64_t saves = 0;          // save() calls accepted
    std::uint64_t bytes_staged = 0;   // bytes copied into staging
    std::uint64_t staging_bytes = 0;  // staging memory allocated so far
    std::uint64_t pinned_bytes = 0;   // of which page-locked for the GPU
    std::uint64_t overflow_bytes = 0; // of which overflow beyond the pool (Options::overflow_bytes)
    std::uint64_t pool_waits = 0;     // times save() waited for the writer to hand staging back
    double blocked_s = 0;             // total time save() held the caller
  };
  Stats stats() const;

  const Options& options() const;
  struct Impl;

 private:
  explicit Checkpointer(std::unique_ptr<Impl> impl);
  Expected<SaveHandle> save_impl(std::uint64_t step, const std::vector<BlobView>& blobs, const nlohmann::json& meta,
                                 const SaveOptions& save_options);
  std::unique_ptr<Impl> impl_;
};

// core's optimal_interval and young_interval (pacer/core/stats.hpp), under the
// checkpoint API's names for callers of this library.
double optimal_interval(double save_cost_s, double mtbf_s);
double young_interval(double save_cost_s, double mtbf_s);


}  // namespace pacer::ckpt
