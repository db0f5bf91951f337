// The asynchronous checkpoint writer: staging, background persistence, commit, tiers and retention.
#include <fcntl.h>
#include <sys/file.h>
#include <fmt/chrono.h>
#include <fmt/format.h>
#include <stdio.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <charconv>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "ckpt_internal.hpp"
#include "pacer/checkpoint.hpp"
#include "pacer/comm/communicator.hpp"
#include "pacer/core/atomic_file.hpp"
#include "pacer/core/host_buffer.hpp"
#include "pacer/core/posix_io.hpp"
#include "pacer/core/stats.hpp"
#include "pacer/core/time.hpp"
#include "pacer/hw/cuda_host.hpp"
#include "pacer/hw/system.hpp"

namespace pacer::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

// ---------------------------------------------------------------------------
// Small shared helpers.

std::string temp_dir_name(std::uint64_t step, const std::string& host, int pid) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  return fmt::format(".partial-{}-{}-{}-{:08x}", step_dir_name(step), host, pid, static_cast<std::uint32_t>(rng()));
}

std::optional<TempName> parse_temp_dir_name(const std::string& name) {
  const std::string prefix = ".partial-step-";
  if (name.rfind(prefix, 0) != 0) return std::nullopt;
  TempName t;
  const char* p = name.data() + prefix.size();
  const char* end = name.data() + name.size();
  auto [q, ec] = std::from_chars(p, end, t.step);
  if (ec != std::errc() || q == end || *q != '-') return std::nullopt;
  // host may contain dashes: pid and nonce are the last two fields.
  const std::string rest(q + 1, end);
  const auto nonce_dash = rest.rfind('-');
  if (nonce_dash == std::string::npos) return std::nullopt;
  const auto pid_dash = rest.rfind('-', nonce_dash - 1);
  if (pid_dash == std::string::npos) return std::nullopt;
  t.host = rest.substr(0, pid_dash);
  t.pid = std::atoi(rest.substr(pid_dash + 1, nonce_dash - pid_dash - 1).c_str());
  return t;
}

Status rename_no_replace(const std::string& from, const std::string& to) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return {};
  if (errno == EINVAL || errno == ENOSYS) {
    // No RENAME_NOREPLACE here (some network filesystems): rename(2) still
    // refuses to replace a non-empty directory, and a step directory never is empty.
    if (::rename(from.c_str(), to.c_str()) == 0) return {};
  }
  const int err = errno;
  if (err == EEXIST || err == ENOTEMPTY)
    return Error{ErrorKind::kUsage, fmt::format("{}: already committed by another saver", to)};
  return Error{ErrorKind::kIo, fmt::format("cannot rename {} to {}: {}", from, to, std::strerror(err))};
}

std::vector<ReplicatedPiece> split_replicated(const std::vector<BlobView>& blobs, int ranks, std::uint64_t whole_below) {
  constexpr std::uint64_t kCut = 4096;
  std::vector<std::size_t> large, small;
  for (std::size_t i = 0; i < blobs.size(); ++i)
    if (blobs[i].layout == Layout::kReplicated) (blobs[i].size > 0 && blobs[i].size >= whole_below ? large : small).push_back(i);
  auto by_name = [&](std::size_t a, std::size_t b) { return blobs[a].name < blobs[b].name; };
  std::sort(large.begin(), large.end(), by_name);
  std::vector<ReplicatedPiece> out;
  const auto n = static_cast<std::uint64_t>(std::max(ranks, 1));
  std::vector<std::uint64_t> load(n, 0);
  // The large blobs, end to end, cut into n equal runs; each cut moves back to
  // a 4 KiB boundary of the blob it falls in.
  std::uint64_t total = 0;
  for (auto i : large) total += blobs[i].size;
  std::vector<std::uint64_t> cuts(n + 1, total);
  for (std::uint64_t k = 0; k < n; ++k) {
    const auto ideal = static_cast<std::uint64_t>(static_cast<unsigned __int128>(total) * k / n);
    std::uint64_t start = 0;
    for (auto i : large) {
      if (ideal < start + blobs[i].size) {
        cuts[k] = start + (ideal - start) / kCut * kCut;
        break;
      }
      start += blobs[i].size;
    }
  }
  std::uint64_t start = 0;
  for (auto i : large) {
    const std::uint64_t end = start + blobs[i].size;
    for (std::uint64_t k = 0; k < n; ++k) {
      const std::uint64_t lo = std::max(start, cuts[k]), hi = std::min(end, cuts[k + 1]);
      if (lo >= hi) continue;
      out.push_back({i, lo - start, hi - start, static_cast<int>(k)});
      load[k] += hi - lo;
    }
    start = end;
  }
  // Small blobs whole, largest first, each to the least loaded rank.
  std::sort(small.begin(), small.end(), [&](std::size_t a, std::size_t b) {
    return blobs[a].size != blobs[b].size ? blobs[a].size > blobs[b].size : blobs[a].name < blobs[b].name;
  });
  for (auto i : small) {
    const auto k = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    out.push_back({i, 0, blobs[i].size, static_cast<int>(k)});
    load[k] += blobs[i].size;
  }
  return out;
}

namespace {

Status write_small_file(const std::string& path, const std::string& text) {
  auto fd = open_fd(path, O_WRONLY | O_CREAT | O_TRUNC);
  if (!fd) return fd.error();
  if (Status st = pwrite_full(fd->get(), text.data(), text.size(), 0, path); !st) return st;
  if (Status st = fsync_fd(fd->get(), path); !st) return st;
  return fd->close(path);
}

constexpr std::uint64_t kAlign = 4096;
std::uint64_t align_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

// ---- replicated blobs across ranks ------------------------------------------

// The part-manifest key of the digest of a rank's replicated blobs.
constexpr const char* kReplicatedKey = "replicated_xxh3";

std::string replicated_list_path(const std::string& tmp_dir, int rank) {
  return fmt::format("{}/rank-{:05d}.replicated.json", tmp_dir, rank);
}

// [[name, dtype, shape, size], ...] of the replicated blobs, ordered by name:
// what every rank must agree on before splitting the writing.
std::string replicated_list(const std::vector<BlobView>& blobs) {
  std::vector<const BlobView*> rep;
  for (const auto& b : blobs)
    if (b.layout == Layout::kReplicated) rep.push_back(&b);
  std::sort(rep.begin(), rep.end(), [](const BlobView* a, const BlobView* b) { return a->name < b->name; });
  json list = json::array();
  for (const auto* b : rep) list.push_back({b->name, b->dtype, b->shape, b->size});
  return list.dump();
}

std::string describe_replicated(const json& e) {
  return fmt::format("{} {} ({} bytes)", e.at(1).get<std::string>(), e.at(2).dump(), e.at(3).get<std::uint64_t>());
}

// Why rank r's replicated blobs are not rank `ref`'s, naming the first blob
// that differs; the lists are the ranks' own files, read only on a mismatch.
std::string replicated_difference(const std::string& tmp_dir, int ref, int r) {
  auto a = read_file(replicated_list_path(tmp_dir, ref));
  auto b = read_file(replicated_list_path(tmp_dir, r));
  const json ja = a ? json::parse(*a, nullptr, false) : json();
  const json jb = b ? json::parse(*b, nullptr, false) : json();
  try {
    std::map<std::string, json> theirs;
    for (const auto& e : jb) theirs[e.at(0).get<std::string>()] = e;
    for (const auto& e : ja) {
      const std::string name = e.at(0).get<std::string>();
      auto it = theirs.find(name);
      if (it == theirs.end()) return fmt::format("blob '{}' is replicated on rank {} but rank {} did not pass it", name, ref, r);
      if (it->second != e)
        return fmt::format("blob '{}' is {} on rank {} but {} on rank {}", name, describe_replicated(e), ref, describe_replicated(it->second), r);
      theirs.erase(it);
    }
    if (!theirs.empty()) return fmt::format("rank {} passed replicated blob '{}' that rank {} did not", r, theirs.begin()->first, ref);
  } catch (const json::exception&) {
  }
  return "the lists differ";
}

// The merger's check of part r against the first merged part, rank `ref`:
// every rank must have split the same replicated list, or some bytes were
// written twice and others never. Empty when it agrees.
std::string check_replicated(const json& part, int r, int ref, const std::string& tmp_dir, std::uint64_t step,
                             std::string& digest_ref) {
  const std::string digest = part.contains(kReplicatedKey) && part[kReplicatedKey].is_string() ? part[kReplicatedKey].get<std::string>() : "";
  if (r == ref) digest_ref = digest;
  if (digest.empty() || digest != digest_ref)
    return fmt::format("step {}: rank {} was given other replicated blobs than rank {} ({}); every rank must pass the same; nothing was committed",
                       step, r, ref, replicated_difference(tmp_dir, ref, r));
  return {};
}

// Fixed-size staging buffers, reused across saves so that steady-state saves
// copy into memory that is already faulted in (and pinned, with CUDA). Beyond
// the pool's budget, up to `overflow` bytes of ordinary buffers (never
// pinned) take what does not fit; the writer hands each back to the kernel
// lazily once it is written, and later saves reuse it.
class StagingPool {
 public:
  StagingPool(std::uint64_t budget, std::uint64_t overflow, std::uint64_t buffer_bytes, bool pin)
      : buffer_bytes_(buffer_bytes),
        max_buffers_(std::max<std::uint64_t>(1, budget / buffer_bytes)),
        max_overflow_(overflow / buffer_bytes),
        pin_(pin) {}
  ~StagingPool() {
    for (auto& b : all_)
      if (pinned_.count(b.data())) hw::unpin_host_memory(b.data());
  }
  // Blocks while every buffer is in use. `device` >= 0: the buffer will take
  // copies from that CUDA device (it is pinned from that device's context).
  unsigned char* acquire(int device = -1) { return get(device, true); }
  // nullptr instead of blocking.
  unsigned char* try_acquire(int device = -1) { return get(device, false); }
  void release(unsigned char* b) {
    HostBuffer* lazy = nullptr;  // an overflow buffer (they live as long as the pool)
    {
      std::lock_guard g(mu_);
      if (auto it = overflow_.find(b); it != overflow_.end()) lazy = it->second.get();
    }
    if (lazy) lazy->release_lazily();  // outside the lock: it walks the buffer's pages
    {
      std::lock_guard g(mu_);
      (lazy ? free_overflow_ : free_).push_back(b);
    }
    cv_.notify_one();
  }
  std::uint64_t buffer_bytes() const { return buffer_bytes_; }
  // Allocates, faults in and (for copies from `device` >= 0) page-locks the
  // pool's buffers ahead of the first save, which otherwise pays for all of
  // it (seconds for a GPU state of many GiB); stops early once `stop` is set.
  // Buffers go onto the free list one at a time, so a save that starts
  // meanwhile takes those already made and waits for (or makes) the rest.
  void reserve(int device, const std::atomic<bool>& stop) {
    while (!stop.load()) {
      unsigned char* b = nullptr;
      {
        std::lock_guard g(mu_);
        if (all_.size() >= max_buffers_) return;
        b = add_pool_buffer();
        if (!b) return;  // the first save meets the shortage and reports it
      }
      // Without a device nothing is pinned: registering from this thread
      // would create a CUDA context on device 0 for a rank that uses another.
      if (device < 0 || !pin(b, device)) (void)prefault_for_write(b, buffer_bytes_);
      {
        std::lock_guard g(mu_);
        free_.push_back(b);
      }
      cv_.notify_one();
    }
  }
  struct Allocated {
    std::uint64_t bytes = 0, pinned = 0, overflow = 0;
  };
  Allocated allocated() {
    std::lock_guard g(mu_);
    return {(all_.size() + overflow_.size()) * buffer_bytes_, pinned_.size() * buffer_bytes_, overflow_.size() * buffer_bytes_};
  }

