// Data: WebDataset tar shards with an index, and a deterministic, resumable, prefetching loader.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "pacer/core/error.hpp"
#include "pacer/core/host_buffer.hpp"

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
// skipped. A truncated archive, a bad header checksum, a size past the end of
// the file, a malformed pax record, a GNU sparse or multi-volume member, a
// name over 65535 bytes, or a member whose name is absolute or contains "..",
// is an error naming the shard and the offset. Nothing is allocated beyond
// the file's size (pax headers at most 1 MiB). A gzip-compressed shard is
// decompressed into memory first (docs/data.md); offsets are then into the
// decompressed tar.
Expected<std::vector<TarMember>> scan_tar(const std::string& path);

// One WebDataset sample: the members of a shard sharing a key, adjacent or
// not, the name up to the first '.' of its file name ("dir/000017.jpg" -> key
// "dir/000017", ext "jpg"). Samples come in the order their keys first
// appear, fields in member order.
struct Field {
  std::string ext;
  std::uint64_t offset = 0;
  std::uint64_t size = 0;
};
struct SampleEntry {
  std::string key;
  std::vector<Field> fields;
};
// A sample with the same extension twice (or over 65535 fields) is an error
// naming the shard, the member's offset and the key.
Expected<std::vector<SampleEntry>> group_samples(const std::string& shard, const std::vector<TarMember>& members);

// A shard's samples as a dataset holds them: the same as a vector of
// SampleEntry, in a few flat arrays. A vector of SampleEntry takes an
// allocation per sample and about 170 bytes of fresh heap per two-field
// sample; a freshly opened dataset's first epoch paid for those page faults
// and allocations (docs/data.md, "Entries in memory").
class SampleTable {
 public:
  struct FieldRow {
    std::uint64_t offset = 0;
    std::uint64_t size = 0;
    std::uint32_t ext = 0;  // the extension's number in this table (ext())
  };
  std::size_t size() const { return first_.size() > 1 ? first_.size() - 1 : 0; }
  bool empty() const { return size() == 0; }
  std::string_view key(std::size_t i) const { return std::string_view(keys_).substr(key_at_[i], key_at_[i + 1] - key_at_[i]); }
  const FieldRow* fields_begin(std::size_t i) const { return fields_.data() + first_[i]; }
  const FieldRow* fields_end(std::size_t i) const { return fields_.data() + first_[i + 1]; }
  std::size_t field_count(std::size_t i) const { return first_[i + 1] - first_[i]; }
  const std::string& ext(std::uint32_t x) const { return exts_[x]; }
  std::size_t total_fields() const { return fields_.size(); }
  // Asks the CPU for sample i's row (where its key and fields lie).
  void prefetch_row(std::size_t i) const {
    __builtin_prefetch(first_.data() + i, 0, 3);
    __builtin_prefetch(key_at_.data() + i, 0, 3);
  }

  // Reserved ahead so that a table read from an index is one allocation per
  // array; counts from untrusted input are capped by the caller.
  void reserve(std::size_t samples, std::size_t fields, std::size_t key_bytes);
  void add_sample(std::string_view key);
  // A field of the sample added last (of a sample with an empty key when
  // none was added).
  void add_field(std::string_view ext, std::uint64_t offset, std::uint64_t size);
  SampleEntry entry(std::size_t i) const;
  std::vector<SampleEntry> entries() const;
  static SampleTable of(const std::vector<SampleEntry>& entries);

 private:
  std::string keys_;
  std::vector<std::uint64_t> key_at_{0};   // size() + 1
  std::vector<std::uint64_t> first_{0};    // size() + 1: sample i's fields are [first_[i], first_[i+1])
  std::vector<FieldRow> fields_;
  std::vector<std::string> exts_;          // extensions, in order of first appearance (add_field: distinct but for very many)
  std::uint32_t last_ext_ = 0;
};

