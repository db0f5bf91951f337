#include "pacer/core/host_buffer.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <utility>

namespace pacer {

namespace {
constexpr std::size_t kHuge = 2u << 20;
}

HostBuffer::HostBuffer(std::size_t bytes, bool huge) : size_(bytes) {
  if (bytes == 0) return;
  mapped_ = (bytes + kHuge - 1) / kHuge * kHuge;
  // Over-map by one huge page so the start can be aligned to it.
  const std::size_t total = mapped_ + kHuge;
  void* p = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    size_ = mapped_ = 0;
    return;
  }
  auto base = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t aligned = (base + kHuge - 1) / kHuge * kHuge;
  if (aligned > base) ::munmap(p, aligned - base);
  const std::uintptr_t end = base + total;
  if (end > aligned + mapped_) ::munmap(reinterpret_cast<void*>(aligned + mapped_), end - (aligned + mapped_));
  data_ = reinterpret_cast<unsigned char*>(aligned);
  if (huge) (void)advise_huge_pages(data_, mapped_);
}

void HostBuffer::release_lazily() {
  // MADV_FREE needs Linux 4.5; without it the pages simply stay.
  if (data_) (void)::madvise(data_, mapped_, MADV_FREE);
}

bool prefault_for_write(void* p, std::size_t bytes) {
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14; older headers lack it
#endif
  if (!p || bytes == 0) return true;
  static const std::uintptr_t page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(p) / page * page;
  const auto end = (reinterpret_cast<std::uintptr_t>(p) + bytes + page - 1) / page * page;
  return ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) == 0;
}

bool advise_huge_pages(void* p, std::size_t bytes) {
  const auto lo = reinterpret_cast<std::uintptr_t>(p);
  if (!p || bytes < kHuge || lo > UINTPTR_MAX - bytes) return false;
  const std::uintptr_t begin = (lo + kHuge - 1) / kHuge * kHuge;
  const std::uintptr_t end = (lo + bytes) / kHuge * kHuge;
  if (end <= begin) return false;
  return ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) == 0;
}

HostBuffer::~HostBuffer() {
  if (data_) ::munmap(data_, mapped_);
}

HostBuffer::HostBuffer(HostBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)), mapped_(std::exchange(o.mapped_, 0)) {}

HostBuffer& HostBuffer::operator=(HostBuffer&& o) noexcept {
  if (this != &o) {
    if (data_) ::munmap(data_, mapped_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    mapped_ = std::exchange(o.mapped_, 0);
  }
  return *this;
}

}  // namespace pacer