 private:
  // With mu_ held: a new buffer of the pool, or nullptr when it cannot be mapped.
  unsigned char* add_pool_buffer() {
    HostBuffer buf(buffer_bytes_, /*huge=*/true);  // faulted once, reused by every save
    if (!buf) return nullptr;
    unsigned char* b = buf.data();
    all_.push_back(std::move(buf));
    return b;
  }
  // Without mu_: page-locks `b` for copies from `device`; whether it is.
  bool pin(unsigned char* b, int device) {
    if (!pin_ || !hw::pin_host_memory(b, buffer_bytes_, device)) return false;
    std::lock_guard g(mu_);
    pinned_.insert(b);
    return true;
  }
  unsigned char* get(int device, bool block) {
    std::unique_lock lock(mu_);
    auto ready = [&] {
      return !free_.empty() || all_.size() < max_buffers_ || !free_overflow_.empty() || overflow_.size() < max_overflow_;
    };
    if (!block && !ready()) return nullptr;
    cv_.wait(lock, ready);
    auto take = [](std::vector<unsigned char*>& from) {
      auto* b = from.back();
      from.pop_back();
      return b;
    };
    if (!free_.empty()) return take(free_);
    if (all_.size() < max_buffers_) {
      unsigned char* b = add_pool_buffer();
      if (!b) throw std::bad_alloc();
      lock.unlock();
      pin(b, device);
      return b;
    }
    if (!free_overflow_.empty()) return take(free_overflow_);
    auto buf = std::make_unique<HostBuffer>(buffer_bytes_);
    if (!*buf) throw std::bad_alloc();
    unsigned char* b = buf->data();
    overflow_.emplace(b, std::move(buf));
    return b;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<HostBuffer> all_;
  std::vector<unsigned char*> free_;
  std::set<unsigned char*> pinned_;
  std::map<unsigned char*, std::unique_ptr<HostBuffer>> overflow_;
  std::vector<unsigned char*> free_overflow_;
  std::uint64_t buffer_bytes_;
  std::uint64_t max_buffers_;
  std::uint64_t max_overflow_;
  bool pin_;
};

}  // namespace

// ---------------------------------------------------------------------------
// Save state shared by the caller's handle and the background threads.

struct SaveHandle::State {
  std::uint64_t step = 0;
  std::mutex mu;
  std::condition_variable cv;
  bool local_done = false;   // this rank's files are durable (or failed)
  bool committed = false;    // visible under its step name
  bool persistent = false;   // on the persistent tier too
  std::optional<Error> error;
  std::optional<Error> persist_error;
  Checkpointer::Impl* owner = nullptr;
  bool collective_pending = false;  // several ranks: commit happens in wait()
  // Several ranks with a fast tier: the persistent tier's temporary directory
  // every rank copies its part into (named at save time), and whether this
  // rank committed its node's fast-tier copy (and so trims that tier).
  std::string flush_dir;
  bool node_leader = false;
  std::string replicated_xxh3;  // several ranks: the digest of this rank's replicated list
  // Deferred device copies (SaveOptions::defer_device_copies): where they
  // end; set before the handle is returned and never changed after.
  std::shared_ptr<hw::CopyFence> copies;
};

namespace {

struct Piece {
  std::size_t blob = 0;        // index into the job's manifest blobs
  std::uint64_t chunk = 0;     // checksum chunk of that blob
  std::uint64_t buf_offset = 0;
  std::uint64_t len = 0;
  // A chunk that does not fit in what is left of a staging buffer continues
  // in the next one: this piece is bytes [in_chunk, in_chunk + len) of it, and
  // `last` says whether it ends the chunk. Whole chunks: in_chunk 0, last.
  std::uint64_t in_chunk = 0;
  bool last = true;
};

// A device-to-host copy of a save that failed (queued, fenced or waited for).
Error copy_error(std::uint64_t step, const Error& e) {
  return Error{e.kind, fmt::format("step {}: copying device blobs to the host: {}", step, e.message)};
}

struct Xxh3StateFree {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};

struct Job {
  std::shared_ptr<SaveHandle::State> state;
  std::string tier_root;
  std::string tmp_dir;
  std::string data_path;
  int fd = -1;
  bool direct = false;  // O_DIRECT: pieces are written padded to 4 KiB from the aligned staging buffers
  // The data file's laid-out size, reserved before the first write: a disk
  // too full for the step fails before any byte is written, and the blocks
  // are allocated at once rather than as each O_DIRECT write lands, while
  // other files (other ranks' parts) grow beside it.
  std::uint64_t file_bytes = 0;
  bool reserved = false;
  Manifest manifest;
  int rank = 0;
  bool failed = false;
  Error error;
  // Several ranks: what this rank was given as replicated, for the commit to
  // check that every rank split the same list (a digest, and the list itself
  // to name the first difference).
  std::string replicated_xxh3;
  std::string replicated_list;
  // The checksum of a chunk split across staging buffers, fed piece by piece
  // (the one writer thread takes the buffers in order).
  std::unique_ptr<XXH3_state_t, Xxh3StateFree> split_hash;
};

struct Task {
  enum class Kind { kChunk, kEnd } kind = Kind::kChunk;
  std::shared_ptr<Job> job;
  unsigned char* buf = nullptr;
  std::vector<Piece> pieces;
  std::optional<Error> abort;  // kEnd of a save that failed while staging
  // A buffer whose device copies may still be in flight: the writer waits
  // for the fence before it reads the bytes.
  std::shared_ptr<hw::CopyFence> fence;
};

}  // namespace

struct Checkpointer::Impl {
  Options opt;
  std::unique_ptr<comm::Communicator> own_comm;
  comm::Communicator* comm = nullptr;
  std::string host;
  int rank = 0;   // of comm, read once: background threads never touch comm
  int world = 1;
  std::unique_ptr<StagingPool> pool;

  std::mutex mu;
  std::condition_variable cv;
  std::deque<Task> tasks;
  std::deque<std::shared_ptr<SaveHandle::State>> flushes;
  std::vector<std::shared_ptr<SaveHandle::State>> outstanding;
  bool stopping = false;
  std::thread writer;
  std::thread flusher;
  std::shared_ptr<SaveHandle::State> pending_collective;
  std::unique_ptr<hw::DeviceToHost> d2h;  // created by the first save of a device blob
  std::thread reserver;                   // Checkpointer::reserve's, at most one
  std::atomic<bool> reserve_stop{false};
  Checkpointer::Stats counters;  // saves, bytes_staged, blocked_s (caller's thread only)

  std::string read_only;  // why save() is refused (the root is not writable); empty: it saves
  std::string first_tier() const { return opt.fast_tier ? *opt.fast_tier : opt.root; }

  void warn(const std::string& s) const {
    if (opt.warn) opt.warn(s);
    else std::fprintf(stderr, "pacer: warning: %s\n", s.c_str());
  }

  void push(Task t) {
    {
      std::lock_guard g(mu);
      tasks.push_back(std::move(t));
    }
    cv.notify_all();
  }

  void finish_local(const std::shared_ptr<SaveHandle::State>& s, std::optional<Error> err, bool committed) {
    {
      std::lock_guard g(s->mu);
      s->local_done = true;
      s->committed = committed;
      if (err) {
        s->error = err;
        s->persistent = true;  // nothing more will happen to it
      }
    }
    s->cv.notify_all();
  }