// The index of one shard, stored beside it as SHARD.pidx (binary, see
// docs/data.md). `samples` is enough to open a dataset; the entries are read
// only when the shard is used. The index is bound to its shard by the
// shard's size, mtime and a checksum of its member headers (not read again
// while the shard's inode and change time are those it had when the checksum
// last matched), and checksums itself.
struct ShardIndex {
  std::string shard;
  std::uint64_t shard_bytes = 0;
  std::uint64_t samples = 0;
  std::int64_t shard_mtime_ns = 0;   // the shard's mtime when it was indexed
  std::uint64_t headers_xxh3 = 0;    // XXH3-64 of every byte that is not a field's padded data (headers, pax and long-name records)
  // The shard's inode and change time (ns) when headers_xxh3 last matched it,
  // and the wall clock then: while both are unchanged the hash is not read again.
  std::uint64_t shard_ino = 0;
  std::int64_t shard_ctime_ns = 0;
  std::int64_t headers_hashed_at_ns = 0;
  std::vector<SampleEntry> entries;  // may be empty when only the header was read
};
std::string index_path(const std::string& shard);
// Whether the shard has an index to read: SHARD.pidx, or a record in its
// directory's index (DIR/.pacer-index, written where a dataset open indexes
// many shards of one directory; docs/data.md). Not whether it fits. A
// directory index that is corrupt (kConfig) or cannot be read (kIo) is an
// error naming it.
Expected<bool> has_index(const std::string& shard);
// Scans the shard and writes its index atomically.
Expected<ShardIndex> build_index(const std::string& shard);
// Reads SHARD.pidx (else the shard's record in its directory index) and
// checks it: its checksums, the shard's size, and (when
// the entries are read, or the shard's mtime is not the indexed one) the
// shard's member headers at the indexed offsets. With `header_only` just the
// sample count when the size and mtime match. An index that does not fit is
// a kConfig error naming it (the shard changed, or the index is corrupt); a
// file that cannot be read is kIo.
Expected<ShardIndex> read_index(const std::string& shard, bool header_only);
// read_index; a missing index is built (and written when the directory is
// writable, else kept in memory); an index that does not fit is rebuilt and
// replaced, or, when it cannot be replaced (a read-only dataset), an error
// naming the shard.
Expected<ShardIndex> load_or_build_index(const std::string& shard, bool header_only);

// The indexes `pacer shard index` (re)built: its record (schema
// pacer.shard.index/1, docs/data.md).
struct IndexReport {
  struct Shard {
    std::string path;
    std::uint64_t samples = 0;
    std::uint64_t bytes = 0;  // of the shard
    std::string index;        // index_path(path)
  };
  std::vector<Shard> shards;
  std::uint64_t samples = 0;  // over every shard
};
nlohmann::json to_json(const IndexReport& report);

// ---------------------------------------------------------------------------
// Datasets

// Expands "train-{000000..000099}.tar", "a-{x,y}.tar" and shell globs to
// paths, in order. A spec naming a .json file is read as a pack manifest.
Expected<std::vector<std::string>> expand_shard_spec(const std::string& spec);

class BatchBuffer;
}  // namespace pacer::data
namespace pacer {
class MappedFile;
}  // namespace pacer
namespace pacer::data {

// An opened set of shards: samples are numbered 0..size()-1 across shards in
// shard order. Thread-safe for reads.
class Dataset {
 public:
  static Expected<std::shared_ptr<Dataset>> open(const std::string& spec);
  static Expected<std::shared_ptr<Dataset>> open(const std::vector<std::string>& shards);
  ~Dataset();

  std::uint64_t size() const { return total_; }
  // What it was opened from, for messages: the spec, or its shards.
  const std::string& name() const { return name_; }
  const std::vector<std::string>& shards() const { return shards_; }
  const std::vector<std::uint64_t>& shard_samples() const { return counts_; }

  struct Sample {
    std::string key;
    std::vector<std::pair<std::string, std::string>> fields;  // ext, bytes
  };
  // Reads global sample i. Blocks on I/O; safe from several threads.
  Expected<Sample> read(std::uint64_t i) const;
  // Appends sample i's bytes to `buf` (one read of the span when its members
  // are adjacent in the shard, headers between included; one read per field
  // when they are scattered) and returns its key and fields, their offsets
  // now into `buf`.
  Expected<SampleEntry> read_into(std::uint64_t i, BatchBuffer& buf) const;
  // Shards are read through a mapping, and whether a shard was truncated
  // under a read is known only from its size afterwards (docs/data.md,
  // "Reading mapped shards"). read() and read_into(i, buf) check it per
  // sample; read_into with a ReadCheck leaves it to one confirm() for many
  // samples, whose bytes are the shards' only once confirm() passes.
  struct ReadCheck {
    std::vector<std::pair<std::size_t, std::uint64_t>> ends;  // shard, end of the furthest byte read
  };
  Expected<SampleEntry> read_into(std::uint64_t i, BatchBuffer& buf, ReadCheck* check) const;
  Status confirm(const ReadCheck& check) const;
  // read_into(i, buf, check) without copying the entry out: returns where
  // sample i's entry lies (its shard's table, valid while the dataset is
  // open and the SampleRef is held) and sets
  // at[k] to where its field k now lies in `buf` (the loader's per-sample
  // path: copying the key and every extension per sample cost it ~8% of an
  // epoch, bench/results/loader_speed-2026-12-01.md).
  struct SampleRef {
    const SampleTable* table = nullptr;
    std::size_t row = 0;
    // Keeps the table alive where the shard may be closed (or its entries
    // replaced) under the reader: empty for a shard the dataset keeps open.
    std::shared_ptr<const SampleTable> hold;
  };
  Expected<SampleRef> read_fields(std::uint64_t i, BatchBuffer& buf, ReadCheck* check, std::vector<std::uint64_t>& at) const;
  // A hint (no I/O, no lock, never an error; nothing unless sample i's
  // shard is open and mapped): stage 0 starts bringing sample i's bytes into
  // the CPU caches, stage 1 its entry's field list, stage 2 its entry. A
  // reader that knows its next samples issues 2, 1, 0 a few samples apart,
  // so each stage finds the memory the one before fetched and the latency of
  // shuffled reads overlaps the copy of the current sample. The first stage 0
  // of a shard also fills its mapping's page tables where the page cache
  // holds it (MappedFile::map_pages_if_cached): a loader reads all of it.
  void prefetch(std::uint64_t i, int stage = 0) const;

