// The leader-agent connection of `pacer run --nodes`: addresses, JSON lines, bounded waits, bad input.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <string>

#include "run/run_internal.hpp"

namespace pacer::run {
namespace {

TEST(RunNet, HostPortParsing) {
  auto hp = parse_host_port("node1:4242");
  ASSERT_TRUE(hp);
  EXPECT_EQ(hp->first, "node1");
  EXPECT_EQ(hp->second, 4242);
  auto v6 = parse_host_port("[::1]:80");
  ASSERT_TRUE(v6);
  EXPECT_EQ(v6->first, "::1");
  for (const char* bad : {"node1", ":80", "node1:", "node1:0", "node1:65536", "node1:8x", "node1:99999999999999"})
    EXPECT_FALSE(parse_host_port(bad)) << bad;
}

// A connected pair through a real listener, as leader and agent have.
struct Pair {
  Listener l = std::move(*Listener::open());
  Conn a = std::move(*Conn::connect("127.0.0.1", l.port(), 5));
  Conn b = accept_one();
  Conn accept_one() {
    for (int i = 0; i < 500; ++i) {
      if (auto c = l.accept()) return std::move(*c);
      ::usleep(10000);
    }
    throw std::runtime_error("no connection");
  }
};

TEST(RunNet, LinesArriveWholeAndInOrder) {
  Pair p;
  ASSERT_TRUE(p.a.send({{"type", "hello"}, {"n", 1}}));
  ASSERT_TRUE(p.a.send({{"type", "progress"}, {"n", 2}}));
  auto first = p.b.receive_one(5);
  ASSERT_TRUE(first && *first);
  EXPECT_EQ((**first)["n"], 1);
  auto second = p.b.receive_one(5);
  ASSERT_TRUE(second && *second);
  EXPECT_EQ((**second)["n"], 2);
  // Nothing more: the wait ends at its limit with nothing, the peer still there.
  const double t0 = mono_now();
  auto none = p.b.receive_one(0.2);
  ASSERT_TRUE(none);
  EXPECT_FALSE(*none);
  EXPECT_GE(mono_now() - t0, 0.15);
  EXPECT_FALSE(p.b.eof());
  p.a.close();
  auto closed = p.b.receive_one(5);
  ASSERT_TRUE(closed);
  EXPECT_FALSE(*closed);
  EXPECT_TRUE(p.b.eof());
}

TEST(RunNet, BadLinesAreErrorsNotCrashes) {
  for (const std::string junk : {std::string("not json\n"), std::string("[1, 2]\n"), std::string("\"text\"\n")}) {
    Pair p;
    ASSERT_EQ(::send(p.a.fd(), junk.data(), junk.size(), 0), static_cast<ssize_t>(junk.size()));
    auto got = p.b.receive_one(5);
    ASSERT_FALSE(got) << junk;
    EXPECT_NE(got.error().message.find("not a JSON object"), std::string::npos);
  }
  // A line without end is refused once it passes kMaxLine, not buffered forever.
  Pair p;
  const std::string chunk(1 << 20, 'x');
  bool refused = false;
  for (std::size_t sent = 0; sent <= kMaxLine + chunk.size() && !refused;) {
    const ssize_t n = ::send(p.a.fd(), chunk.data(), chunk.size(), MSG_DONTWAIT);
    if (n > 0) sent += static_cast<std::size_t>(n);
    auto got = p.b.receive();
    if (!got) {
      refused = true;
      EXPECT_NE(got.error().message.find("longer than"), std::string::npos);
    }
  }
  EXPECT_TRUE(refused);
}

TEST(RunNet, ConnectFailsWithinItsLimit) {
  int port = 0;
  {
    auto l = Listener::open();
    ASSERT_TRUE(l);
    port = l->port();
  }  // closed: nobody listens there now
  auto c = Conn::connect("127.0.0.1", port, 2);
  ASSERT_FALSE(c);
  EXPECT_NE(c.error().message.find("leader 127.0.0.1:"), std::string::npos);
  EXPECT_FALSE(Conn::connect("no-such-host.invalid", 80, 2));
}

}  // namespace
}  // namespace pacer::run