  // ---- the writer thread -------------------------------------------------
  void writer_loop() {
    for (;;) {
      Task t;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return stopping || !tasks.empty(); });
        if (tasks.empty()) return;
        t = std::move(tasks.front());
        tasks.pop_front();
      }
      if (t.kind == Task::Kind::kChunk) {
        if (t.fence && !t.job->failed) {
          if (Status st = t.fence->wait(); !st) {
            t.job->failed = true;
            t.job->error = copy_error(t.job->manifest.step, st.error());
          }
        }
        write_chunk(t);
        continue;
      }
      if (t.abort && !t.job->failed) {
        t.job->failed = true;
        t.job->error = *t.abort;
      }
      end_job(*t.job);
    }
  }

  void write_chunk(Task& t) {
    Job& j = *t.job;
    if (!j.reserved && !j.failed) {
      j.reserved = true;
      if (Status st = reserve_space(j.fd, 0, j.file_bytes, j.data_path); !st) {
        j.failed = true;
        j.error = st.error();
      }
    }
    for (const Piece& p : t.pieces) {
      if (j.failed) break;
      BlobInfo& b = j.manifest.blobs[p.blob];
      const unsigned char* data = t.buf + p.buf_offset;
      if (p.in_chunk == 0 && p.last) {
        b.chunk_hashes[p.chunk] = XXH3_64bits(data, p.len);
      } else {
        if (p.in_chunk == 0) {
          if (!j.split_hash) j.split_hash.reset(XXH3_createState());
          if (!j.split_hash) throw std::bad_alloc();
          XXH3_64bits_reset(j.split_hash.get());
        }
        XXH3_64bits_update(j.split_hash.get(), data, p.len);
        if (p.last) b.chunk_hashes[p.chunk] = XXH3_64bits_digest(j.split_hash.get());
      }
      // A piece that does not end its chunk ends at a 4 KiB boundary of it
      // (it filled its buffer, whose size is a multiple of 4 KiB).
      const std::uint64_t off = b.offset + p.chunk * j.manifest.chunk_bytes + p.in_chunk;
      std::uint64_t len = p.len;
      if (j.direct) {
        // The padding lands in the gap before the next blob's 4 KiB boundary.
        len = align_up(p.len, kAlign);
        std::memset(t.buf + p.buf_offset + p.len, 0, len - p.len);
      }
      Status st = pwrite_full(j.fd, data, len, off, j.data_path);
      if (!st && j.direct && st.error().message.find(std::strerror(EINVAL)) != std::string::npos) {
        // The filesystem took O_DIRECT at open but refuses it on write (some
        // network filesystems): carry on buffered.
        ::fcntl(j.fd, F_SETFL, ::fcntl(j.fd, F_GETFL) & ~O_DIRECT);
        j.direct = false;
        st = pwrite_full(j.fd, data, p.len, off, j.data_path);
      }
      if (!st) {
        j.failed = true;
        j.error = st.error();
        break;
      }
      // Buffered: start writeback now, so the disk works while the next chunk
      // is checksummed instead of all at once in the final fdatasync.
      if (!j.direct) ::sync_file_range(j.fd, static_cast<off_t>(off), static_cast<off_t>(p.len), SYNC_FILE_RANGE_WRITE);
    }
    pool->release(t.buf);
  }

  Status persist_local(Job& j) {
    if (j.failed) return j.error;
    if (::fdatasync(j.fd) != 0) return io_error("fdatasync failed", j.data_path, errno);
    std::error_code ec;
    const auto size = fs::file_size(j.data_path, ec);
    j.manifest.files = {{fs::path(j.data_path).filename().string(), size}};
    return {};
  }

  void end_job(Job& j) {
    Status st = persist_local(j);
    if (j.fd >= 0) ::close(j.fd);
    j.fd = -1;
    if (comm->size() > 1) {
      // Several ranks: write this rank's part; the commit is collective.
      if (st) st = write_small_file(replicated_list_path(j.tmp_dir, j.rank), j.replicated_list);
      if (st) {
        json part = manifest_body(j.manifest);
        part[kReplicatedKey] = j.replicated_xxh3;
        st = write_small_file(fmt::format("{}/rank-{:05d}.part.json", j.tmp_dir, j.rank), part.dump());
      }
      finish_local(j.state, st ? std::nullopt : std::optional<Error>(st.error()), false);
      return;
    }
    if (st) st = commit_dir(j.tmp_dir, j.tier_root, j.manifest);
    if (!st) {
      std::error_code ec;
      fs::remove_all(j.tmp_dir, ec);
      finish_local(j.state, st.error(), false);
      return;
    }
    // Retention first, so that when wait() returns the tier is already trimmed.
    apply_retention(j.tier_root);
    finish_local(j.state, std::nullopt, true);
    if (opt.fast_tier) {
      {
        std::lock_guard g(mu);
        flushes.push_back(j.state);
      }
      cv.notify_all();
    } else {
      std::lock_guard g(j.state->mu);
      j.state->persistent = true;
    }
    j.state->cv.notify_all();
  }

  // Manifest last, then the rename that makes the step exist.
  Status commit_dir(const std::string& tmp_dir, const std::string& tier_root, Manifest& m) {
    m.created_at = utc_iso_now();
    const std::string text = to_json(m).dump(1);
    if (Status st = write_small_file(tmp_dir + "/" + kManifestName, text); !st) return st;
    (void)fsync_dir(tmp_dir);
    const std::string final_dir = (fs::path(tier_root) / step_dir_name(m.step)).string();
    if (Status st = rename_no_replace(tmp_dir, final_dir); !st) return st;
    (void)fsync_dir(tier_root);
    note_committed(tier_root, final_dir, m);
    return {};
  }

  // ---- retention ----------------------------------------------------------
  // The writer and the flusher both trim the fast tier, and a collective
  // commit trims the root from the caller's thread: one at a time.
  std::mutex retention_mu;
  std::map<std::string, std::uint64_t> last_committed;  // tier -> the step this process committed last
  std::set<std::string> warned_damaged;                 // damaged directories already warned about

  // The step just committed (or copied) is valid: no need to read it back, and
  // retention must not take it, whatever higher steps the tier holds.
  void note_committed(const std::string& tier_root, const std::string& step_dir, const Manifest& m) {
    note_verified(step_dir, m);
    std::lock_guard g(retention_mu);
    last_committed[tier_root] = m.step;
  }

  // Leftovers of savers that are gone (docs/checkpoint.md, "Leftovers"): this
  // host's whose pid is gone, and other hosts' that a newer commit has
  // passed and nothing has touched for a long while. Longer than the wait for
  // the other ranks' copies, during which a live directory may sit unchanged.
  void remove_stale_partials(const std::string& tier_root) const {
    const double window = std::max(kStalePartialS, 2 * opt.flush_timeout_s);
    for (const auto& p : stale_partials(tier_root, host, window)) {
      auto gone = remove_checkpoint_dir(p.path);
      std::error_code ec;
      if (!gone && fs::exists(p.path, ec)) warn(gone.error().message);  // (gone meanwhile: another rank removed it)
      else if (gone && *gone && !p.saver_gone_here)
        warn(fmt::format("removed {}, a save that never committed: {}", p.path, p.why));
    }
  }

  void apply_retention(const std::string& tier_root) {
    trim_steps(tier_root);
    // After the steps: the scan of leftovers (a walk of each partial
    // directory's files) must not widen the window between a commit and the
    // pruning it calls for, in which a killed writer leaves one step too many.
    remove_stale_partials(tier_root);
  }

  void trim_steps(const std::string& tier_root) {
    if (opt.keep_last <= 0) return;
    std::lock_guard g(retention_mu);
    const bool fast = opt.fast_tier && tier_root == *opt.fast_tier;
    // Node-local space is small: the fast tier keeps the newest keep_last only;
    // the every-Mth history lives on the persistent tier.
    RetentionPlan plan = plan_retention(tier_root, opt.keep_last, fast ? 0 : opt.keep_every);
    const auto just = last_committed.find(tier_root);
    for (auto s : plan.victims) {
      if (just != last_committed.end() && just->second == s) continue;
      // The fast tier keeps a step until the persistent tier has it.
      if (fast && !fs::exists(fs::path(opt.root) / step_dir_name(s) / kManifestName)) continue;
      // A step a Reader holds (false) stays until a later retention.
      if (auto gone = remove_checkpoint_dir(plan.paths[s]); !gone) warn(gone.error().message);
    }
    for (const auto& d : plan.damaged) {
      if (d.damaged || !warned_damaged.insert(d.path).second) continue;
      warn(fmt::format("step {} in {} is damaged and retention leaves it (pacer ckpt prune --remove-damaged removes it): {}",
                       d.step, tier_root, d.problem));
    }
  }

  // Before a save of `step`: a damaged directory of that step (a load fell
  // back past it, and training has come back to it) is moved aside, so the
  // step can be saved again; a valid one stays and save() refuses the step.
  // Higher committed steps are warned about once: latest() and a resume go by
  // step number and would pick those.
  //
  // Several ranks: the persistent tier's copy is checked by every rank, each
  // reading its share of the blobs, so that the others wait for a share and
  // not for one rank reading the whole step (a communicator with a timeout
  // would give up on them); rank 0 moves it aside. Each node's fast tier is
  // checked by its own ranks: a damaged copy there, which rank 0 cannot see,
  // would otherwise make those ranks refuse the step at every restart. No
  // exception leaves a rank's own part of this, so every rank reaches the
  // collectives.
  void prepare_step(std::uint64_t step, const std::vector<std::string>& tiers) {
    const bool several = comm->size() > 1;
    auto guarded = [&](const char* what, const std::function<void()>& f) {
      try {
        f();
      } catch (const std::exception& e) {
        warn(fmt::format("step {}: {}: {}", step, what, e.what()));
      }
    };
    auto move_aside = [&](const std::string& tier, const std::string& dir, const std::string& why) {
      std::error_code ec;
      auto moved = move_aside_damaged(dir, step);
      if (moved)
        warn(fmt::format("step {} in {} is damaged ({}); moved it aside to {} and saving it anew", step, tier, why, *moved));
      else if (fs::exists(dir, ec))
        warn(fmt::format("step {} in {} is damaged ({}) and cannot be moved aside: {}", step, tier, why, moved.error().message));
    };
    const std::string root_dir = (fs::path(opt.root) / step_dir_name(step)).string();
    std::string root_problem;
    guarded("checking the persistent tier's copy", [&] {
      std::error_code ec;
      if (!fs::exists(root_dir, ec)) return;
      if (!several) {
        if (Status st = verify_step(root_dir); !st) root_problem = st.error().message;
        return;
      }
      auto r = Reader::open(root_dir);
      if (!r) root_problem = r.error().message;
      else if (Status st = r->verify_share(comm->rank(), comm->size()); !st) root_problem = st.error().message;
    });
    const bool root_valid = several ? comm->all_ok(root_problem.empty()) : root_problem.empty();
    if (!several || comm->rank() == 0) {
      guarded("moving the persistent tier's damaged copy aside", [&] {
        std::error_code ec;
        if (!root_valid && fs::exists(root_dir, ec))
          move_aside(opt.root, root_dir, root_problem.empty() ? "a checksum fails in another rank's share" : root_problem);
      });
    }
    for (const auto& tier : tiers) {
      if (tier == opt.root) continue;
      guarded("checking the fast tier's copy", [&] {
        const std::string dir = (fs::path(tier) / step_dir_name(step)).string();
        std::error_code ec;
        if (!fs::exists(dir, ec)) return;
        // The ranks of one node take turns (a lock on the node's tier): two
        // checking at once would each hold the step's shared lock and keep
        // the other from moving it aside.
        struct Turn {
          int fd;
          ~Turn() {
            if (fd >= 0) ::close(fd);
          }
        } turn{::open(tier.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
        if (turn.fd >= 0) (void)retry_eintr([&] { return ::flock(turn.fd, LOCK_EX); });
        if (fs::exists(dir, ec))
          if (Status valid = verify_step(dir); !valid) move_aside(tier, dir, valid.error().message);
      });
    }
    if (!several || comm->rank() == 0) {
      guarded("listing higher steps", [&] {
        std::uint64_t higher = 0;
        for (const auto& tier : tiers) {
          std::error_code ec;
          for (auto it = fs::directory_iterator(tier, ec); !ec && it != fs::directory_iterator(); it.increment(ec))
            if (auto s = parse_step_dir_name(it->path().filename().string()); s && *s > step) higher = std::max(higher, *s);
        }
        if (higher > warned_higher) {
          warned_higher = higher;
          warn(fmt::format("saving step {}, but {} holds step {}: latest() and a resume pick the highest valid step, and "
                           "retention counts the higher steps first (use a new root for a new step count)",
                           step, opt.root, higher));
        }
      });
    }
    if (several) comm->barrier();  // rank 0 has moved a damaged persistent copy aside
  }
  std::uint64_t warned_higher = 0;

  // ---- the fast -> persistent flusher ------------------------------------
  void flusher_loop() {
    for (;;) {
      std::shared_ptr<SaveHandle::State> s;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return stopping || !flushes.empty(); });
        if (flushes.empty()) return;
        s = flushes.front();
        flushes.pop_front();
      }
      Status st = world > 1 ? flush_part(*s) : copy_to_root(s->step);
      if (!st) warn(fmt::format("step {} stays on the fast tier only: {}", s->step, st.error().message));
      // Retention before waking waiters, so wait_persistent() sees trimmed
      // tiers. Several ranks: rank 0 trims the persistent tier, each node's
      // leader its fast tier.
      if (world == 1 || rank == 0) apply_retention(opt.root);
      if (world == 1 || s->node_leader) apply_retention(*opt.fast_tier);
      {
        std::lock_guard g(s->mu);
        s->persistent = true;
        if (!st) s->persist_error = Error{st.error().kind, "copy to the persistent tier failed: " + st.error().message};
      }
      s->cv.notify_all();
    }
  }

  // copy_file_range where the kernel can (same filesystem: no user-space
  // copy), read and write otherwise (tmpfs to a disk: EXDEV).
  static Status copy_file(int in, int out, std::uint64_t size, const std::string& to) {
    std::uint64_t done = 0;
    bool plain = false;
    std::vector<unsigned char> buf;
    while (done < size) {
      if (!plain) {
        loff_t a = static_cast<loff_t>(done), b = static_cast<loff_t>(done);
        const ssize_t n = retry_eintr([&] { return ::copy_file_range(in, &a, out, &b, size - done, 0); });
        if (n > 0) {
          done += static_cast<std::uint64_t>(n);
          continue;
        }
        if (n < 0 && (errno == EXDEV || errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP)) {
          plain = true;
          buf.resize(8u << 20);
          continue;
        }
        return io_error("copy failed", to, n < 0 ? errno : EIO);
      }
      const std::size_t want = std::min<std::uint64_t>(buf.size(), size - done);
      if (Status r = pread_exact(in, buf.data(), want, done, to + " (copy source)"); !r) return r;
      if (Status w = pwrite_full(out, buf.data(), want, done, to); !w) return w;
      done += want;
    }
    return {};
  }

  // Copies the files of manifest `m` from src to dst (a temporary directory),
  // each fdatasynced, then checks the copies against the checksums: a bad
  // fast disk must not poison the good copy.
  static Status copy_checked(const std::string& src, const std::string& dst, const Manifest& m) {
    for (const auto& [name, size] : m.files) {
      const std::string from = src + "/" + name;
      const std::string to = dst + "/" + name;
      const int in = ::open(from.c_str(), O_RDONLY | O_CLOEXEC);
      if (in < 0) return io_error("cannot open", from, errno);
      const int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (out < 0) {
        const int err = errno;
        ::close(in);
        return io_error("cannot create", to, err);
      }
      Status st = copy_file(in, out, size, to);
      if (st && ::fdatasync(out) != 0) st = io_error("fdatasync failed", to, errno);
      ::close(in);
      ::close(out);
      if (!st) return st;
    }
    auto copy = Reader::open(dst, m);
    if (!copy) return copy.error();
    return copy->verify_all();
  }

  Status copy_to_root(std::uint64_t step) {
    const std::string src = (fs::path(*opt.fast_tier) / step_dir_name(step)).string();
    const std::string tmp = (fs::path(opt.root) / temp_dir_name(step, host, ::getpid())).string();
    std::error_code ec;
    if (!fs::create_directory(tmp, ec)) return Error{ErrorKind::kIo, fmt::format("{}: cannot create: {}", tmp, ec.message())};
    auto fail = [&](Error e) {
      fs::remove_all(tmp, ec);
      return e;
    };
    auto reader = Reader::open(src);
    if (!reader) return fail(reader.error());
    Manifest m = reader->manifest();
    if (Status st = copy_checked(src, tmp, m); !st) return fail(st.error());
    if (Status st = write_small_file(tmp + "/" + kManifestName, to_json(m).dump(1)); !st) return fail(st.error());
    (void)fsync_dir(tmp);
    const std::string final_dir = (fs::path(opt.root) / step_dir_name(step)).string();
    if (Status st = rename_no_replace(tmp, final_dir); !st) return fail(st.error());
    (void)fsync_dir(opt.root);
    note_committed(opt.root, final_dir, m);
    return {};
  }

  // ---- several ranks with a fast tier: the persistent commit ---------------
  // Coordinated through the persistent tier, never the communicator (the
  // training thread owns it): each rank copies its own part into the
  // temporary directory named at save time and then writes
  // rank-R.part.json (or rank-R.failed); rank 0 merges once all world_size
  // parts are there and renames the directory to its step name, or writes
  // ABORTED; the other ranks learn the outcome from which of the two appears.
  static std::string part_file(int r) { return fmt::format("rank-{:05d}.part.json", r); }
  static std::string failed_file(int r) { return fmt::format("rank-{:05d}.failed", r); }
  static constexpr const char* kAborted = "ABORTED";
  // Polls of the shared file system: quick at first (a small step commits in
  // milliseconds), then at most once a second per rank.
  struct Backoff {
    std::chrono::milliseconds delay{10};
    void sleep() {
      std::this_thread::sleep_for(delay);
      delay = std::min(delay * 2, std::chrono::milliseconds(1000));
    }
  };

  Status flush_part(const SaveHandle::State& s) {
    const std::string tmp = s.flush_dir;
    // Rank 0 made it before the fast-tier commit ended (collective_commit).
    // Gone: rank 0 has given the step up; a late rank must not make it again
    // and leave its part in it for good.
    if (rank != 0 && !fs::is_directory(tmp))
      return Error{ErrorKind::kIo, fmt::format("step {} was not committed on the persistent tier (rank 0 gave it up before rank {}'s copy began)",
                                               s.step, rank)};
    std::error_code ec;
    if (rank == 0) fs::create_directories(tmp, ec);
    Status mine = copy_my_part(s.step, tmp);
    if (!mine) {
      mine = Error{mine.error().kind, fmt::format("rank {}: {}", rank, mine.error().message)};
      (void)write_file_atomic(tmp + "/" + failed_file(rank), mine.error().message);
    }
    const auto timeout = std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(std::min(opt.flush_timeout_s, 1e8)));
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    if (rank == 0) return commit_parts(s.step, tmp, mine, deadline);
    if (!mine) return mine;
    // Rank 0 decides within flush_timeout_s of its own copy; allow for its
    // copy taking as long as ours.
    return await_commit(s.step, tmp, deadline + timeout);
  }

  Status copy_my_part(std::uint64_t step, const std::string& tmp) {
    if (!fs::is_directory(tmp)) return Error{ErrorKind::kIo, fmt::format("{}: cannot create", tmp)};
    const std::string src = (fs::path(*opt.fast_tier) / step_dir_name(step)).string();
    auto node = Reader::open(src);
    if (!node) return node.error();
    Manifest part = node->manifest();
    part.ranks = {rank};  // one rank's share: its shards need not cover their blobs
    std::erase_if(part.blobs, [&](const BlobInfo& b) { return b.rank != rank; });
    const std::string my_file = fmt::format("rank-{:05d}.bin", rank);
    std::erase_if(part.files, [&](const auto& f) { return f.first != my_file; });
    if (part.files.empty()) return Error{ErrorKind::kConfig, fmt::format("{}: holds no part of rank {}", src, rank)};
    if (Status st = copy_checked(src, tmp, part); !st) return st;
    return write_file_atomic(tmp + "/" + part_file(rank), manifest_body(part).dump());
  }

  Status commit_parts(std::uint64_t step, const std::string& tmp, Status mine,
                      std::chrono::steady_clock::time_point deadline) {
    std::string why = mine ? "" : mine.error().message;
    std::vector<int> ranks(static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) ranks[static_cast<std::size_t>(r)] = r;
    // One listing per poll, not a stat per rank: with thousands of ranks
    // the shared file system's metadata server would feel it.
    std::set<std::string> names;
    auto look = [&] {
      names.clear();
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(tmp, ec)) names.insert(e.path().filename().string());
    };
    auto reported = [&](int r) { return names.count(part_file(r)) || names.count(failed_file(r)); };
    Backoff backoff;
    while (why.empty()) {
      look();
      int parts = 0;
      for (int r = 0; r < world && why.empty(); ++r) {
        if (names.count(part_file(r))) ++parts;
        else if (names.count(failed_file(r))) {
          auto text = read_file(tmp + "/" + failed_file(r));
          why = text ? *text : fmt::format("rank {}: its copy failed", r);
        }
      }
      if (!why.empty() || parts == world) break;
      if (std::chrono::steady_clock::now() > deadline) {
        why = fmt::format("only {} of {} ranks copied their part within {} s", parts, world, opt.flush_timeout_s);
        break;
      }
      backoff.sleep();
    }
    if (why.empty()) {
      auto m = merge_parts(tmp, step, ranks);
      Status st = m ? commit_dir(tmp, opt.root, *m) : Status(m.error());
      if (st) return {};
      why = st.error().message;
    }
    // Give the step up on the persistent tier (it stays on the fast tiers).
    // The others learn why from ABORTED; it is removed once every rank has
    // reported, or at the deadline.
    (void)write_file_atomic(tmp + "/" + kAborted, why);
    for (Backoff wait;;) {
      look();
      bool all = true;
      for (int r = 0; r < world && all; ++r) all = reported(r);
      if (all || std::chrono::steady_clock::now() > deadline) break;
      wait.sleep();
    }
    // Longer than the others' longest poll interval, so each reads ABORTED.
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    // Renamed away before it is emptied (remove_checkpoint_dir): a late
    // rank creating its files by name then finds nothing there, rather than
    // a directory that comes back with its part in it.
    (void)remove_checkpoint_dir(tmp);
    return Error{ErrorKind::kIo, fmt::format("step {} was not committed on the persistent tier: {}", step, why)};
  }

  Status await_commit(std::uint64_t step, const std::string& tmp, std::chrono::steady_clock::time_point deadline) {
    const std::string final_dir = (fs::path(opt.root) / step_dir_name(step)).string();
    for (Backoff backoff;; backoff.sleep()) {
      // Looked at in this order: rank 0's rename makes tmp vanish and the
      // step appear at once.
      const bool tmp_there = fs::exists(tmp);
      if (auto why = read_file(tmp + "/" + kAborted))
        return Error{ErrorKind::kIo, fmt::format("step {} was not committed on the persistent tier: {}", step, *why)};
      if (Reader::open(final_dir)) return {};
      if (!tmp_there)
        return Error{ErrorKind::kIo, fmt::format("step {} was not committed on the persistent tier (rank 0 gave it up)", step)};
      if (std::chrono::steady_clock::now() > deadline)
        return Error{ErrorKind::kIo, fmt::format("step {}: no commit on the persistent tier within the timeout", step)};
    }
  }

  // The part manifests rank-R.part.json of `ranks` in dir, merged into one
  // manifest (meta from the first); the parts are removed once merged.
  Expected<Manifest> merge_parts(const std::string& dir, std::uint64_t step, const std::vector<int>& ranks) {
    Manifest m;
    m.step = step;
    m.world_size = world;
    m.chunk_bytes = opt.chunk_bytes;
    std::vector<std::string> merged;
    // Parts written at save time carry the digest of their rank's replicated
    // list; parts copied to the persistent tier do not (checked at save time).
    bool check = false;
    std::string digest_ref;
    for (int r : ranks) {
      const std::string part = dir + "/" + part_file(r);
      auto text = read_file(part);
      json j = text ? json::parse(*text, nullptr, false) : json();
      if (!text || j.is_discarded() || !j.is_object()) return Error{ErrorKind::kIo, fmt::format("{}: unreadable part manifest", part)};
      if (merged.empty()) check = j.contains(kReplicatedKey);
      if (check)
        if (auto why = check_replicated(j, r, ranks.front(), dir, step, digest_ref); !why.empty()) return Error{ErrorKind::kUsage, why};
      j.erase("manifest_xxh3");
      // Reuse the full parser by giving the part its own checksum.
      const std::string body = j.dump();
      j["manifest_xxh3"] = fmt::format("{:016x}", XXH3_64bits(body.data(), body.size()));
      auto pm = manifest_from_json(j.dump(), part);
      if (!pm) return pm.error();
      if (merged.empty()) m.meta = pm->meta;
      for (auto& b : pm->blobs) m.blobs.push_back(std::move(b));
      for (auto& f : pm->files) m.files.push_back(std::move(f));
      merged.push_back(part);
    }
    if (Status st = check_layout(m, static_cast<int>(ranks.size()) == world, dir); !st) return st.error();
    for (const auto& p : merged) ::unlink(p.c_str());
    for (int r : ranks) ::unlink(replicated_list_path(dir, r).c_str());
    return m;
  }

  // ---- several ranks: the collective commit --------------------------------
  // Every rank calls this in the same order (from SaveHandle::wait or the next
  // save). The step is published only when every rank's part is durable: on
  // the persistent tier by rank 0, or, with a fast tier, on each node's fast
  // tier by the lowest rank whose part lies there (the node's leader); that
  // copy holds only the node's ranks' parts and says so (Manifest::ranks).
  Status collective_commit(const std::shared_ptr<SaveHandle::State>& s, const std::string& tmp_dir) {
    {
      std::unique_lock lock(s->mu);
      s->cv.wait(lock, [&] { return s->local_done; });
    }
    bool mine_ok = !s->error.has_value();
    const bool fast = opt.fast_tier.has_value();
    if (fast) {
      // Each node's leader merges only its node's parts, and the persistent
      // merge only copies: compare every rank's replicated list with rank 0's
      // here, where all ranks meet, or ranks on other nodes that split other
      // lists would leave gaps and overlaps behind valid checksums.
      const std::string digest0 = comm->broadcast(s->replicated_xxh3, 0);
      if (mine_ok && s->replicated_xxh3 != digest0) {
        std::lock_guard g(s->mu);
        s->error = Error{ErrorKind::kUsage,
                         fmt::format("step {}: rank {} was given other replicated blobs than rank 0; every rank must pass the same; "
                                     "nothing was committed", s->step, comm->rank())};
        mine_ok = false;
      }
    }
    const bool all_ok = comm->all_ok(mine_ok);
    std::string result;
    bool leader = false;
    if (!all_ok) result = fmt::format("step {}: a rank failed to write its part; nothing was committed", s->step);
    if (fast) {
      std::vector<int> here;
      if (all_ok)
        for (int r = 0; r < world; ++r)
          if (fs::exists(tmp_dir + "/" + part_file(r))) here.push_back(r);
      leader = all_ok && !here.empty() && here.front() == rank;
      comm->barrier();  // every rank has looked before a leader renames the directory
      std::string mine;
      if (leader) {
        auto m = merge_parts(tmp_dir, s->step, here);
        if (m && static_cast<int>(here.size()) < world) m->ranks = here;
        Status st = m ? commit_dir(tmp_dir, *opt.fast_tier, *m) : Status(m.error());
        if (!st) mine = st.error().message;
      }
      // The persistent tier's directory for the copies, made before any
      // rank's flush can begin (see flush_part).
      const std::string flush_dir = (fs::path(opt.root) / fs::path(tmp_dir).filename()).string();
      if (all_ok && rank == 0 && mine.empty()) {
        std::error_code ec;
        if (!fs::create_directories(flush_dir, ec) && !fs::is_directory(flush_dir))
          mine = fmt::format("{}: cannot create: {}", flush_dir, ec.message());
      }
      const bool nodes_ok = comm->all_ok(mine.empty());
      if (!nodes_ok && rank == 0) (void)remove_checkpoint_dir(flush_dir);
      if (all_ok && !nodes_ok) {
        result = mine.empty() ? fmt::format("step {}: the commit on another node's fast tier failed; nothing was committed", s->step) : mine;
        // No node may keep a step that another could not commit.
        if (leader && mine.empty()) {
          const std::string dir = (fs::path(*opt.fast_tier) / step_dir_name(s->step)).string();
          auto gone = remove_checkpoint_dir(dir);
          // Kept, it would stay for good: retention keeps a fast-tier step
          // until the persistent tier has it, which this one never will.
          if (!gone || !*gone)
            warn(fmt::format("step {}: {} is a copy that the other nodes could not commit, and it cannot be removed now ({}): "
                             "remove it by hand", s->step, dir, gone ? "a reader holds it" : gone.error().message));
        }
      }
      if (!result.empty()) {
        std::error_code ec;
        fs::remove_all(tmp_dir, ec);  // each node's own; every rank is done writing
      }
      if (result.empty() && leader) apply_retention(*opt.fast_tier);
    } else if (rank == 0) {
      if (all_ok) {
        std::vector<int> ranks(static_cast<std::size_t>(world));
        for (int r = 0; r < world; ++r) ranks[static_cast<std::size_t>(r)] = r;
        auto m = merge_parts(tmp_dir, s->step, ranks);
        Status st = m ? commit_dir(tmp_dir, opt.root, *m) : Status(m.error());
        if (!st) result = st.error().message;
      }
      if (!result.empty()) {
        std::error_code ec;
        fs::remove_all(tmp_dir, ec);
      }
    }
    if (!fast) result = comm->broadcast(result, 0);
    {
      std::lock_guard g(s->mu);
      s->collective_pending = false;
      s->node_leader = leader;
      s->flush_dir = (fs::path(opt.root) / fs::path(tmp_dir).filename()).string();
      if (!fast || !result.empty()) s->persistent = true;
      if (result.empty()) s->committed = true;
      else if (!s->error) s->error = Error{ErrorKind::kIo, result};
    }
    if (fast && result.empty()) {
      {
        std::lock_guard g(mu);
        flushes.push_back(s);
      }
      cv.notify_all();
    }
    s->cv.notify_all();
    if (result.empty() && !fast && rank == 0) apply_retention(opt.root);
    if (!result.empty()) return Error{ErrorKind::kIo, result};
    return {};
  }
  std::map<std::uint64_t, std::string> collective_dirs;  // step -> tmp dir
};

