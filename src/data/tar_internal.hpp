// Internal: the tar format pieces shared by the shard reader (tar.cpp) and the packer (pack.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace pacer::data {

constexpr std::size_t kTarBlock = 512;

// Limits on what a shard may hold, so that a crafted header cannot make the
// reader allocate beyond reason. The index stores name, key and extension
// lengths and field counts as u16.
constexpr std::size_t kMaxMemberName = 65535;      // bytes, after pax/GNU long names are resolved
constexpr std::uint64_t kMaxPaxHeader = 1u << 20;  // bytes of records in one pax 'x' header
constexpr std::size_t kMaxSampleFields = 65535;

// Data is stored in whole blocks.
inline std::uint64_t tar_padded(std::uint64_t n) { return (n + kTarBlock - 1) / kTarBlock * kTarBlock; }

// True when `name` would leave the archive root on extraction: empty,
// absolute, or with a ".." component. Both reading and packing refuse them.
bool escapes_root(std::string_view name);

// Every header block of one regular-file member, as pack writes it: one ustar
// header (mode 0644, uid/gid 0, sizes of 8 GiB and more in GNU base-256),
// preceded by a pax 'x' header carrying the path when the name fits neither
// the name field nor prefix + name. A pure function of its arguments, which is
// what lets a rerun recognise a finished shard by its headers.
std::string tar_member_headers(const std::string& name, std::uint64_t size, std::int64_t mtime);

}  // namespace pacer::data