  struct Impl;

 private:
  struct Located;
  Expected<Located> locate(std::uint64_t i) const;
  // Reads sample i's span (its first field's data to the end of its last)
  // with one copy into room(bytes); field offsets are relative to the span.
  Expected<SampleEntry> read_span(std::uint64_t i, const std::function<unsigned char*(std::uint64_t)>& room, ReadCheck* check = nullptr) const;
  // read_span's work: at[k] is field k's offset from the start of room().
  Expected<SampleRef> read_located(std::uint64_t i, const std::function<unsigned char*(std::uint64_t)>& room, ReadCheck* check,
                                            std::vector<std::uint64_t>& at) const;
  Dataset() = default;
  std::string name_;
  std::vector<std::string> shards_;
  std::vector<std::uint64_t> counts_;
  std::vector<std::uint64_t> starts_;
  std::uint64_t total_ = 0;
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------
// Token datasets: Megatron-Core indexed datasets (PREFIX.bin + PREFIX.idx,
// the "MMIDIDX" layout). The .idx is read whole; the .bin stays open and
// mapped, and tokens are read through a SIGBUS-guarded MappedFile, so a
// .bin truncated while it is open is an error naming it, never a SIGBUS.
//
// PREFIX.idx: 9-byte header "MMIDIDX\0\0", u64 version 1, u8 dtype code
// (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
// 8 uint16), u64 sequence count S, u64 document index count D, then int32
// sequence lengths[S] (in elements), int64 sequence byte offsets[S] into
// PREFIX.bin, int64 document indices[D] (sequence index boundaries, starting
// at 0: document d is sequences [doc[d], doc[d+1])). Little-endian.
class TokenDataset {
 public:
  // Every length, offset and boundary is checked against the file sizes, so
  // a .bin shorter than its .idx claims is an error here. Errors name the file.
  static Expected<std::shared_ptr<TokenDataset>> open(const std::string& prefix);
  ~TokenDataset();
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  const std::string& dtype() const { return dtype_; }
  std::size_t itemsize() const { return itemsize_; }
  std::uint64_t sequences() const { return lengths_.size(); }
  std::uint64_t documents() const { return doc_index_.empty() ? 0 : doc_index_.size() - 1; }
  std::uint64_t tokens() const { return total_tokens_; }
  std::uint64_t length(std::uint64_t seq) const { return static_cast<std::uint64_t>(lengths_.at(seq)); }
  // The raw elements of a sequence (length(seq) * itemsize() bytes).
  Expected<std::string> bytes(std::uint64_t seq) const;
  // A sequence's tokens widened to int64 (float datasets are refused).
  Expected<std::vector<std::int64_t>> read(std::uint64_t seq) const;
  // Sequences [first, last) of document d.
  std::pair<std::uint64_t, std::uint64_t> document(std::uint64_t d) const;
  // Tokens in document d (the sum of its sequences' lengths).
  std::uint64_t document_tokens(std::uint64_t d) const;
  // Copies tokens [offset, offset + count) of document d, widened to int64,
  // to `out`. Float datasets and ranges past the document are refused.
  Status copy_tokens(std::uint64_t d, std::uint64_t offset, std::uint64_t count, std::int64_t* out) const;
  // The same with the .bin's size check left to check_size(*furthest) (one
  // system call for many copies; docs/data.md, "Token datasets"): *furthest
  // grows to the end of the bytes read, which are the file's only once
  // check_size has passed.
  Status copy_tokens(std::uint64_t d, std::uint64_t offset, std::uint64_t count, std::int64_t* out, std::uint64_t* furthest) const;
  Status check_size(std::uint64_t furthest) const;
  // A hint for copy_tokens(d, offset, ...) soon (no I/O, never an error):
  // stage 2 prefetches document d's index entry, stage 1 its first
  // sequence's length and offset, stage 0 the first pages of its tokens in
  // the mapped .bin. A loader issues them a few pieces ahead (2, 1, 0), so
  // shuffled documents' memory latency overlaps the widening of the current
  // one (bench/results/tokens_speed-2026-12-01.md).
  void prefetch(std::uint64_t d, std::uint64_t offset, int stage) const;
  // The loss mask of an SFT dataset (sft_mask_prefix(prefix) exists beside
  // it), else null: a uint8 dataset of the same shape, 1 for trained tokens.
  const TokenDataset* loss_mask() const { return mask_.get(); }

