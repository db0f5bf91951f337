// RawTar: tar archives written block by block, for archives GNU tar will not write (bad
// checksums, odd types, base-256 sizes) and for shards built without a tar binary.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace pacer::test {

// A POSIX ustar archive in memory; finish() adds the end-of-archive blocks.
struct RawTar {
  std::string bytes;

  static void octal(char* p, std::size_t n, std::uint64_t v) {
    const std::string s = fmt::format("{:0{}o}", v, n - 1);
    std::memcpy(p, s.data(), n - 1);
    p[n - 1] = '\0';
  }
  static void set_checksum(char* h) {
    std::memset(h + 148, ' ', 8);
    unsigned sum = 0;
    for (int i = 0; i < 512; ++i) sum += static_cast<unsigned char>(h[i]);
    const std::string s = fmt::format("{:06o}", sum);
    std::memcpy(h + 148, s.data(), 6);
    h[154] = '\0';
    h[155] = ' ';
  }
  // A POSIX ustar header; `tweak` edits it before the checksum is computed.
  static std::string header(const std::string& name, std::uint64_t size, char type = '0',
                            const std::function<void(char*)>& tweak = nullptr) {
    std::string h(512, '\0');
    std::memcpy(h.data(), name.data(), std::min<std::size_t>(name.size(), 100));
    octal(h.data() + 100, 8, 0644);
    octal(h.data() + 108, 8, 0);
    octal(h.data() + 116, 8, 0);
    octal(h.data() + 124, 12, size);
    octal(h.data() + 136, 12, 1700000000);
    h[156] = type;
    std::memcpy(h.data() + 257, "ustar\0" "00", 8);
    if (tweak) tweak(h.data());
    set_checksum(h.data());
    return h;
  }
  void pad() { bytes.append((512 - bytes.size() % 512) % 512, '\0'); }
  // Adds a member; returns the offset of its header.
  std::uint64_t add(const std::string& name, const std::string& data, char type = '0',
                    const std::function<void(char*)>& tweak = nullptr) {
    const std::uint64_t off = bytes.size();
    bytes += header(name, data.size(), type, tweak);
    bytes += data;
    pad();
    return off;
  }
  // A pax extended header ('x') carrying `records` (key, value).
  void pax(const std::vector<std::pair<std::string, std::string>>& records) {
    std::string data;
    for (const auto& [k, v] : records) {
      const std::string body = " " + k + "=" + v + "\n";
      std::size_t len = body.size() + 1;
      while (std::to_string(len).size() + body.size() != len) ++len;
      data += std::to_string(len) + body;
    }
    add("PaxHeaders/x", data, 'x');
  }
  std::string finish() const { return bytes + std::string(1024, '\0'); }
};

}  // namespace pacer::test
