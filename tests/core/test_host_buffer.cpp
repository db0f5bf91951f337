#include "pacer/core/host_buffer.hpp"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>

namespace {

constexpr std::size_t kHuge = 2u << 20;

// Whether the 2 MiB page at p is advised as huge pages, from the mapping's
// VmFlags ("hg") in /proc/self/smaps; nullopt where smaps cannot say.
std::optional<bool> advised_huge(const void* p) {
  FILE* f = std::fopen("/proc/self/smaps", "r");
  if (!f) return std::nullopt;
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  char line[512];
  bool inside = false;
  std::optional<bool> out;
  while (std::fgets(line, sizeof(line), f)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && std::strchr(line, '-') < std::strchr(line, ' ')) {
      inside = a >= lo && a < hi;
      continue;
    }
    if (inside && std::strncmp(line, "VmFlags:", 8) == 0) {
      out = std::strstr(line, " hg") != nullptr;
      break;
    }
  }
  std::fclose(f);
  return out;
}

TEST(HostBuffer, AdviseHugePagesCoversWholeHugePagesOnly) {
  EXPECT_FALSE(pacer::advise_huge_pages(nullptr, 4 * kHuge));
  pacer::HostBuffer b(4 * kHuge);  // 2 MiB aligned
  ASSERT_TRUE(b);
  EXPECT_FALSE(pacer::advise_huge_pages(b.data(), kHuge - 1)) << "less than one huge page";
  EXPECT_FALSE(pacer::advise_huge_pages(b.data() + 4096, kHuge)) << "no whole aligned huge page inside";
  std::memset(b.data(), 7, b.size());  // written before: the advice must not change contents
  if (!std::filesystem::exists("/sys/kernel/mm/transparent_hugepage")) GTEST_SKIP() << "no THP in this kernel";
  // From inside the first page to inside the last: the two middle pages are advised, the ends not.
  ASSERT_TRUE(pacer::advise_huge_pages(b.data() + 4096, 4 * kHuge - 8192));
  for (std::size_t i = 0; i < b.size(); i += 4096) ASSERT_EQ(b.data()[i], 7) << i;
  if (auto first = advised_huge(b.data()); first) {
    EXPECT_FALSE(*first) << "the ragged start keeps 4 KiB pages";
    EXPECT_TRUE(advised_huge(b.data() + kHuge).value_or(false));
    EXPECT_TRUE(advised_huge(b.data() + 2 * kHuge).value_or(false));
    EXPECT_FALSE(advised_huge(b.data() + 3 * kHuge).value_or(true)) << "the ragged end keeps 4 KiB pages";
  }
}

TEST(HostBuffer, HugeBufferIsAdvised) {
  pacer::HostBuffer b(3 * kHuge, /*huge=*/true);
  ASSERT_TRUE(b);
  if (!std::filesystem::exists("/sys/kernel/mm/transparent_hugepage")) GTEST_SKIP() << "no THP in this kernel";
  if (auto h = advised_huge(b.data()); h) {
    EXPECT_TRUE(*h);
  }
  pacer::HostBuffer plain(3 * kHuge);
  if (auto h = advised_huge(plain.data()); h) {
    EXPECT_FALSE(*h);
  }
}

}  // namespace