 private:
  TokenDataset() = default;
  std::shared_ptr<TokenDataset> mask_;
  std::string prefix_;
  std::string dtype_;
  std::size_t itemsize_ = 0;
  std::vector<std::int32_t> lengths_;
  std::vector<std::int64_t> pointers_;
  std::vector<std::int64_t> doc_index_;
  std::uint64_t total_tokens_ = 0;
  int bin_fd_ = -1;
  std::uint64_t bin_size_ = 0;  // when opened
  std::unique_ptr<MappedFile> bin_map_;  // the .bin mapped, or null (read with pread)
  // Reads n bytes of the .bin at `offset` (of sequence `seq`, for messages).
  Status read_bin(std::uint64_t offset, std::size_t n, void* out, std::uint64_t seq) const;
  // Elements [first, first + n) of sequence seq, widened to int64; with
  // `furthest`, the mapped read's size check is the caller's.
  Status widen(std::uint64_t seq, std::uint64_t first, std::uint64_t n, std::int64_t* out, std::uint64_t* furthest = nullptr) const;
};

// One packed training sequence: pieces of documents laid end to end.
struct PackedSequence {
  std::vector<std::int64_t> tokens;        // seq_len ids, the tail padded with pad_id
  std::vector<std::int32_t> cu_seqlens;    // piece boundaries: 0, end of piece 1, ..., used length
  std::vector<std::int32_t> position_ids;  // restart at 0 at every piece (for varlen attention)
  std::vector<std::uint64_t> documents;    // the document of each piece
};

struct PackStats {
  std::uint64_t sequences = 0;
  std::uint64_t tokens = 0;        // real tokens
  std::uint64_t padding = 0;       // pad tokens
  double padding_fraction() const { return sequences ? double(padding) / double(padding + tokens) : 0; }
};

// Where packing puts each piece of each document, without reading tokens:
// row r is pieces[first_piece[r] .. first_piece[r+1]), laid end to end.
struct PackPiece {
  std::uint64_t document = 0;
  std::uint64_t offset = 0;  // first token of the piece within its document
  std::uint64_t length = 0;
};
struct PackPlan {
  std::uint64_t seq_len = 0;
  std::vector<PackPiece> pieces;
  std::vector<std::uint64_t> first_piece{0};  // rows + 1 entries
  PackStats stats;
  std::uint64_t rows() const { return first_piece.size() - 1; }
};

// Plans the packing pack_documents performs (same rows, same order) from
// document lengths alone; O(pieces log rows-per-window). Windows are
// independent: with `threads` > 1, runs of them are planned on that many
// threads (when there are enough), with the same result.
Expected<PackPlan> plan_packing(const TokenDataset& ds, const std::vector<std::uint64_t>& order, std::uint64_t seq_len,
                                std::uint64_t window, int threads = 1);

// Packs the documents of `order` (document ids, e.g. a shuffled epoch) into
// sequences of seq_len tokens: within each window of `window` documents,
// best-fit decreasing (longest piece first, into the open sequence it fills
// most tightly). A document longer than seq_len is split into seq_len-long
// pieces. Deterministic for the same inputs; every token of every document
// appears exactly once, in document order within a piece.
Expected<std::vector<PackedSequence>> pack_documents(const TokenDataset& ds, const std::vector<std::uint64_t>& order,
                                                     std::uint64_t seq_len, std::uint64_t window, std::int64_t pad_id,
                                                     PackStats* stats = nullptr);

// A test vocabulary for `pacer shard tokenize --vocab` (real models:
// pacer/data/tokenize.hpp): one token per line of a text file,
// its id the line number (from 0). Encoding is greedy longest match over the
// bytes; a byte no token covers becomes id size() + byte (byte-level
// fallback), so any text encodes and decodes losslessly. Without a file the
// vocabulary is empty and every byte is its own id (0..255).
class Vocabulary {
 public:
  static Expected<Vocabulary> load(const std::string& path);
  static Vocabulary bytes_only() { return Vocabulary(); }
  std::size_t size() const { return tokens_.size(); }
  // Ids run up to size() + 255.
  std::uint64_t id_limit() const { return tokens_.size() + 256; }
  std::vector<std::int64_t> encode(std::string_view text) const;
  std::string decode(const std::vector<std::int64_t>& ids) const;

