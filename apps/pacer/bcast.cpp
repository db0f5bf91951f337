// `pacer bcast`: under mpirun or srun, read SRC once and write it to DST on every node.
#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <vector>

#include "commands.hpp"
#include "output.hpp"
#include "pacer/comm/bcast.hpp"
#include "pacer/core/table.hpp"
#include "pacer/core/units.hpp"

namespace pacer::cli {
namespace {

namespace fs = std::filesystem;

struct BcastArgs {
  std::string src;
  std::string dst;
  std::string chunk = "16MiB";
  bool compare = false;
  bool json = false;
};

// Every byte of SRC (a file or a directory's files), as each rank would read
// it without pacer: what --compare times.
std::uint64_t read_all(const std::string& src) {
  std::vector<fs::path> files;
  std::error_code ec;
  if (fs::is_directory(src, ec)) {
    for (auto& e : fs::recursive_directory_iterator(src, ec))
      if (e.is_regular_file()) files.push_back(e.path());
  } else {
    files.emplace_back(src);
  }
  std::vector<char> buf(16 << 20);
  std::uint64_t total = 0;
  for (const auto& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    for (ssize_t n; (n = read(fd, buf.data(), buf.size())) > 0;) total += static_cast<std::uint64_t>(n);
    close(fd);
  }
  return total;
}

int bcast(const BcastArgs& a) {
  auto chunk = parse_size(a.chunk);
  if (!chunk) usage_error(fmt::format("--chunk {}: {}", a.chunk, chunk.error().message));
  auto world = comm::mpi_world();
  if (!world) world = comm::single_rank();  // no MPI: one rank copies, same checks
  auto& w = **world;
  comm::BcastOptions o;
  o.chunk_bytes = *chunk;
  const auto st = unwrap(comm::broadcast_path(w, a.src, a.dst, o));
  std::optional<comm::ReadComparison> compare;
  if (a.compare) {
    w.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    const std::uint64_t mine = read_all(a.src);
    w.barrier();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    compare = comm::ReadComparison{mine * static_cast<std::uint64_t>(w.size()), s};
  }
  if (w.rank() != 0) return 0;
  const comm::BcastReport report{a.src, a.dst, w.size(), o.chunk_bytes, st, compare};
  Table t({{"METHOD"}, {"READ FROM SRC", true}, {"TIME", true}, {"RATE", true}});
  t.add_row({"pacer bcast", format_bytes(double(st.bytes_read)), format_duration(st.seconds),
             format_bytes(st.seconds > 0 ? double(st.bytes) / st.seconds : 0) + "/s"});
  if (compare) {
    const double s = compare->seconds;
    t.add_row({"every rank reads", format_bytes(double(compare->bytes_read)), format_duration(s),
               format_bytes(s > 0 ? double(st.bytes) / s : 0) + "/s"});
  }
  const std::string text = t.render() + fmt::format("OK: {} ({} file(s), {}) to {} on {} node(s), {} rank(s), xxh3 {:016x}{}\n",
                                                    a.src, st.files, format_bytes(double(st.bytes)), a.dst, st.nodes,
                                                    w.size(), st.xxh3,
                                                    st.unchanged ? "; unchanged: every node held the same bytes already" : "");
  print(comm::to_json(report), a.json, text);
  return 0;
}

}  // namespace

Handler register_bcast(CLI::App& app) {
  auto args = std::make_shared<BcastArgs>();
  auto* cmd = app.add_subcommand("bcast", "Read a file or directory once and write it to every node (under mpirun or srun)");
  cmd->add_option("src", args->src, "File or directory (on rank 0)")->required();
  cmd->add_option("dst", args->dst, "Where each node gets its copy (node-local storage)")->required();
  cmd->add_option("--chunk", args->chunk, "Chunk size (pipelining and checksums)")->capture_default_str();
  cmd->add_flag("--compare", args->compare, "Also time every rank reading SRC itself");
  cmd->add_flag("--json", args->json, "JSON report (pacer.bcast/1)");
  return [args] { return bcast(*args); };
}

}  // namespace pacer::cli
