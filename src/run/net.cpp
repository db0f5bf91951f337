// The leader-agent connection of `pacer run --nodes`: JSON lines over TCP, every operation bounded in time.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <cmath>

#include "pacer/core/posix_io.hpp"
#include "run_internal.hpp"

namespace pacer::run {
namespace {

using nlohmann::json;

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

// A peer that vanished without a FIN (a node powered off) is noticed by
// keepalive probes within about a minute instead of the kernel's two hours.
void keep_alive(int fd) {
  const int on = 1, idle = 20, interval = 5, count = 6;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
}

int poll_ms(double seconds) { return seconds <= 0 ? 0 : static_cast<int>(std::ceil(std::min(seconds, 3600.0) * 1000)); }

std::string peer_name(const sockaddr* sa) {
  char host[NI_MAXHOST] = "?", serv[NI_MAXSERV] = "?";
  ::getnameinfo(sa, sa->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in), host, sizeof host, serv,
                sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV);
  return fmt::format("{}:{}", host, serv);
}

}  // namespace

Expected<std::pair<std::string, int>> parse_host_port(const std::string& text) {
  const auto colon = text.rfind(':');
  auto bad = [&] { return Error{ErrorKind::kUsage, fmt::format("'{}': expected HOST:PORT", text)}; };
  if (colon == std::string::npos || colon == 0 || colon + 1 >= text.size()) return bad();
  std::string host = text.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int port = 0;
  for (char c : text.substr(colon + 1)) {
    if (c < '0' || c > '9' || port > 65535) return bad();
    port = port * 10 + (c - '0');
  }
  if (port < 1 || port > 65535) return bad();
  return std::make_pair(host, port);
}

Conn::Conn(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {
  set_nonblocking(fd_);
  keep_alive(fd_);
}
Conn::Conn(Conn&& o) noexcept
    : fd_(std::exchange(o.fd_, -1)), peer_(std::move(o.peer_)), buf_(std::move(o.buf_)),
      pending_(std::move(o.pending_)), eof_(o.eof_) {}
Conn& Conn::operator=(Conn&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = std::exchange(o.fd_, -1);
    peer_ = std::move(o.peer_);
    buf_ = std::move(o.buf_);
    pending_ = std::move(o.pending_);
    eof_ = o.eof_;
  }
  return *this;
}
Conn::~Conn() { close(); }
void Conn::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  eof_ = true;
}

Expected<Conn> Conn::connect(const std::string& host, int port, double timeout_s) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string where = fmt::format("{}:{}", host, port);
  if (int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res); rc != 0)
    return Error{ErrorKind::kIo, fmt::format("leader {}: {}", where, ::gai_strerror(rc))};
  std::string why = "no address";
  const double deadline = mono_now() + timeout_s;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) continue;
    int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      rc = retry_eintr([&] { return ::poll(&p, 1, poll_ms(deadline - mono_now())); });
      int err = 0;
      socklen_t len = sizeof err;
      if (rc == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0) rc = 0;
      else {
        errno = rc == 0 ? ETIMEDOUT : err;
        rc = -1;
      }
    }
    if (rc == 0) {
      ::freeaddrinfo(res);
      return Conn(fd, where);
    }
    why = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return Error{ErrorKind::kIo, fmt::format("leader {}: {}", where, why)};
}

Status Conn::send(const json& j, double timeout_s) {
  if (fd_ < 0) return Error{ErrorKind::kIo, fmt::format("{}: connection closed", peer_)};
  const std::string line = j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  const double deadline = mono_now() + timeout_s;
  for (std::size_t done = 0; done < line.size();) {
    const ssize_t n = ::send(fd_, line.data() + done, line.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return Error{ErrorKind::kIo, fmt::format("{}: send: {}", peer_, std::strerror(errno))};
    const double left = deadline - mono_now();
    if (left <= 0) return Error{ErrorKind::kIo, fmt::format("{}: send: no progress for {} s", peer_, timeout_s)};
    pollfd p{fd_, POLLOUT, 0};
    retry_eintr([&] { return ::poll(&p, 1, poll_ms(left)); });
  }
  return {};
}

Expected<std::vector<json>> Conn::receive() {
  std::vector<json> out = std::move(pending_);
  pending_.clear();
  char chunk[65536];
  while (fd_ >= 0 && !eof_) {
    const ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
    if (n == 0) {
      eof_ = true;
      break;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      eof_ = true;  // a reset connection is a closed one
      break;
    }
    buf_.append(chunk, static_cast<std::size_t>(n));
    for (std::size_t nl; (nl = buf_.find('\n')) != std::string::npos;) {
      json j = json::parse(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(nl), nullptr, false);
      buf_.erase(0, nl + 1);
      if (!j.is_object())
        return Error{ErrorKind::kConfig, fmt::format("{}: a line that is not a JSON object", peer_)};
      out.push_back(std::move(j));
    }
    if (buf_.size() > kMaxLine)
      return Error{ErrorKind::kConfig, fmt::format("{}: a line longer than {} bytes", peer_, kMaxLine)};
  }
  return out;
}

Expected<std::optional<json>> Conn::receive_one(double timeout_s) {
  const double deadline = mono_now() + timeout_s;
  for (;;) {
    auto got = receive();
    if (!got) return got.error();
    if (!got->empty()) {
      json first = std::move(got->front());
      pending_.insert(pending_.end(), std::make_move_iterator(got->begin() + 1), std::make_move_iterator(got->end()));
      return std::optional<json>(std::move(first));
    }
    const double left = deadline - mono_now();
    if (eof_ || left <= 0) return std::optional<json>();
    pollfd p{fd_, POLLIN, 0};
    retry_eintr([&] { return ::poll(&p, 1, poll_ms(left)); });
  }
}

Expected<Listener> Listener::open() {
  Listener l;
  // IPv6 with v4-mapped addresses where the kernel has IPv6; IPv4 otherwise.
  l.fd_ = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (l.fd_ >= 0) {
    const int off = 0;
    ::setsockopt(l.fd_, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    if (::bind(l.fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(l.fd_);
      l.fd_ = -1;
    }
  }
  if (l.fd_ < 0) {
    l.fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (l.fd_ < 0) return Error{ErrorKind::kIo, fmt::format("leader socket: {}", std::strerror(errno))};
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    if (::bind(l.fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
      return Error{ErrorKind::kIo, fmt::format("leader bind: {}", std::strerror(errno))};
  }
  if (::listen(l.fd_, 256) != 0) return Error{ErrorKind::kIo, fmt::format("leader listen: {}", std::strerror(errno))};
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  ::getsockname(l.fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  l.port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return l;
}

Listener::Listener(Listener&& o) noexcept : fd_(std::exchange(o.fd_, -1)), port_(o.port_) {}
Listener::~Listener() {
  if (fd_ >= 0) ::close(fd_);
}

std::optional<Conn> Listener::accept() {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  const int fd = ::accept4(fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) return std::nullopt;
  return Conn(fd, peer_name(reinterpret_cast<sockaddr*>(&ss)));
}

}  // namespace pacer::run
