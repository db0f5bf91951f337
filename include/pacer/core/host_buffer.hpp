// Large page-aligned host buffers, optionally backed by transparent huge pages.
#pragma once

#include <cstddef>

namespace pacer {

// An anonymous mapping of at least `bytes`, 2 MiB aligned. With `huge`, it is
// advised as huge pages: first touch then faults once per 2 MiB, but where
// THP defrag is "madvise" that first touch may stall on compaction (measured
// slower than 4 KiB pages on a 2-core VM), so it is for long-lived buffers
// only. Move-only; unmapped on destruction. Contents start zeroed.
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(std::size_t bytes, bool huge = false);
  ~HostBuffer();
  HostBuffer(HostBuffer&& o) noexcept;
  HostBuffer& operator=(HostBuffer&& o) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  unsigned char* data() const { return data_; }
  std::size_t size() const { return size_; }          // as asked for
  std::size_t capacity() const { return mapped_; }    // as mapped (>= size)
  explicit operator bool() const { return data_ != nullptr; }
  // Hands the pages back to the kernel lazily (MADV_FREE): they stay mapped
  // and are written again without a fault, unless memory ran short
  // meanwhile and the kernel took them (they then come back zeroed). For a
  // buffer that is idle for now and whose contents no longer matter.
  void release_lazily();

 private:
  unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t mapped_ = 0;
};

// Faults in the pages of [p, p + bytes) of ordinary anonymous memory for
// writing without touching their contents (MADV_POPULATE_WRITE, Linux 5.14;
// the whole pages around the range), so that a later read into them (an
// O_DIRECT read pins them first) finds them present. Run on a thread of its
// own ahead of the reads, it overlaps the cost of new memory (high on a VM:
// each first touch goes to the host) with the disk's work. False where the
// kernel cannot (older kernels, other mappings): nothing was done.
bool prefault_for_write(void* p, std::size_t bytes);

// Advises the 2 MiB-aligned interior of [p, p + bytes) of anonymous memory as
// transparent huge pages (MADV_HUGEPAGE), so that its first touch faults and
// zeroes once per 2 MiB instead of once per 4 KiB; the ragged ends keep 4 KiB
// pages. To take effect it must come before the first write. Whether that is
// faster depends on the machine: on a VM whose balloon returns free 2 MiB
// blocks to the host (free page reporting) a huge first touch measured slower
// (bench/results/ckpt_load_alloc-2026-12-01.md). False where nothing was
// advised (a range without a whole 2 MiB page, THP off, other mappings).
bool advise_huge_pages(void* p, std::size_t bytes);

}  // namespace pacer
