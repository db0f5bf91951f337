// Large page-aligned host buffers backed by transparent huge pages where the kernel allows.
#pragma once

#include <cstddef>

namespace pacer {

// An anonymous mapping of at least `bytes`, 2 MiB aligned, with MADV_HUGEPAGE,
// so that first touch faults once per 2 MiB instead of once per 4 KiB (on VMs
// the difference is several times the memcpy cost). Move-only; unmapped on
// destruction. Contents start zeroed.
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(std::size_t bytes);
  ~HostBuffer();
  HostBuffer(HostBuffer&& o) noexcept;
  HostBuffer& operator=(HostBuffer&& o) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  unsigned char* data() const { return data_; }
  std::size_t size() const { return size_; }          // as asked for
  std::size_t capacity() const { return mapped_; }    // as mapped (>= size)
  explicit operator bool() const { return data_ != nullptr; }

 private:
  unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t mapped_ = 0;
};

}  // namespace pacer