 private:
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, std::int64_t> ids_;
  std::size_t max_len_ = 0;
};

// Writes a token dataset: one sequence per document, each a vector of token
// ids, in `dtype` ("uint16" or "int32" as Megatron writes them; any integer
// dtype above). Both files are replaced atomically.
Status write_token_dataset(const std::string& prefix, const std::string& dtype,
                           const std::vector<std::vector<std::int64_t>>& documents);

// ---------------------------------------------------------------------------
// Order: a seeded permutation of [0, n) computed per index (no table in
// memory): a Feistel network on the next power of four, cycle-walking into
// range. Same seed and epoch, same order; a new order each epoch.
class Permutation {
 public:
  Permutation(std::uint64_t n, std::uint64_t seed, std::uint64_t epoch);
  std::uint64_t operator()(std::uint64_t i) const;
  // out[k] = (*this)(lo + k) for k in [0, hi - lo): the same values,
  // several indices walked at once (a walk is a chain of dependent
  // multiplies; interleaved, the CPU overlaps them).
  void fill(std::uint64_t lo, std::uint64_t hi, std::uint64_t* out) const;
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
  int threads = 2;                        // reader threads (0: next() reads each batch)
  std::uint64_t prefetch_batches = 4;     // batches read ahead
  std::uint64_t max_bytes = 512ull << 20; // bound on bytes held in prefetched batches
  bool skip_bad = false;                  // skip unreadable samples (counted) instead of failing
  bool loop = false;                      // start the next epoch instead of ending
  bool pin_memory = false;                // page-lock batch buffers for device copies (when CUDA is present)

  // Token datasets only (ignored for tar shards):
  std::uint64_t seq_len = 0;        // row length: packed rows are exactly this long; unpacked rows are cut to it (0: no cut)
  bool pack = false;                // pack documents into seq_len-token rows (best-fit decreasing within pack_window)
  std::uint64_t pack_window = 1000; // documents per packing window
  std::uint64_t bucket_window = 0;  // unpacked: sort documents by length within windows of this many global batches (0: off)
  std::int64_t pad_id = 0;
};

// Host memory a batch's bytes live in, in transparent huge pages (2 MiB at
// least). It grows by doubling and keeps its pages when reused, so a loader
// in its steady state neither allocates nor faults pages; with `pin` it is
// page-locked (cudaHostRegister) when a CUDA runtime and GPU are present, so
// device copies from it can run asynchronously. Not thread-safe; one batch
// at a time owns it.
class BatchBuffer {
 public:
  explicit BatchBuffer(bool pin = false) : pin_(pin) {}
  ~BatchBuffer();
  BatchBuffer(const BatchBuffer&) = delete;
  BatchBuffer& operator=(const BatchBuffer&) = delete;

  unsigned char* data() { return mem_.data(); }
  const unsigned char* data() const { return mem_.data(); }
  std::size_t size() const { return size_; }
  std::size_t capacity() const { return mem_.size(); }
  bool pinned() const { return pinned_; }
  void clear() { size_ = 0; }
  // Drops everything from byte n on (n <= size()).
  void truncate(std::size_t n) { size_ = n < size_ ? n : size_; }
  // Makes room for n more bytes (8-byte aligned start) and returns their
  // offset; earlier pointers into the buffer are invalidated by growth.
  std::size_t append(std::size_t n);

 private:
  void reserve(std::size_t bytes);
  HostBuffer mem_;
  std::size_t size_ = 0;
  bool pin_ = false;
  bool pinned_ = false;
};

// A field of a sample in a batch: its extension (an index into Batch::exts)
// and where its bytes are in the batch's buffer.
struct BatchField {
  std::uint32_t ext = 0;
  std::uint64_t offset = 0;
  std::uint64_t size = 0;
};

// One batch, its bytes in one buffer. Tar-shard loaders fill keys/exts/
// fields; token loaders fill the row fields. The buffer goes back to the
// loader's pool when the last Batch (or copy of the shared_ptr) holding it
// is gone.
struct Batch {
  std::uint64_t epoch = 0;
  std::uint64_t global_batch = 0;
  std::shared_ptr<BatchBuffer> buffer;

  // Tar samples: sample i has fields[first_field[i] .. first_field[i+1]).
  std::vector<std::string> keys;
  std::vector<std::string> exts;            // distinct extensions, in order of first appearance
  std::vector<std::size_t> first_field{0};  // keys.size() + 1 entries
  std::vector<BatchField> fields;

