// `pacer run --monitor`: how CMD is wrapped in `pacer monitor` (shared by `pacer run` and `pacer run-agent`).
#include "run_monitor.hpp"

#include <unistd.h>

namespace pacer::cli {

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string("pacer");
}

std::vector<std::string> monitored(const std::string& db, std::int64_t run_id, const std::string& interval,
                                   const std::vector<std::string>& argv) {
  std::vector<std::string> v = {self_exe(), "monitor", "--db", db, "--run-id", std::to_string(run_id), "--interval",
                                interval, "--"};
  v.insert(v.end(), argv.begin(), argv.end());
  return v;
}

std::string node_catalog(const std::string& db, const std::string& node) {
  const bool ext = db.size() > 3 && db.compare(db.size() - 3, 3, ".db") == 0;
  return (ext ? db.substr(0, db.size() - 3) : db) + "-" + node + ".db";
}

}  // namespace pacer::cli