// ---------------------------------------------------------------------------

std::uint64_t SaveHandle::step() const { return state_ ? state_->step : 0; }

bool SaveHandle::done() const {
  if (!state_) return true;
  std::lock_guard g(state_->mu);
  return state_->committed || state_->error.has_value();
}

Status SaveHandle::wait() {
  if (!state_) return Error{ErrorKind::kUsage, "wait() on an empty save handle"};
  bool collective = false;
  {
    std::lock_guard g(state_->mu);
    collective = state_->collective_pending;
  }
  if (collective) {
    Checkpointer::Impl* impl = state_->owner;
    const std::string dir = impl->collective_dirs[state_->step];
    impl->collective_dirs.erase(state_->step);
    if (impl->pending_collective == state_) impl->pending_collective.reset();
    (void)impl->collective_commit(state_, dir);
  }
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->committed || state_->error.has_value(); });
  if (state_->error) return *state_->error;
  return {};
}

Status SaveHandle::wait_copied() const {
  if (!state_ || !state_->copies) return {};
  return state_->copies->wait();
}

Status SaveHandle::order_before(std::uintptr_t cuda_stream) const {
  if (!state_ || !state_->copies) return {};
  return state_->copies->order_before(cuda_stream);
}

bool SaveHandle::copied() const { return !state_ || !state_->copies || state_->copies->done(); }