  // Token rows: `rows` x `cols` int64 tokens and int32 position ids in the
  // buffer, row-major. Segments are the pieces of documents laid in the rows
  // plus each row's padded tail: cu_seqlens (segments + 1 entries, over the
  // flattened rows, ending at rows*cols) bounds them; documents[k] is segment
  // k's document, -1 for padding. Position ids restart at 0 in every segment.
  std::uint64_t rows = 0;
  std::uint64_t cols = 0;
  std::size_t tokens_offset = 0;
  std::size_t positions_offset = 0;
  std::vector<std::int32_t> cu_seqlens;
  std::vector<std::int64_t> documents;
  std::vector<std::int64_t> lengths;  // real tokens per row
  std::uint64_t padding = 0;          // pad tokens in the batch
  std::uint64_t truncated = 0;        // tokens cut from documents longer than seq_len (unpacked)
  // SFT data (a token dataset with a loss mask, see sft_mask_prefix): int64
  // labels and uint8 loss_mask [rows, cols] in the buffer. labels[j] is the
  // token at j+1 when j+1 is a trained token of the same segment, else
  // kIgnoreLabel; loss_mask[j] is 1 exactly where labels[j] is a token.
  bool has_labels = false;
  std::size_t labels_offset = 0;
  std::size_t loss_mask_offset = 0;
  // Blends: the blend's dataset (its index) of each sample or row.
  std::vector<std::int32_t> datasets;

  // Samples (tar) or rows (tokens).
  std::size_t size() const { return rows ? rows : keys.size(); }
  std::string_view bytes(const BatchField& f) const {
    return {reinterpret_cast<const char*>(buffer->data()) + f.offset, f.size};
  }
  // Sample i with its bytes copied out.
  Dataset::Sample sample(std::size_t i) const;
  const std::int64_t* tokens() const { return reinterpret_cast<const std::int64_t*>(buffer->data() + tokens_offset); }
  const std::int32_t* position_ids() const { return reinterpret_cast<const std::int32_t*>(buffer->data() + positions_offset); }
  const std::int64_t* labels() const { return reinterpret_cast<const std::int64_t*>(buffer->data() + labels_offset); }
  const std::uint8_t* loss_mask() const { return buffer->data() + loss_mask_offset; }
};

struct LoaderStats {
  std::uint64_t batches = 0;
  std::uint64_t samples = 0;      // tar samples, or token rows
  std::uint64_t bytes = 0;        // payload bytes delivered (token rows: 8 per token, padding included)
  std::uint64_t skipped = 0;
  std::uint64_t tokens = 0;       // token loaders: real tokens delivered
  std::uint64_t padding = 0;      // token loaders: pad tokens delivered
  std::uint64_t truncated = 0;    // token loaders: tokens cut by seq_len
  double wait_s = 0;        // time the consumer waited for data, total
  double last_wait_s = 0;   // for the last batch
  double elapsed_s = 0;     // since the first next()
  std::uint64_t queue_depth = 0;  // batches ready when the last one was taken
  std::uint64_t consumer_reads = 0;  // batches next() read itself rather than wait for a reader
  double padding_fraction() const { return tokens + padding ? double(padding) / double(tokens + padding) : 0; }
};

// Reads batches for one rank in the order the Permutation and Partition give,
// with reader threads ahead of the consumer. next() blocks; the loader is
// used from one consumer thread. state() is a few integers from which a new
// loader (any world size with the same global batch) continues exactly.
//
// Over a TokenDataset the items are documents: without `pack` each row is a
// document (cut to seq_len when seq_len > 0, rows padded to the longest in
// the batch), optionally bucketed by length; with `pack` the epoch's shuffled
// documents are packed into seq_len-token rows (plan_packing) and the rows are
// what the ranks share. Either way the order depends only on (seed, epoch).
class Loader {
 public:
  static Expected<std::unique_ptr<Loader>> open(std::shared_ptr<Dataset> ds, LoaderOptions options);
  static Expected<std::unique_ptr<Loader>> open(std::shared_ptr<TokenDataset> ds, LoaderOptions options);
  // A weighted blend (struct Blend, below): options.seed seeds every dataset's order.
  static Expected<std::unique_ptr<Loader>> open(const struct Blend& blend, LoaderOptions options);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // The next batch, or nothing at the end of the epoch (unless `loop`).
  Expected<std::optional<Batch>> next();
  // {"schema", "seed", "epoch", "position", "global_batch", "samples", "order"}
  nlohmann::json state() const;
  Status load_state(const nlohmann::json& state);
  // Starts epoch `epoch` from its beginning.
  void set_epoch(std::uint64_t epoch);
  LoaderStats stats() const;
  // Global batches in the current epoch (packed token loaders: the number
  // of rows differs from epoch to epoch).
  std::uint64_t batches_per_epoch() const;

  struct Impl;
  struct Source;

