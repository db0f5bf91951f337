// A fake /proc and /sys tree for the sampler tests, advanced one "second" at a time.
#pragma once

#include <fmt/format.h>

#include <string>

#include "test_util.hpp"

namespace pacer::test {

// Two CPUs, one process tree (100 -> 101), eth0 and lo, one InfiniBand port
// and one disk. advance(k) moves every counter by a known amount per step so
// that rates can be checked exactly.
class FakeRoot {
 public:
  FakeRoot() : dir_("fake-root-") { write(0); }
  const std::string& path() const { return dir_.path(); }
  void write(int k) {
    // cpu0 busy 1/4 of each step, cpu1 fully busy: 100 ticks per step each.
    dir_.file("proc/stat", fmt::format("cpu  {} 0 {} {} 0 0 0 0 0 0\ncpu0 {} 0 0 {} 0 0 0 0 0 0\ncpu1 {} 0 0 {} 0 0 0 0 0 0\nintr 1 2\n",
                                       1000 + 125 * k, 0, 5000 + 75 * k, 500 + 25 * k, 2500 + 75 * k, 500 + 100 * k, 2500));
    dir_.file("proc/meminfo", "MemTotal:       1000 kB\nMemFree:   10 kB\nMemAvailable:    250 kB\n");
    // Root 100 uses 50 ticks per step, child 101 another 50; 102 is unrelated.
    dir_.file("proc/100/stat", stat_line(100, 1, "train (main)", 'S', 10 + 30 * k, 5 + 20 * k, 100));
    dir_.file("proc/101/stat", stat_line(101, 100, "loader", 'R', 50 * k, 0, 50));
    dir_.file("proc/102/stat", stat_line(102, 1, "other", 'S', 999 * k, 0, 10));
    dir_.file("proc/100/io", io_text(4096 * k, 8192 * k));
    dir_.file("proc/101/io", io_text(1000 * k, 0));
    dir_.file("proc/102/io", io_text(123456 * k, 0));
    dir_.file("proc/net/dev",
              "Inter-|   Receive                                                |  Transmit\n"
              " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n" +
                  fmt::format("    lo: {} 1 0 0 0 0 0 0 {} 1 0 0 0 0 0 0\n", 777 * k, 777 * k) +
                  fmt::format("  eth0: {} 10 0 0 0 0 0 0 {} 20 0 0 0 0 0 0\n", 1000000 + 2000 * k, 500 + 300 * k));
    const std::string ib = "sys/class/infiniband/mlx5_0/ports/1/counters/";
    dir_.file(ib + "port_rcv_data", std::to_string(100 + 250 * k));  // 4-byte words: 1000 bytes per step
    dir_.file(ib + "port_xmit_data", std::to_string(50 * k));
    dir_.file(ib + "port_rcv_packets", "0");
    dir_.file(ib + "port_xmit_packets", "0");
    dir_.file(ib + "symbol_error", std::to_string(k / 2));
    dir_.file(ib + "link_downed", "0");
    dir_.file(ib + "port_rcv_errors", "0");
    dir_.file("proc/diskstats",
              fmt::format("   7       0 loop0 5 0 10 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n"
                          " 259       0 nvme0n1 {} 0 {} 10 {} 0 {} 20 0 {} 30 0 0 0 0 0 0\n",
                          10 + k, 8 * k, 5 + k, 16 * k, 250 * k));
  }

  void add_process(int pid, int ppid, const std::string& comm) {
    dir_.file(fmt::format("proc/{}/stat", pid), stat_line(pid, ppid, comm, 'S', 1, 1, 10));
    dir_.file(fmt::format("proc/{}/io", pid), io_text(0, 0));
  }
  void reparent(int pid, int ppid) { dir_.file(fmt::format("proc/{}/stat", pid), stat_line(pid, ppid, "moved", 'S', 1, 1, 10)); }
  void remove_process(int pid) { std::filesystem::remove_all(fmt::format("{}/proc/{}", dir_.path(), pid)); }

 private:
  static std::string stat_line(int pid, int ppid, const std::string& comm, char state, int utime, int stime, int rss) {
    return fmt::format("{} ({}) {} {} {} {} 0 -1 4194560 100 0 0 0 {} {} 0 0 20 0 3 0 12345 1000000 {} 18446744073709551615\n",
                       pid, comm, state, ppid, pid, pid, utime, stime, rss);
  }
  static std::string io_text(long read_bytes, long write_bytes) {
    return fmt::format("rchar: {}\nwchar: {}\nsyscr: 1\nsyscw: 1\nread_bytes: {}\nwrite_bytes: {}\ncancelled_write_bytes: 0\n",
                       read_bytes * 2, write_bytes * 2, read_bytes, write_bytes);
  }
  TempDir dir_;
};

}  // namespace pacer::test
