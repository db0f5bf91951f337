// Gzip-compressed shards (.tar.gz): decompressed whole into an anonymous in-memory file.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

#include "pacer/core/posix_io.hpp"
#include "pacer/core/units.hpp"
#include "tar_internal.hpp"

namespace pacer::data {

namespace {

Error gzip_error(const std::string& path, const std::string& what) {
  return Error{ErrorKind::kConfig, fmt::format("{}: gzip: {}", path, what)};
}

struct Inflater {
  z_stream z{};
  bool ready = false;
  ~Inflater() {
    if (ready) inflateEnd(&z);
  }
};

}  // namespace

namespace {
// A positive size from the environment ("8GiB", "1k", "4096"), else
// `fallback`; a value that is not one is said once on stderr, not ignored
// silently (a cap the user thinks is set would not be).
std::uint64_t bytes_from_env(const char* name, std::uint64_t fallback, std::once_flag& said) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  auto n = parse_size(v);
  if (n && *n > 0) return *n;
  std::call_once(said, [&] {
    fmt::print(stderr, "pacer: warning: {}='{}' is not a positive size ({}); using {} bytes\n", name, v,
               n ? "zero" : n.error().message, fallback);
  });
  return fallback;
}
}  // namespace

// A gzip stream expands up to ~1000x, so the compressed size bounds nothing:
// the decompressed bytes are capped instead.
std::uint64_t gzip_shard_limit() {
  static std::once_flag said;
  return bytes_from_env("PACER_GZIP_MAX_BYTES", kDefaultGzipShardLimit, said);
}

std::uint64_t gzip_cache_limit() {
  static std::once_flag said;
  return bytes_from_env("PACER_GZIP_CACHE_BYTES", 2ULL << 30, said);
}

Expected<bool> is_gzip(int fd, const std::string& path) {
  unsigned char magic[2] = {0, 0};
  auto got = pread_full(fd, magic, 2, 0, path);
  if (!got) return got.error();
  return *got == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
}

Expected<Fd> gunzip_to_memory(int fd, const std::string& path, std::uint64_t limit, std::uint64_t& size) {
  size = 0;
  const int mfd = ::memfd_create("pacer-gunzip", MFD_CLOEXEC);
  if (mfd < 0) return io_error("cannot create an in-memory file for the decompressed shard", path, errno);
  Fd out(mfd);
  Inflater inf;
  // 16 + MAX_WBITS: a gzip wrapper (header and CRC-32/ISIZE trailer) is required and checked.
  if (inflateInit2(&inf.z, 16 + MAX_WBITS) != Z_OK) return gzip_error(path, "cannot start zlib");
  inf.ready = true;
  constexpr std::size_t kChunk = 1 << 20;
  std::unique_ptr<unsigned char[]> in(new unsigned char[kChunk]);
  std::unique_ptr<unsigned char[]> buf(new unsigned char[kChunk]);
  std::uint64_t in_off = 0;
  bool ended = false;  // the last member read ended with its trailer
  for (;;) {
    if (inf.z.avail_in == 0) {
      auto got = pread_full(fd, in.get(), kChunk, in_off, path);
      if (!got) return got.error();
      if (*got == 0) break;
      in_off += *got;
      inf.z.next_in = in.get();
      inf.z.avail_in = static_cast<uInt>(*got);
    }
    if (ended) {
      // Concatenated members (gzip a; gzip b; cat) are one stream, as gzip -d reads them.
      if (inf.z.next_in[0] != 0x1f) return gzip_error(path, fmt::format("bytes after the gzip stream at compressed offset {}", in_off - inf.z.avail_in));
      if (inflateReset(&inf.z) != Z_OK) return gzip_error(path, "cannot restart zlib");
      ended = false;
    }
    inf.z.next_out = buf.get();
    inf.z.avail_out = static_cast<uInt>(kChunk);
    const int rc = inflate(&inf.z, Z_NO_FLUSH);
    if (rc != Z_OK && rc != Z_STREAM_END && rc != Z_BUF_ERROR)
      return gzip_error(path, fmt::format("corrupt data at compressed offset {}: {}", in_off - inf.z.avail_in,
                                          inf.z.msg ? inf.z.msg : zError(rc)));
    const std::uint64_t produced = kChunk - inf.z.avail_out;
    if (produced > limit - size)
      return gzip_error(path, fmt::format("decompresses to more than {} bytes (PACER_GZIP_MAX_BYTES; a gzip bomb, or a "
                                          "shard too large to hold in memory: gunzip it)", limit));
    if (produced) {
      if (Status st = write_full(out.get(), buf.get(), produced, path); !st) return st.error();
      size += produced;
    }
    if (rc == Z_STREAM_END) ended = true;
  }
  if (!ended) return gzip_error(path, fmt::format("truncated: the stream ends without its trailer after {} decompressed bytes", size));
  return out;
}

}  // namespace pacer::data