 private:
  static Expected<std::unique_ptr<Loader>> start(std::unique_ptr<Source> src, LoaderOptions options);
  explicit Loader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------
// Shard sets: pack, inspect, verify (what `pacer shard` runs; docs/data.md)
//
// Each call blocks until it is done and prints nothing; progress goes to the
// optional callback, always on the calling thread, so the callback needs no
// locking. Problems with the input (a missing path, a malformed manifest) are
// Errors; in verify_shards a bad shard is a finding in the report instead.

// What pack_shards packs and where.
struct PackOptions {
  // A directory: its regular files, hidden ones (and the output directory)
  // skipped, grouped into samples by key and sorted by key, then extension.
  // A file: one sample per non-empty line, keyed by its line number (from 1,
  // zero-padded to at least 9 digits); field "json" for .jsonl/.ndjson (every
  // line must parse), "txt" otherwise.
  std::string src;
  std::string out;                           // created when missing
  std::uint64_t target_bytes = 256'000'000;  // a shard closes before it would pass this; a sample is never split
  std::string prefix = "train";              // shard names PREFIX-000000.tar, ...: no '/', not starting with '.'
  int jobs = 1;                              // shards written in parallel, at least 1
};

// How far the writing has come; shards already complete on disk are not counted.
struct PackProgress {
  std::size_t shards_done = 0;
  std::size_t shards_total = 0;
  std::uint64_t bytes_done = 0;
  std::uint64_t bytes_total = 0;
  double elapsed_s = 0;  // since writing began
};

struct PackedShard {
  std::string path;  // file name in `out`
  std::uint64_t samples = 0;
  std::uint64_t bytes = 0;  // the whole file, end-of-archive blocks included
  std::uint64_t xxh3 = 0;   // XXH3-64 of the whole file
  bool written = false;     // false: already complete on disk, left as it was
};

struct PackReport {
  std::string src, out;      // as given
  std::string manifest;      // path of OUT/manifest.json
  std::string version;       // XXH3-64 of the shard checksums in order, 16 hex digits
  std::uint64_t samples = 0;
  std::uint64_t bytes = 0;
  std::vector<PackedShard> shards;   // in order
  std::vector<std::string> removed;  // file names of shards and indexes beyond this plan, deleted
  bool manifest_changed = false;

