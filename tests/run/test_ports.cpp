// Ports: ranges, binding proof, exhaustion, and collisions of random picks against the allocator.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "pacer/run/ports.hpp"
#include "test_util.hpp"

namespace pacer::run {
namespace {

PortScope scope_of(std::uint64_t job, int local_rank = 0) {
  PortScope s;
  s.job = job;
  s.local_rank = local_rank;
  return s;
}

// A fake root/proc/sys/net/ipv4 with the kernel's ephemeral range and reserved ports.
class FakeProc {
 public:
  explicit FakeProc(const std::string& range = "32768\t60999\n", const std::string* reserved = nullptr)
      : dir_("fake-proc-") {
    dir_.file("proc/sys/net/ipv4/ip_local_port_range", range);
    if (reserved) dir_.file("proc/sys/net/ipv4/ip_local_reserved_ports", *reserved);
  }
  const std::string& root() const { return dir_.path(); }

 private:
  test::TempDir dir_;
};

// Linux's default ephemeral range, whatever the machine running the tests has.
const FakeProc& default_proc() {
  static const FakeProc proc;
  return proc;
}

PortPlan plan_of(int first, int last, int per_rank, int ranks_per_job, const std::string& root = default_proc().root()) {
  PortPlan p;
  p.first = first;
  p.last = last;
  p.per_rank = per_rank;
  p.ranks_per_job = ranks_per_job;
  p.root = root;
  return p;
}

TEST(Ports, RangesAreDeterministicAndDisjoint) {
  PortPlan plan;
  plan.root = default_proc().root();
  std::set<int> starts;
  for (int rank = 0; rank < plan.ranks_per_job; ++rank) {
    auto r = port_range(plan, scope_of(1234, rank));
    ASSERT_TRUE(r);
    EXPECT_EQ(r->second - r->first + 1, plan.per_rank);
    EXPECT_EQ(*r, *port_range(plan, scope_of(1234, rank)));
    starts.insert(r->first);
  }
  EXPECT_EQ(starts.size(), static_cast<std::size_t>(plan.ranks_per_job));
  // Jobs next to each other get the next block.
  EXPECT_EQ(port_range(plan, scope_of(1235))->first - port_range(plan, scope_of(1234))->first,
            plan.per_rank * plan.ranks_per_job);
  EXPECT_FALSE(port_range(plan, scope_of(1, plan.ranks_per_job)));
  EXPECT_FALSE(port_range(plan_of(100, 90, 16, 8), scope_of(0)));
}

TEST(Ports, KernelPortFilesAreParsed) {
  EXPECT_EQ(*parse_port_range("32768\t60999\n", "f"), (std::pair<int, int>{32768, 60999}));
  EXPECT_EQ(*parse_port_range(" 1024 65535", "f"), (std::pair<int, int>{1024, 65535}));
  for (const char* bad : {"", "32768", "32768 60999 7", "60999 32768", "0 100", "1 65536", "1 99999999999999999999", "a b"}) {
    auto r = parse_port_range(bad, "/x/ip_local_port_range");
    ASSERT_FALSE(r) << bad;
    EXPECT_EQ(r.error().kind, ErrorKind::kConfig);
    EXPECT_TRUE(test::contains(r.error().message, "/x/ip_local_port_range")) << bad;
  }
  EXPECT_TRUE(parse_reserved_ports("\n", "f")->empty());
  EXPECT_EQ(*parse_reserved_ports("8080,40000-40127\n", "f"),
            (std::vector<std::pair<int, int>>{{8080, 8080}, {40000, 40127}}));
  for (const char* bad : {"8080,", ",1", "9-1", "1-", "70000", "1;2", "1-2-3"}) {
    auto r = parse_reserved_ports(bad, "/x/ip_local_reserved_ports");
    ASSERT_FALSE(r) << bad;
    EXPECT_TRUE(test::contains(r.error().message, "/x/ip_local_reserved_ports")) << bad;
  }
  // No /proc/sys (a container, another OS): Linux's default, and a note saying so.
  test::TempDir empty("no-proc-");
  auto l = read_local_ports(empty.path());
  ASSERT_TRUE(l) << l.error().message;
  EXPECT_EQ(l->ephemeral_first, 32768);
  EXPECT_EQ(l->ephemeral_last, 60999);
  EXPECT_TRUE(test::contains(l->source, "default"));
  const std::string reserved = "1,2,x";
  FakeProc broken("32768 60999\n", &reserved);
  EXPECT_FALSE(read_local_ports(broken.root()));
}

// The kernel hands out ports of its ephemeral range to every connect(): a
// port given to a rank there could be taken before the rank binds it.
TEST(Ports, RangesStayOutsideTheEphemeralRangeExceptReservedPorts) {
  const std::string reserved = "45000-45127,50000\n";
  FakeProc proc("30000 59999\n", &reserved);
  const auto local = read_local_ports(proc.root()).value();
  EXPECT_EQ(local.source, proc.root() + "/proc/sys/net/ipv4/ip_local_port_range");
  const PortPlan plan = plan_of(20000, 65535, 16, 8, proc.root());
  // 20000-29999: 78 blocks of 128; 45000-45127: 1; 60000-65535: 43.
  std::set<int> starts;
  for (std::uint64_t job = 0; job < 200; ++job)
    for (int rank = 0; rank < plan.ranks_per_job; ++rank) {
      auto r = port_range(plan, scope_of(job, rank));
      ASSERT_TRUE(r) << r.error().message;
      for (int p = r->first; p <= r->second; ++p) ASSERT_TRUE(local.usable(p)) << "job " << job << ": port " << p;
      if (rank == 0) starts.insert(r->first);
    }
  EXPECT_EQ(starts.size(), 78u + 1u + 43u);
  EXPECT_EQ(starts.count(45000), 1u);
  EXPECT_EQ(port_range(plan, scope_of(78))->first, 45000);
  EXPECT_EQ(port_range(plan, scope_of(79))->first, 60000);
  EXPECT_EQ(*port_range(plan, scope_of(122)), *port_range(plan, scope_of(0)));
  // The default plan on Linux's default range: nothing handed out lies in 32768-60999.
  PortPlan def;
  def.root = default_proc().root();
  for (std::uint64_t job = 0; job < 300; ++job) {
    auto r = port_range(def, scope_of(job, 7));
    ASSERT_TRUE(r);
    EXPECT_TRUE(r->second < 32768 || r->first > 60999) << r->first << "-" << r->second;
  }
  // A plan inside the ephemeral range has no room: a usage error that says why.
  auto none = port_range(plan_of(40000, 41999, 16, 8, proc.root()), scope_of(1));
  ASSERT_FALSE(none);
  EXPECT_EQ(none.error().kind, ErrorKind::kUsage);
  EXPECT_TRUE(test::contains(none.error().message, "ephemeral range 30000-59999"));
  EXPECT_TRUE(test::contains(none.error().message, "ip_local_reserved_ports"));
}

TEST(Ports, HeldPortsAreSkippedAndReleasedOnDestruction) {
  PortScope scope = scope_of(4711, 3);
  PortPlan plan = plan_of(20000, 59999, 4, 8);
  std::vector<int> first;
  {
    auto a = PortLease::acquire(2, scope, plan);
    ASSERT_TRUE(a) << a.error().message;
    first = a->ports();
    // Held: a second lease of the same scope gets the other two, then none is left.
    auto b = PortLease::acquire(2, scope, plan);
    ASSERT_TRUE(b) << b.error().message;
    for (int p : b->ports()) EXPECT_TRUE(std::find(first.begin(), first.end(), p) == first.end());
    auto c = PortLease::acquire(1, scope, plan);
    ASSERT_FALSE(c);
    EXPECT_NE(c.error().message.find("exhausted"), std::string::npos) << c.error().message;
    EXPECT_EQ(c.error().kind, ErrorKind::kIo);
    // Handing over: the service can bind it now.
    a->release(first[0]);
    const int fd = bind_port(first[0]);
    EXPECT_GE(fd, 0);
    if (fd >= 0) close(fd);
    const int taken = a->take_fd(first[1]);
    EXPECT_GE(taken, 0);
    EXPECT_EQ(bind_port(first[1]), -EADDRINUSE);
    close(taken);
  }
  auto again = PortLease::acquire(2, scope, plan);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->ports(), first);
}

// Starts `services` services at once (threads released by one barrier), each
// binding and listening on the port `pick` gives it; returns how many found
// their port taken.
int start_services(int services, const std::function<int(int)>& pick) {
  std::barrier go(services);
  std::atomic<int> collisions{0};
  std::vector<int> fds(static_cast<std::size_t>(services), -1);
  std::vector<std::thread> threads;
  for (int i = 0; i < services; ++i)
    threads.emplace_back([&, i] {
      const int port = pick(i);
      go.arrive_and_wait();
      const int fd = bind_port(port);
      if (fd == -EADDRINUSE) ++collisions;
      if (fd >= 0) {
        listen(fd, 1);
        fds[static_cast<std::size_t>(i)] = fd;
      }
    });
  for (auto& t : threads) t.join();
  for (int fd : fds)
    if (fd >= 0) close(fd);
  return collisions;
}

// The collision measurement of the issue: S services on one node pick a port
// at random from R, against the allocator. Random picks collide about as the
// birthday bound says; the allocator never does.
TEST(Ports, RandomPicksCollideTheAllocatorDoesNot) {
  constexpr int kServices = 64;
  constexpr int kRange = 2000;
  constexpr int kTrials = 40;
  constexpr int kFirst = 21000;  // below the ephemeral range
  std::mt19937 rng(7);
  int trials_with_collision = 0;
  int random_collisions = 0;
  for (int t = 0; t < kTrials; ++t) {
    std::vector<int> picks(kServices);
    for (auto& p : picks) p = kFirst + static_cast<int>(rng() % kRange);
    const int c = start_services(kServices, [&](int i) { return picks[static_cast<std::size_t>(i)]; });
    random_collisions += c;
    if (c > 0) ++trials_with_collision;
  }
  double none = 1;
  for (int i = 0; i < kServices; ++i) none *= 1.0 - static_cast<double>(i) / kRange;
  int allocator_collisions = 0;
  PortPlan plan = plan_of(kFirst, kFirst + kRange - 1, 16, kServices);
  for (int t = 0; t < kTrials; ++t) {
    // Each service is one local rank of the job; it holds its lease until it
    // is started, then hands the port over.
    std::vector<PortLease> leases;
    for (int i = 0; i < kServices; ++i) {
      auto l = PortLease::acquire(1, scope_of(static_cast<std::uint64_t>(t), i), plan);
      ASSERT_TRUE(l) << l.error().message;
      leases.push_back(std::move(*l));
    }
    allocator_collisions += start_services(kServices, [&](int i) {
      auto& l = leases[static_cast<std::size_t>(i)];
      const int port = l.ports()[0];
      l.release(port);
      return port;
    });
  }
  std::printf("ports: %d services at once in %d ports, %d trials: random picks collided in %d trials (%.0f%%; "
              "birthday bound %.0f%%), %d services failed; allocator: %d collisions\n",
              kServices, kRange, kTrials, trials_with_collision, 100.0 * trials_with_collision / kTrials,
              100.0 * (1 - none), random_collisions, allocator_collisions);
  EXPECT_GT(trials_with_collision, 0);
  EXPECT_EQ(allocator_collisions, 0);
}

}  // namespace
}  // namespace pacer::run
