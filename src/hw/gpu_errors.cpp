#include "pacer/hw/gpu_errors.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <filesystem>

#include "pacer/core/posix_io.hpp"
#include "pacer/hw/system.hpp"

namespace pacer::hw {
namespace {

// The kmsg prefix "PRIO,SEQ,USEC,FLAGS;": the timestamp, and the text after it.
std::string_view strip_kmsg_prefix(std::string_view line, std::optional<double>* time_s) {
  const auto semi = line.find(';');
  if (semi == std::string_view::npos) return line;
  const std::string_view head = line.substr(0, semi);
  // A prefix is digits and commas (and the flag characters '-', 'c', '+') only.
  if (head.find_first_not_of("0123456789,-c+") != std::string_view::npos) return line;
  const auto c1 = head.find(',');
  const auto c2 = c1 == std::string_view::npos ? c1 : head.find(',', c1 + 1);
  const auto c3 = c2 == std::string_view::npos ? c2 : head.find(',', c2 + 1);
  if (c3 == std::string_view::npos) return line;
  unsigned long long usec = 0;
  const std::string_view ts = head.substr(c2 + 1, c3 - c2 - 1);
  if (std::from_chars(ts.data(), ts.data() + ts.size(), usec).ec == std::errc{}) *time_s = static_cast<double>(usec) / 1e6;
  return line.substr(semi + 1);
}

bool hex_field(std::string_view s, unsigned long* out) {
  if (s.empty() || s.size() > 8) return false;
  return std::from_chars(s.data(), s.data() + s.size(), *out, 16).ec == std::errc{} &&
         s.find_first_not_of("0123456789abcdefABCDEF") == std::string_view::npos;
}

}  // namespace

std::vector<KernelXid> parse_kernel_xids(std::string_view text) {
  std::vector<KernelXid> out;
  constexpr std::string_view kMark = "NVRM: Xid (PCI:";
  while (!text.empty()) {
    const auto nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
    KernelXid x;
    line = strip_kmsg_prefix(line, &x.time_s);
    const auto at = line.find(kMark);
    if (at == std::string_view::npos) continue;
    line.remove_prefix(at + kMark.size());
    const auto close = line.find(')');
    if (close == std::string_view::npos) continue;
    // "0000:3b:00" or, from some drivers, "0000:3b:00.0".
    std::string_view pci = line.substr(0, close);
    if (const auto dot = pci.find('.'); dot != std::string_view::npos) pci = pci.substr(0, dot);
    const auto p1 = pci.find(':');
    const auto p2 = p1 == std::string_view::npos ? p1 : pci.find(':', p1 + 1);
    unsigned long dom = 0, bus = 0, dev = 0;
    if (p2 == std::string_view::npos || !hex_field(pci.substr(0, p1), &dom) ||
        !hex_field(pci.substr(p1 + 1, p2 - p1 - 1), &bus) || !hex_field(pci.substr(p2 + 1), &dev) || dom > 0xffff ||
        bus > 0xff || dev > 0x1f)
      continue;
    x.pci = fmt::format("{:04x}:{:02x}:{:02x}", dom, bus, dev);
    line.remove_prefix(close + 1);
    if (!line.starts_with(": ")) continue;
    line.remove_prefix(2);
    unsigned xid = 0;
    const auto [end, ec] = std::from_chars(line.data(), line.data() + line.size(), xid);
    if (ec != std::errc{} || end == line.data()) continue;
    x.xid = xid;
    line.remove_prefix(static_cast<std::size_t>(end - line.data()));
    if (line.starts_with(",")) line.remove_prefix(1);
    while (line.starts_with(" ")) line.remove_prefix(1);
    x.message = std::string(line);
    out.push_back(std::move(x));
  }
  return out;
}

Expected<std::vector<KernelXid>> read_kernel_xids(const std::string& root) {
  const std::string path = root + "/dev/kmsg";
  // /dev/kmsg hands out one record per read and EAGAIN at the end; a plain
  // file (a saved log, the tests' fake) reads in chunks and ends with 0.
  auto fd = open_fd(path, O_RDONLY | O_NONBLOCK);
  if (!fd) return fd.error();
  constexpr std::size_t kMaxBytes = 64u << 20;
  std::string text;
  char buf[8192];
  while (text.size() < kMaxBytes) {
    const ssize_t n = retry_eintr([&] { return ::read(fd->get(), buf, sizeof(buf)); });
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN) break;
      if (errno == EPIPE) continue;  // records overwritten while reading: the next one follows
      return io_error("read", path, errno);
    }
    text.append(buf, static_cast<std::size_t>(n));
    // Records end in a newline; chunks of a plain file may not.
    if (text.back() != '\n' && static_cast<std::size_t>(n) < sizeof(buf)) text.push_back('\n');
  }
  return parse_kernel_xids(text);
}

Expected<int> read_pci_numa_node(const std::string& pci_bus_id, const std::string& root) {
  auto text = read_text(root + "/sys/bus/pci/devices/" + pci_bus_id + "/numa_node");
  if (!text) return text.error();
  int node = -1;
  const auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), node);
  if (ec != std::errc{} || end != text->data() + text->size())
    return Error{ErrorKind::kIo, fmt::format("{}/sys/bus/pci/devices/{}/numa_node: not a number: '{}'", root, pci_bus_id, *text)};
  return node;
}

std::vector<RdmaNic> read_rdma_nics(const std::string& root) {
  std::vector<RdmaNic> out;
  for (const auto& dev : ib_device_dirs(root)) {
    RdmaNic nic;
    nic.name = dev.filename().string();
    if (auto t = read_text((dev / "device" / "numa_node").string()))
      std::from_chars(t->data(), t->data() + t->size(), nic.numa_node);
    out.push_back(nic);
  }
  return out;
}

Expected<std::string> read_uvm_hmm(const std::string& root) {
  const std::string module = root + "/sys/module/nvidia_uvm";
  std::error_code ec;
  if (!std::filesystem::exists(root + "/sys/module/nvidia", ec))
    return Error{ErrorKind::kIo, fmt::format("no NVIDIA driver ({}/sys/module/nvidia missing)", root)};
  // nvidia_uvm loads with the first CUDA program, so a fresh node may lack it.
  if (!std::filesystem::exists(module, ec))
    return Error{ErrorKind::kIo, fmt::format("nvidia_uvm not loaded ({} missing; it loads with the first CUDA program)", module)};
  const std::string path = module + "/parameters/uvm_disable_hmm";
  auto text = read_text(path);
  // Drivers before HMM support (r530) have no such parameter: nothing to disable.
  if (!text) return Error{ErrorKind::kIo, fmt::format("this nvidia_uvm has no HMM switch ({} missing)", path)};
  if (*text == "Y" || *text == "1") return std::string("disabled");
  if (*text == "N" || *text == "0") return std::string("enabled");
  return Error{ErrorKind::kIo, fmt::format("{}: unexpected value '{}'", path, *text)};
}

}  // namespace pacer::hw