  std::size_t written() const;
  std::size_t up_to_date() const { return shards.size() - written(); }
};

// Packs SRC into tar shards in OUT, each with its .pidx index, and writes
// OUT/manifest.json (schema pacer.shards/1). A shard is a pure function of
// its plan (member names, sizes, source mtimes, bytes), so the output does not
// depend on `jobs`, and a rerun recognises complete shards by their header
// blocks and writes only what is missing or changed: an interrupted pack is
// resumed by calling it again. Each shard is written as .PREFIX-NNNNNN.tar.partial,
// fsynced and renamed into place; the manifest is replaced atomically, and
// only when its contents change. Leftover temporaries of PREFIX and
// PREFIX-NNNNNN.tar(.pidx) files numbered beyond this plan are deleted.
// Holds an exclusive lock (flock) on OUT throughout: a second pack into the
// same directory fails with ErrorKind::kIo rather than interleaving.
// `on_progress` is called about every 100 ms while shards are written (not at
// all when every shard is up to date). Runs `jobs` threads of its own.
Expected<PackReport> pack_shards(const PackOptions& options, const std::function<void(const PackProgress&)>& on_progress = {});
// Schema pacer.shard.pack/1.
nlohmann::json to_json(const PackReport& report);

// Called before each shard is read: `index` counts from 0 up to `count` - 1.
struct ShardStep {
  std::size_t index = 0;
  std::size_t count = 0;
  std::string path;
};

struct InspectedShard {
  std::string path;
  std::uint64_t samples = 0;
  std::uint64_t bytes = 0;
  std::map<std::string, std::uint64_t> fields;  // extension -> samples that have it
  std::string first_key, last_key;              // empty for a shard without samples
};

struct InspectReport {
  std::string spec;
  std::vector<InspectedShard> shards;
  std::uint64_t samples = 0;
  std::uint64_t bytes = 0;
  std::map<std::string, std::uint64_t> fields;  // over all shards
  std::vector<std::string> first_keys;          // the first five of the set
};

// Counts the samples and fields of the shards SPEC names (expand_shard_spec).
// Reads each shard's index when present and valid, else scans the shard;
// writes nothing. A shard that cannot be read is an error.
Expected<InspectReport> inspect_shards(const std::string& spec, const std::function<void(const ShardStep&)>& on_shard = {});
// Schema pacer.shard.inspect/1.
nlohmann::json to_json(const InspectReport& report);

struct VerifiedShard {
  std::string path;
  std::uint64_t samples = 0;  // found by the scan
  std::uint64_t bytes = 0;
  std::string xxh3;           // 16 hex digits, when the manifest asked for a checksum
  std::string problem;        // empty when the shard passed
  bool indexed = false;       // it has an index, SHARD.pidx or a directory index record (a missing one is no problem: readers build it)
  bool ok() const { return problem.empty(); }
};

struct VerifyReport {
  std::string spec;
  bool manifest = false;  // SPEC was a manifest
  std::vector<VerifiedShard> shards;
  std::vector<std::string> manifest_problems;  // version or sample total not matching its shards
  std::uint64_t samples = 0;
  // "PATH: problem" for each bad shard, then "SPEC: problem" for each manifest problem.
  std::vector<std::string> failures;
  bool ok() const { return failures.empty(); }
};

// Checks shards without changing them. With a manifest (SPEC ending in
// .json, schema pacer.shards/1; shard paths relative to its directory and
// inside it): every listed shard exists with the listed size, samples and
// XXH3-64, and the manifest's version and total match its shards. Always:
// each shard scans cleanly and its index, where it has one, matches the scan
// (a missing index is reported in `indexed`, not as a failure, so a
// read-only dataset without indexes verifies). Reads every byte
// of every shard that has a checksum to check. A missing SPEC, a SPEC that
// names no shard or a malformed manifest is an Error.
Expected<VerifyReport> verify_shards(const std::string& spec, const std::function<void(const ShardStep&)>& on_shard = {});
// Schema pacer.shard.verify/1.
nlohmann::json to_json(const VerifyReport& report);

// XXH3-64 of a whole file, read in large chunks (the checksums of pack and verify).
Expected<std::uint64_t> file_xxh3(const std::string& path);

// ---------------------------------------------------------------------------
// Blends (src/data/blend.cpp, docs/data.md "Blends")

// A weighted mixture of datasets of one kind, read as one stream by a Loader.
// Which dataset each blend position draws from is the quota schedule below;
// each dataset is read in its own seeded per-epoch order (the loader's seed
// mixed with the dataset's place in the list), and a dataset that runs out
// starts its next epoch. The blend's epoch is samples_per_epoch positions.
struct Blend {
  std::vector<std::shared_ptr<Dataset>> datasets;             // tar shards, or
  std::vector<std::shared_ptr<TokenDataset>> token_datasets;  // token datasets; not both
  std::vector<double> weights;                                // one per dataset: >= 0, finite, sum > 0
  std::uint64_t samples_per_epoch = 0;                        // 0: the datasets' items together
};

// Balinski and Young's quota method, one draw at a time: the next draw goes
// to the dataset with the largest w_i / (c_i + 1) among those whose count c_i
// is still below w_i * (n + 1). After n draws every dataset has been drawn
// floor(w_i n) or ceil(w_i n) times, for every n. Weights are normalized and
// rounded to integers q_i summing to about 2^32, and the arithmetic is exact
// on those (w_i n moves by less than one draw through the rounding until n
// passes 2^32). The counts are the whole state: a schedule continued from
// saved counts draws what the uninterrupted one would have.
class BlendSchedule {
 public:
  // `names` name the datasets in errors (a negative, NaN or infinite weight;
  // weights whose sum is not positive).
  static Expected<BlendSchedule> make(const std::vector<double>& weights, const std::vector<std::string>& names);
  // The next draw's dataset; its count goes up.
  std::size_t next();
  // Continues from these counts (one per dataset).
  void set_counts(std::vector<std::uint64_t> counts);
  const std::vector<std::uint64_t>& counts() const { return counts_; }
  std::uint64_t draws() const { return draws_; }
  // The weights as rounded (q_i / sum q).
  std::vector<double> weights() const;
  bool same_weights(const BlendSchedule& other) const { return q_ == other.q_; }

 private:
  std::vector<std::uint64_t> q_;
  std::uint64_t total_ = 0;
  std::vector<std::uint64_t> counts_;
  std::uint64_t draws_ = 0;
};

// ---------------------------------------------------------------------------
// SFT data (src/data/sft.cpp, docs/data.md "SFT data")

// Label of a position that trains nothing (PyTorch's cross_entropy ignore_index default).
constexpr std::int64_t kIgnoreLabel = -100;

// The prefix of the loss mask beside token dataset PREFIX: PREFIX.mask
// (PREFIX.mask.bin + PREFIX.mask.idx, uint8, one element per token).
std::string sft_mask_prefix(const std::string& prefix);

// Writes an SFT dataset: the tokens of each sample as a token dataset in
// `dtype`, and their mask (1: a trained token, 0: prompt) as the uint8
// dataset sft_mask_prefix(prefix). masks[d] must be as long as documents[d].
// The mask is written first, so a reader never sees new tokens with an old mask
// of another shape (the shapes are checked when the pair is opened).
Status write_sft_dataset(const std::string& prefix, const std::string& dtype, const std::vector<std::vector<std::int64_t>>& documents,
                         const std::vector<std::vector<std::uint8_t>>& masks);

}  // namespace pacer::data