Status SaveHandle::wait_persistent() {
  if (Status st = wait(); !st) return st;
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->persistent; });
  if (state_->persist_error) return *state_->persist_error;
  return {};
}

Checkpointer::Checkpointer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Checkpointer::~Checkpointer() {
  (void)flush();
  impl_->reserve_stop = true;
  if (impl_->reserver.joinable()) impl_->reserver.join();
  {
    std::lock_guard g(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  if (impl_->writer.joinable()) impl_->writer.join();
  if (impl_->flusher.joinable()) impl_->flusher.join();
}

const Options& Checkpointer::options() const { return impl_->opt; }

Expected<std::unique_ptr<Checkpointer>> Checkpointer::open(Options o) {
  if (o.root.empty()) return Error{ErrorKind::kUsage, "checkpoint root is empty"};
  if (o.chunk_bytes < 4096 || o.chunk_bytes % 4096 != 0) return Error{ErrorKind::kUsage, "chunk_bytes must be a positive multiple of 4096"};
  if (o.staging_bytes < o.chunk_bytes) o.staging_bytes = o.chunk_bytes;
  if (o.keep_last < 0 || o.keep_every < 0) return Error{ErrorKind::kUsage, "keep_last and keep_every must not be negative"};
  auto impl = std::make_unique<Impl>();
  impl->comm = o.comm;
  if (!impl->comm) {
    impl->own_comm = comm::single_rank();
    impl->comm = impl->own_comm.get();
  }
  impl->rank = impl->comm->rank();
  impl->world = impl->comm->size();
  if (!(o.flush_timeout_s > 0)) return Error{ErrorKind::kUsage, "flush_timeout_s must be positive"};
  std::vector<std::string> tiers = {o.root};
  if (o.fast_tier) tiers.push_back(*o.fast_tier);
  for (const auto& t : tiers) {
    std::error_code ec;
    fs::create_directories(t, ec);
    if (!fs::is_directory(t)) return Error{ErrorKind::kIo, fmt::format("{}: cannot create checkpoint directory: {}", t, ec ? ec.message() : "not a directory")};
  }
  // The same directory under two names (a symlink, a bind mount) would have
  // every flush copy a step onto itself. One inside the other is fine: each
  // tier lists only its own step-* entries.
  if (std::error_code ec; o.fast_tier && fs::equivalent(o.root, *o.fast_tier, ec))
    return Error{ErrorKind::kUsage, fmt::format("fast tier {} is the checkpoint root {} (the same directory): give a node-local "
                                                "directory as the fast tier, or none", *o.fast_tier, o.root)};
  // A root that exists but cannot be written (a read-only mount of finished
  // checkpoints) still loads; save() says why it cannot save.
  std::string read_only;
  if (::access(o.root.c_str(), W_OK) != 0) {
    if (errno != EROFS && errno != EACCES) return io_error("not writable", o.root, errno);
    read_only = fmt::format("{}: not writable ({}): this checkpointer can load but not save", o.root, std::strerror(errno));
  }
  if (o.fast_tier && ::access(o.fast_tier->c_str(), W_OK) != 0) return io_error("not writable", *o.fast_tier, errno);
  impl->host = hw::hostname();
  impl->read_only = std::move(read_only);
  for (const auto& t : tiers) {
    std::error_code ec;
    // A prune that was killed between its rename and its delete.
    for (const auto& e : fs::directory_iterator(t, ec))
      if (e.path().filename().string().rfind(".deleting-", 0) == 0) fs::remove_all(e.path(), ec);
  }
  impl->pool = std::make_unique<StagingPool>(o.staging_bytes, o.overflow_bytes, o.chunk_bytes, o.pin_staging);
  impl->opt = std::move(o);
  for (const auto& t : tiers)
    if (t != impl->opt.root || impl->read_only.empty()) impl->remove_stale_partials(t);
  Impl* raw = impl.get();
  impl->writer = std::thread([raw] { raw->writer_loop(); });
  if (impl->opt.fast_tier) {
    // Steps a killed job committed on the fast tier but never copied: copy
    // them now, oldest first, so they do not live on one node only.
    std::set<std::uint64_t> on_root;
    for (const auto& e : list(impl->opt.root, false))
      if (e.committed) on_root.insert(e.step);
    auto fast = list(*impl->opt.fast_tier, false);
    if (!impl->read_only.empty()) fast.clear();  // a read-only root takes no copies
    for (auto it = fast.rbegin(); it != fast.rend(); ++it) {
      if (!it->committed || on_root.count(it->step)) continue;
      if (impl->world > 1) {
        // Its parts lie on several nodes, and the job that could have copied
        // them (into the directory its ranks agreed on) is gone. Kept, it
        // would be read on this node while the other nodes (or new ones) read
        // an older step, block a new save of the step ("already committed"),
        // and stay for good (the fast tier keeps what the persistent tier
        // lacks). Several ranks of the node may race here: one removes it.
        auto gone = remove_checkpoint_dir(it->path);
        if (gone && *gone)
          impl->warn(fmt::format("step {} in {} never reached the persistent tier before the job that saved it ended; removed it "
                                 "(a restart with several ranks reads only what the persistent tier holds)", it->step, *impl->opt.fast_tier));
        else if (std::error_code ec; fs::exists(it->path, ec))
          impl->warn(fmt::format("step {} in {} never reached the persistent tier and cannot be removed now ({}): remove it by hand",
                                 it->step, *impl->opt.fast_tier, gone ? "a reader holds it" : gone.error().message));
        continue;
      }
      auto st = std::make_shared<SaveHandle::State>();
      st->step = it->step;
      st->local_done = st->committed = true;
      impl->flushes.push_back(st);
      impl->outstanding.push_back(st);
    }
    impl->flusher = std::thread([raw] { raw->flusher_loop(); });
  }
  return std::unique_ptr<Checkpointer>(new Checkpointer(std::move(impl)));
}

namespace {

Status validate_save(std::uint64_t step, const std::vector<BlobView>& blobs, const json& meta, const std::vector<std::string>& tiers) {
  std::set<std::string> names;
  for (const auto& b : blobs) {
    if (b.name.empty()) return Error{ErrorKind::kUsage, "a blob has an empty name"};
    if (!names.insert(b.name).second) return Error{ErrorKind::kUsage, fmt::format("blob '{}' given twice", b.name)};
    if (!valid_dtype(b.dtype)) return Error{ErrorKind::kUsage, fmt::format("blob '{}': unknown dtype '{}'", b.name, b.dtype)};
    if (b.size > 0 && !b.data) return Error{ErrorKind::kUsage, fmt::format("blob '{}': no data", b.name)};
    if (b.device >= 0)
      if (Status st = hw::cuda_device_usable(b.device); !st)
        return Error{st.error().kind, fmt::format("blob '{}' is CUDA memory of device {}, but {}", b.name, b.device, st.error().message)};
    std::uint64_t elems = 1;
    for (auto d : b.shape) elems *= static_cast<std::uint64_t>(std::max<std::int64_t>(d, 0));
    if (!b.shape.empty() && b.dtype != "bytes" && elems * dtype_size(b.dtype) != b.size)
      return Error{ErrorKind::kUsage, fmt::format("blob '{}': shape and dtype make {} bytes, data has {}", b.name, elems * dtype_size(b.dtype), b.size)};
    if (b.layout == Layout::kShard && b.shard_offset + b.size > b.global_size)
      return Error{ErrorKind::kUsage, fmt::format("blob '{}': shard [{}, {}) lies outside {} bytes", b.name, b.shard_offset, b.shard_offset + b.size, b.global_size)};
  }
  if (!meta.is_object()) return Error{ErrorKind::kUsage, "checkpoint meta must be a JSON object"};
  // The manifest is JSON: text that cannot be serialised must fail here, not
  // on the writer thread.
  try {
    (void)meta.dump();
    for (const auto& b : blobs) (void)json(b.name).dump();
  } catch (const json::exception& e) {
    return Error{ErrorKind::kUsage, fmt::format("blob names and meta must be valid UTF-8: {}", e.what())};
  }
  // Either tier: a step that survives only on the persistent tier (the node
  // lost its fast tier) must not get a second, different copy.
  for (const auto& tier : tiers)
    if (fs::exists(fs::path(tier) / step_dir_name(step)))
      return Error{ErrorKind::kUsage, fmt::format("step {} is already committed in {}", step, tier)};
  return {};
}

}  // namespace

Expected<SaveHandle> Checkpointer::save(std::uint64_t step, const std::vector<BlobView>& blobs, const json& meta,
                                        const SaveOptions& save_options) {
  if (!impl_->read_only.empty()) return Error{ErrorKind::kIo, fmt::format("cannot save step {}: {}", step, impl_->read_only)};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> tiers = {impl_->opt.root};
  if (impl_->opt.fast_tier) tiers.push_back(*impl_->opt.fast_tier);
  impl_->prepare_step(step, tiers);
  auto r = save_impl(step, blobs, meta, save_options);
  impl_->counters.blocked_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (r) ++impl_->counters.saves;
  return r;
}

void Checkpointer::reserve(int device) {
  std::lock_guard g(impl_->mu);
  if (impl_->reserver.joinable() || impl_->stopping) return;
  impl_->reserver = std::thread([im = impl_.get(), device] { im->pool->reserve(device, im->reserve_stop); });
}

Checkpointer::Stats Checkpointer::stats() const {
  Stats s = impl_->counters;
  const auto a = impl_->pool->allocated();
  s.staging_bytes = a.bytes;
  s.pinned_bytes = a.pinned;
  s.overflow_bytes = a.overflow;
  return s;
}

namespace {

// What this rank writes of one blob: bytes [begin, end) of blobs[view].
struct Write {
  std::size_t view = 0;
  std::uint64_t begin = 0, end = 0;
};

// A new save of `step`: its handle's state and the manifest's header.
std::shared_ptr<Job> new_job(Checkpointer::Impl& im, std::uint64_t step, const json& meta, const std::string& tier) {
  auto job = std::make_shared<Job>();
  job->state = std::make_shared<SaveHandle::State>();
  job->state->step = step;
  job->state->owner = &im;
  job->tier_root = tier;
  job->rank = im.comm->rank();
  Manifest& m = job->manifest;
  m.step = step;
  m.world_size = im.comm->size();
  m.chunk_bytes = im.opt.chunk_bytes;
  m.meta = meta;
  return job;
}

// The step's temporary directory and this rank's data file in it. Collective
// with several ranks (rank 0 names the directory, and no rank opens its file
// before the directory exists), so every rank takes part even when its save
// is already invalid; `valid` keeps the first error.
void open_step_files(Checkpointer::Impl& im, Job& job, std::uint64_t step, bool several, Status& valid) {
  std::string tmp_name = temp_dir_name(step, im.host, ::getpid());
  if (several) tmp_name = im.comm->broadcast(tmp_name, 0);
  job.tmp_dir = (fs::path(job.tier_root) / tmp_name).string();
  std::error_code ec;
  // With a fast tier every node has its own directory: each rank makes it.
  if (!several || im.comm->rank() == 0 || im.opt.fast_tier) fs::create_directory(job.tmp_dir, ec);
  if (several) im.comm->barrier();
  if (valid && ec) valid = Error{ErrorKind::kIo, fmt::format("{}: cannot create: {}", job.tmp_dir, ec.message())};
  job.data_path = fmt::format("{}/rank-{:05d}.bin", job.tmp_dir, job.rank);
  if (!valid) return;
  // O_DIRECT skips the page cache: large checkpoints are written at the
  // disk's speed instead of the dirty-page throttle's, and do not evict the
  // job's working set. tmpfs and some filesystems refuse it.
  job.fd = ::open(job.data_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
  job.direct = job.fd >= 0;
  if (job.fd < 0 && errno == EINVAL) job.fd = ::open(job.data_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (job.fd < 0) valid = io_error("cannot create", job.data_path, errno);
}

// What this rank writes: its own blobs whole and, with several ranks, its
// share of the replicated ones (a byte range each, recorded as a shard of
// the blob unless it is the whole blob). With several ranks the job also
// records the replicated list, for the commit to check that every rank split
// the same one.
std::vector<Write> plan_writes(Checkpointer::Impl& im, Job& job, const std::vector<BlobView>& blobs, bool several) {
  std::vector<Write> writes;
  std::vector<std::vector<Write>> shares(blobs.size());
  if (several) {
    job.replicated_list = replicated_list(blobs);
    job.replicated_xxh3 = fmt::format("{:016x}", XXH3_64bits(job.replicated_list.data(), job.replicated_list.size()));
    job.state->replicated_xxh3 = job.replicated_xxh3;
    for (const auto& p : split_replicated(blobs, im.comm->size()))
      if (p.rank == job.rank) shares[p.blob].push_back({p.blob, p.begin, p.end});
  }
  for (std::size_t i = 0; i < blobs.size(); ++i) {
    if (several && blobs[i].layout == Layout::kReplicated) writes.insert(writes.end(), shares[i].begin(), shares[i].end());
    else writes.push_back({i, 0, blobs[i].size});
  }
  return writes;
}

// The manifest's entries for the writes, laid out in one file per rank, each
// at a 4 KiB boundary (O_DIRECT writes whole aligned blocks).
void lay_out(Job& job, const std::vector<BlobView>& blobs, const std::vector<Write>& writes) {
  Manifest& m = job.manifest;
  std::uint64_t offset = 0;
  for (const auto& w : writes) {
    const BlobView& b = blobs[w.view];
    BlobInfo info;
    info.name = b.name;
    info.rank = job.rank;
    info.file = fs::path(job.data_path).filename().string();
    info.offset = offset;
    info.size = w.end - w.begin;
    info.dtype = b.dtype;
    if (b.layout == Layout::kReplicated && info.size != b.size) {
      // Cut at 4 KiB of the blob: whole elements, a flat run of them.
      info.layout = Layout::kShard;
      if (!b.shape.empty() && b.dtype != "bytes") info.shape = {static_cast<std::int64_t>(info.size / dtype_size(b.dtype))};
      info.shard_offset = w.begin;
      info.global_size = b.size;
      info.global_shape = b.shape;
    } else {
      info.shape = b.shape;
      info.layout = b.layout;
      info.shard_offset = b.shard_offset;
      info.global_size = b.layout == Layout::kShard ? b.global_size : b.size;
      info.global_shape = b.global_shape;
    }
    info.chunk_hashes.assign((info.size + m.chunk_bytes - 1) / m.chunk_bytes, 0);
    m.blobs.push_back(std::move(info));
    offset = align_up(offset + w.end - w.begin, kAlign);
  }
  job.file_bytes = offset;
}

// Copies a save's writes into staging buffers: large blobs fill whole
// buffers, small ones are packed together so that many small tensors do not
// each take a buffer. Device blobs are queued on the side streams into as
// many buffers as are free; only when the pool runs dry do the copies so far
// have to land (and go to the writer) before more buffers come back.
class Stager {
 public:
  Stager(Checkpointer::Impl& im, std::shared_ptr<Job> job, std::uint64_t step, bool several)
      : im_(im), job_(std::move(job)), step_(step), several_(several), cap_(im.pool->buffer_bytes()) {}

  // Stages every write; returns once every copy has landed, so that the
  // caller may overwrite its tensors (the next optimizer step) at once, or,
  // with `defer`, once the last device copies are queued: they land while
  // the caller goes on, behind fence(). On failure, abort() must follow.
  Status stage(const std::vector<BlobView>& blobs, const std::vector<Write>& writes, std::uintptr_t cuda_stream,
               bool defer) {
    const std::uint64_t chunk_bytes = job_->manifest.chunk_bytes;
    for (std::size_t i = 0; i < writes.size(); ++i) {
      const BlobView& b = blobs[writes[i].view];
      const auto* src = static_cast<const unsigned char*>(b.data) + writes[i].begin;
      const std::uint64_t size = writes[i].end - writes[i].begin;
      if (b.device >= 0 && size > 0 && ordered_.insert(b.device).second) {
        if (!im_.d2h) im_.d2h = std::make_unique<hw::DeviceToHost>();
        if (Status st = im_.d2h->order_after(b.device, cuda_stream); !st) return blob_error(b, st);
      }
      for (std::uint64_t c = 0, off = 0; off < size; ++c, off += chunk_bytes) {
        const std::uint64_t len = std::min(chunk_bytes, size - off);
        // Packed without gaps: what does not fit in this buffer continues in
        // the next, so blobs of any mix of sizes fill the budget they are given.
        for (std::uint64_t done = 0; done < len;) {
          if (cur_.buf && used_ >= cap_) close_current();
          if (!cur_.buf) {
            cur_.kind = Task::Kind::kChunk;
            cur_.job = job_;
            cur_.buf = im_.pool->try_acquire(b.device);
            if (!cur_.buf) {
              if (Status st = land(); !st) return st;
              ++im_.counters.pool_waits;
              cur_.buf = im_.pool->acquire(b.device);
            }
          }
          const std::uint64_t take = std::min(len - done, cap_ - used_);
          if (b.device >= 0) {
            if (Status st = im_.d2h->copy(b.device, cur_.buf + used_, src + off + done, take); !st) return blob_error(b, st);
            queued_ = true;
          } else {
            std::memcpy(cur_.buf + used_, src + off + done, take);
          }
          cur_.pieces.push_back({i, c, used_, take, done, done + take == len});
          used_ = align_up(used_ + take, kAlign);  // O_DIRECT needs 4 KiB-aligned sources
          done += take;
          staged_ += take;
        }
      }
    }
    close_current();
    return land(defer);
  }

  // The deferred copies' fence (none when nothing was deferred).
  const std::shared_ptr<hw::CopyFence>& fence() const { return fence_; }

  // A failure while staging: no copy may land in a buffer after it is handed
  // back, and the writer drops what it already has of this save. With several
  // ranks this rank still takes part in the commit, as a failed rank; alone,
  // the caller waits for the writer to finish with the save.
  void abort(const Error& err) {
    if (im_.d2h) (void)im_.d2h->synchronize();
    for (auto& t : landing_) im_.pool->release(t.buf);
    if (cur_.buf) im_.pool->release(cur_.buf);
    Task end;
    end.kind = Task::Kind::kEnd;
    end.job = job_;
    end.abort = err;
    im_.push(std::move(end));
    if (several_) {
      job_->state->collective_pending = true;
      (void)im_.collective_commit(job_->state, job_->tmp_dir);
    }
  }

  std::uint64_t staged() const { return staged_; }

 private:
  Error blob_error(const BlobView& b, const Status& st) const {
    return Error{st.error().kind, fmt::format("step {}: blob '{}': {}", step_, b.name, st.error().message)};
  }
  void close_current() {
    if (cur_.buf && !cur_.pieces.empty()) {
      // Buffers reach the writer once staging ends or the pool runs dry, in
      // order (a chunk split across two is checksummed piece by piece): a
      // writer hashing and writing while the caller copies takes the memory
      // bandwidth and the core that save() is blocking on.
      landing_.push_back(std::move(cur_));
    } else if (cur_.buf) {
      im_.pool->release(cur_.buf);
    }
    cur_ = Task{};
    used_ = 0;
  }
  // Hands the full buffers to the writer once their copies have landed, or
  // (`defer`) at once, each with a fence that the writer waits for. A pool
  // that runs dry mid-save lands without deferring: the buffers it waits for
  // come back only after the writer is done with them.
  Status land(bool defer = false) {
    if (queued_) {
      queued_ = false;
      if (defer) {
        auto f = im_.d2h->fence();
        if (!f) return copy_error(step_, f.error());
        fence_ = *f;
        for (auto& t : landing_) t.fence = fence_;
      } else if (Status st = im_.d2h->synchronize(); !st) {
        return copy_error(step_, st.error());
      }
    }
    for (auto& t : landing_) im_.push(std::move(t));
    landing_.clear();
    return {};
  }

  Checkpointer::Impl& im_;
  std::shared_ptr<Job> job_;
  std::uint64_t step_;
  bool several_;
  const std::uint64_t cap_;
  Task cur_;
  std::uint64_t used_ = 0;
  bool queued_ = false;         // device copies queued since the last landing
  std::vector<Task> landing_;   // full buffers not yet handed to the writer
  std::set<int> ordered_;       // devices whose side stream waits for the producer stream
  std::uint64_t staged_ = 0;
  std::shared_ptr<hw::CopyFence> fence_;
};

}  // namespace

Expected<SaveHandle> Checkpointer::save_impl(std::uint64_t step, const std::vector<BlobView>& blobs, const json& meta,
                                             const SaveOptions& save_options) {
  Impl& im = *impl_;
  // Collectives stay in order: the previous step commits before this one starts.
  if (im.pending_collective) {
    SaveHandle prev(im.pending_collective);
    (void)prev.wait();
  }
  std::vector<std::string> tiers = {im.opt.root};
  if (im.opt.fast_tier) tiers.push_back(*im.opt.fast_tier);
  Status valid = validate_save(step, blobs, meta, tiers);
  const bool several = im.comm->size() > 1;
  if (!valid && !several) return valid.error();

  auto job = new_job(im, step, meta, im.first_tier());
  open_step_files(im, *job, step, several, valid);
  if (!valid) {
    if (!several) {
      std::error_code ec;
      fs::remove_all(job->tmp_dir, ec);
      return valid.error();
    }
    // The other ranks are already in this save's collectives: take part in
    // them as a failed rank, so that nobody waits for us and nothing commits.
    job->state->collective_pending = true;
    im.finish_local(job->state, valid.error(), false);
    (void)im.collective_commit(job->state, job->tmp_dir);
    return valid.error();
  }

  const std::vector<Write> writes = plan_writes(im, *job, blobs, several);
  lay_out(*job, blobs, writes);
  Stager stager(im, job, step, several);
  if (Status st = stager.stage(blobs, writes, save_options.cuda_stream, save_options.defer_device_copies); !st) {
    stager.abort(st.error());
    if (!several) (void)SaveHandle(job->state).wait();
    return st.error();
  }
  im.counters.bytes_staged += stager.staged();
  job->state->copies = stager.fence();
  {
    std::lock_guard g(im.mu);
    im.outstanding.push_back(job->state);
  }
  if (several) {
    job->state->collective_pending = true;
    im.collective_dirs[step] = job->tmp_dir;
    im.pending_collective = job->state;
  }
  Task end;
  end.kind = Task::Kind::kEnd;
  end.job = job;
  im.push(std::move(end));
  return SaveHandle(job->state);
}

Status Checkpointer::flush() {
  std::vector<std::shared_ptr<SaveHandle::State>> states;
  {
    std::lock_guard g(impl_->mu);
    states.swap(impl_->outstanding);
  }
  Status first;
  for (auto& s : states) {
    SaveHandle h(s);
    Status st = h.wait_persistent();
    if (!st && first) first = st;
  }
  return first;
}

std::optional<std::uint64_t> Checkpointer::latest() {
  auto r = open_reader(std::nullopt);
  if (!r) return std::nullopt;
  return r->manifest().step;
}

namespace {

// Every copy whose manifest and file sizes check, newest step first and the
// fast tier first within a step; partial ones (a node's share) included.
std::vector<Reader> all_copies(const Options& opt, std::optional<std::uint64_t> step, const std::function<void(const std::string&)>& warn) {
  std::vector<std::string> tiers;
  if (opt.fast_tier) tiers.push_back(*opt.fast_tier);
  tiers.push_back(opt.root);
  std::vector<Reader> out;
  // A writer's retention may remove every step listed before they are
  // opened (it commits a newer one first): then list again.
  for (int attempt = 0; attempt < 5; ++attempt) {
    std::map<std::uint64_t, std::vector<std::string>, std::greater<>> paths;
    for (const auto& t : tiers) {
      for (const auto& e : list(t, false)) {
        if (step && e.step != *step) continue;
        if (e.committed) paths[e.step].push_back(e.path);
        else if (parse_step_dir_name(fs::path(e.path).filename().string()) && fs::exists(e.path))
          warn(fmt::format("skipping step {}: {}", e.step, e.problem));
      }
    }
    int vanished = 0;
    for (const auto& [s, ps] : paths) {
      for (const auto& p : ps) {
        auto r = Reader::open(p);
        if (r) {
          out.push_back(std::move(*r));
        } else if (fs::exists(p)) {
          warn(fmt::format("skipping step {}: {}", s, r.error().message));
        } else {
          ++vanished;  // removed by retention since it was listed: not a problem
        }
      }
    }
    if (!out.empty() || vanished == 0) break;
  }
  return out;
}

struct Want {
  std::string name;
  unsigned char* data;
  std::uint64_t offset;
  std::uint64_t size;
};

// Loads smaller than this are not worth a faulting thread.
constexpr std::uint64_t kPrefaultFrom = 64ull << 20;

// Reads every wanted range, split into pieces read by a few threads at once,
// so that the disk always has requests queued while pages are faulted in and
// checksums computed. The first error stops the rest.
Status read_wants(Reader& r, const std::vector<Want>& wants) {
  const std::uint64_t piece = std::max<std::uint64_t>(r.manifest().chunk_bytes, 256ull << 20) /
                              r.manifest().chunk_bytes * r.manifest().chunk_bytes;
  std::vector<Want> pieces;
  for (const auto& w : wants) {
    for (std::uint64_t lo = w.offset; lo < w.offset + w.size || (w.size == 0 && lo == w.offset);) {
      const std::uint64_t hi = std::min(w.offset + w.size, (lo / piece + 1) * piece);
      pieces.push_back({w.name, w.data + (lo - w.offset), lo, hi - lo});
      if (hi == lo) break;
      lo = hi;
    }
  }
  const std::size_t threads = std::min<std::size_t>(pieces.size(), 4);
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  Status first;
  // One more thread faults the destinations in, piece by piece in the order
  // they are read, ahead of the readers: a reader whose destination is new
  // memory otherwise faults it in (slow on a VM, where each first touch goes
  // to the host) before its read goes out, while the disk idles. Measured in
  // bench/results/ckpt_load_alloc-2026-12-01.md.
  std::uint64_t total = 0;
  for (const auto& p : pieces) total += p.size;
  std::atomic<std::size_t> faulted{pieces.size()};
  std::thread faulter;
  if (pieces.size() > 1 && total >= kPrefaultFrom) {
    faulted = 0;
    faulter = std::thread([&] {
      for (std::size_t i = 0; i < pieces.size() && !failed; ++i) {
        const bool ok = prefault_for_write(pieces[i].data, pieces[i].size);
        faulted = ok ? i + 1 : pieces.size();  // the kernel cannot: the readers fault their own
        faulted.notify_all();
        if (!ok) break;
      }
      faulted = pieces.size();
      faulted.notify_all();
    });
  }
  auto work = [&] {
    for (std::size_t i; !failed && (i = next.fetch_add(1)) < pieces.size();) {
      for (std::size_t f; (f = faulted.load()) <= i;) faulted.wait(f);
      const Want& p = pieces[i];
      Status st = r.read(p.name, p.data, p.size, p.offset);
      if (!st) {
        std::lock_guard g(mu);
        if (first) first = st;
        failed = true;
      }
    }
  };
  std::vector<std::thread> pool;
  for (std::size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  failed = true;  // stops the faulter, if still ahead
  if (faulter.joinable()) faulter.join();
  return first;
}

}  // namespace

std::vector<Reader> Checkpointer::candidates(std::optional<std::uint64_t> step) {
  Impl& im = *impl_;
  std::vector<Reader> out;
  // A node's share of a step is not a checkpoint on its own: a loader that
  // reads every blob it lists would miss the other nodes' blobs.
  for (auto& r : all_copies(im.opt, step, [&](const std::string& w) { im.warn(w); }))
    if (r.complete()) out.push_back(std::move(r));
  return out;
}

Expected<Reader> Checkpointer::load(const LoadDestination& dest, std::optional<std::uint64_t> step) {
  Impl& im = *impl_;
  auto copies = all_copies(im.opt, step, [&](const std::string& w) { im.warn(w); });
  std::vector<std::string> problems;
  for (std::size_t i = 0; i < copies.size();) {
    // The copies of one step: the complete ones say what the step holds, so
    // the targets are asked for once per step.
    const std::uint64_t s = copies[i].manifest().step;
    std::size_t end = i;
    while (end < copies.size() && copies[end].manifest().step == s) ++end;
    const Reader* whole = nullptr;
    for (std::size_t k = i; k < end && !whole; ++k)
      if (copies[k].complete()) whole = &copies[k];
    if (!whole) {
      im.warn(fmt::format("skipping step {}: only this node's part of it is here (not yet on the persistent tier)", s));
      i = end;
      continue;
    }
    std::vector<Want> wants;
    for (const auto& l : whole->logical_blobs()) {
      LoadTarget t = dest(l);
      if (!t.data) continue;
      if (t.offset > l.size || t.size > l.size - t.offset)
        return Error{ErrorKind::kUsage, fmt::format("load target for blob '{}': bytes {}..{} of a {}-byte blob", l.name, t.offset, t.offset + t.size, l.size)};
      wants.push_back({l.name, static_cast<unsigned char*>(t.data), t.offset, t.size});
    }
    for (std::size_t k = i; k < end; ++k) {
      Reader& r = copies[k];
      // A node's partial copy serves only a load that it holds all of.
      if (!r.complete() && !std::all_of(wants.begin(), wants.end(), [&](const Want& w) { return r.covers(w.name, w.size, w.offset); }))
        continue;
      Status st = read_wants(r, wants);
      if (st) return std::move(r);
      im.warn(fmt::format("skipping step {} in {}: {}", s, r.dir(), st.error().message));
      problems.push_back(st.error().message);
    }
    i = end;
  }
  const std::string where = step ? fmt::format("step {}", *step) : std::string("any step");
  return Error{ErrorKind::kUsage, fmt::format("no valid checkpoint for {} under {}{}", where, im.opt.root,
                                              problems.empty() ? "" : ": " + problems.front())};
}

Expected<Reader> Checkpointer::open_reader(std::optional<std::uint64_t> step) {
  // A writer's retention may remove every candidate between the listing and
  // the check (it committed a newer step first): then list again.
  for (int attempt = 0; attempt < 5; ++attempt) {
    bool vanished = false;
    for (auto& r : candidates(step)) {
      // Through this process's cache of checks (as retention): a step it wrote
      // or checked before is not read in full again. Reads through the Reader
      // check every chunk anyway.
      if (Status st = verify_step(r.dir()); !st) {
        std::error_code ec;
        if (!fs::exists(r.dir(), ec)) {
          vanished = true;  // removed since it was listed: not a problem of the step
          continue;
        }
        impl_->warn(fmt::format("skipping step {}: {}", r.manifest().step, st.error().message));
        continue;
      }
      return std::move(r);
    }
    if (!vanished) break;
  }
  if (step) return Error{ErrorKind::kUsage, fmt::format("no valid checkpoint for step {} under {}", *step, impl_->opt.root)};
  return Error{ErrorKind::kUsage, fmt::format("no valid checkpoint under {}", impl_->opt.root)};
}

double young_interval(double save_cost_s, double mtbf_s) { return pacer::young_interval(save_cost_s, mtbf_s); }

double optimal_interval(double save_cost_s, double mtbf_s) { return pacer::optimal_interval(save_cost_s, mtbf_s); }

}  // namespace pacer::ckpt
