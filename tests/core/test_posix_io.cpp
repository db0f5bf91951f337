#include "pacer/core/posix_io.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <filesystem>
#include <regex>
#include <string>
#include <thread>

#include "pacer/core/atomic_file.hpp"
#include "pacer/core/process.hpp"
#include "pacer/core/time.hpp"
#include "test_util.hpp"

namespace pacer {
namespace {

namespace fs = std::filesystem;
using test::contains;

TEST(PosixIo, WholeWritesAndReadsRoundTripAndShortFilesAreErrorsNamingThePath) {
  test::TempDir dir("pacer_posix_io_");
  const std::string p = (fs::path(dir.path()) / "f.bin").string();
  std::string data(3 * 65536 + 17, '\0');
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 131 + 7);
  {
    auto fd = open_fd(p, O_WRONLY | O_CREAT | O_TRUNC);
    ASSERT_TRUE(fd) << fd.error().message;
    ASSERT_TRUE(write_full(fd->get(), data.data(), 1000, p));
    ASSERT_TRUE(pwrite_full(fd->get(), data.data() + 1000, data.size() - 1000, 1000, p));
    ASSERT_TRUE(fsync_fd(fd->get(), p));
    ASSERT_TRUE(fd->close(p));
    EXPECT_FALSE(*fd);
  }
  auto fd = open_fd(p, O_RDONLY);
  ASSERT_TRUE(fd);
  std::string back(data.size(), '\0');
  ASSERT_TRUE(pread_exact(fd->get(), back.data(), back.size(), 0, p));
  EXPECT_EQ(back, data);
  // Past the end: pread_full says how much there was, pread_exact names where it ended.
  auto got = pread_full(fd->get(), back.data(), 100, data.size() - 40, p);
  ASSERT_TRUE(got);
  EXPECT_EQ(*got, 40u);
  Status st = pread_exact(fd->get(), back.data(), 100, data.size() - 40, p);
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.error().message, p)) << st.error().message;
  EXPECT_TRUE(contains(st.error().message, "end of file at offset " + std::to_string(data.size()))) << st.error().message;
  auto seq = read_full(fd->get(), back.data(), back.size() + 10, p);
  ASSERT_TRUE(seq);
  EXPECT_EQ(*seq, data.size());

  auto missing = open_fd(p + ".none", O_RDONLY);
  ASSERT_FALSE(missing);
  EXPECT_TRUE(contains(missing.error().message, p + ".none: cannot open")) << missing.error().message;
  EXPECT_TRUE(fsync_dir(dir.path()));
  EXPECT_FALSE(fsync_dir(dir.path() + "/none"));
}

TEST(PosixIo, APathWithANulByteIsAUsageErrorAndTouchesNothing) {
  // The kernel reads a path up to its first NUL: "f.bin\0.pidx" would open f.bin.
  test::TempDir dir("pacer_posix_io_");
  const std::string p = (fs::path(dir.path()) / "f.bin").string();
  ASSERT_TRUE(write_file_atomic(p, "kept"));
  const std::string nul = p + std::string(1, '\0') + ".pidx";
  auto fd = open_fd(nul, O_RDONLY);
  ASSERT_FALSE(fd);
  EXPECT_EQ(fd.error().kind, ErrorKind::kUsage);
  EXPECT_TRUE(contains(fd.error().message, "f.bin\\0.pidx")) << fd.error().message;
  EXPECT_TRUE(contains(fd.error().message, "NUL byte")) << fd.error().message;
  Status w = write_file_atomic(nul, "replaced");
  ASSERT_FALSE(w);
  EXPECT_EQ(w.error().kind, ErrorKind::kUsage);
  EXPECT_EQ(read_file(p).value(), "kept");
  EXPECT_TRUE(check_path(p));
}

TEST(PosixIo, AFullDeviceIsAnErrorNotALoop) {
  auto fd = open_fd("/dev/full", O_WRONLY);
  if (!fd) GTEST_SKIP() << "no /dev/full";
  const std::string data(4096, 'x');
  Status st = write_full(fd->get(), data.data(), data.size(), "/dev/full");
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.error().message, "/dev/full: write failed")) << st.error().message;
}

TEST(PosixIo, ReservedSpaceIsAllocatedWithoutGrowingTheFileAndTooMuchIsAnError) {
  test::TempDir dir("pacer_posix_io_");
  const std::string p = (fs::path(dir.path()) / "r.bin").string();
  auto fd = open_fd(p, O_WRONLY | O_CREAT | O_TRUNC);
  ASSERT_TRUE(fd) << fd.error().message;
  ASSERT_TRUE(reserve_space(fd->get(), 0, 8 << 20, p));
  struct stat st {};
  ASSERT_EQ(::fstat(fd->get(), &st), 0);
  EXPECT_EQ(st.st_size, 0);  // the size is what the writes make it
  if (st.st_blocks == 0) GTEST_SKIP() << dir.path() << "'s filesystem does not preallocate";
  EXPECT_GE(static_cast<std::uint64_t>(st.st_blocks) * 512, 8u << 20);
  // Past the largest file offset: EFBIG, named with the path, never a wrapped range.
  Status big = reserve_space(fd->get(), std::numeric_limits<std::uint64_t>::max() - 100, 4096, p);
  ASSERT_FALSE(big);
  EXPECT_TRUE(contains(big.error().message, p)) << big.error().message;
  EXPECT_TRUE(contains(big.error().message, "cannot reserve 4096 bytes")) << big.error().message;
  EXPECT_TRUE(reserve_space(fd->get(), 0, 0, p));  // nothing to reserve
}

TEST(PosixIo, FdClosesOnDestructionAndMovesOwnership) {
  int raw = -1;
  {
    auto fd = open_fd("/dev/null", O_RDONLY);
    ASSERT_TRUE(fd);
    raw = fd->get();
    Fd moved = std::move(*fd);
    EXPECT_FALSE(*fd);
    EXPECT_EQ(moved.get(), raw);
    EXPECT_EQ(::fcntl(raw, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  }
  EXPECT_EQ(::fcntl(raw, F_GETFD), -1);  // closed
}

TEST(Process, SpawnPassesEnvironmentAndOutputAndReportsExitCodes) {
  int out[2];
  ASSERT_EQ(::pipe(out), 0);
  Fd r(out[0]), w(out[1]);
  SpawnOptions so;
  so.env = {{"PACER_TEST_VALUE", "forty two"}};
  so.stdout_fd = w.get();
  so.new_process_group = true;
  auto pid = spawn_process({"sh", "-c", "echo \"$PACER_TEST_VALUE\"; exit 3"}, so);
  ASSERT_TRUE(pid) << pid.error().message;
  EXPECT_EQ(::getpgid(*pid), *pid);
  w.reset();
  char buf[64] = {};
  auto n = read_full(r.get(), buf, sizeof buf - 1, "pipe");
  ASSERT_TRUE(n);
  EXPECT_EQ(std::string(buf, *n), "forty two\n");
  int st = 0;
  ASSERT_EQ(wait_process(*pid, &st), *pid);
  EXPECT_EQ(exit_code_of(st), 3);

  auto killed = spawn_process({"sh", "-c", "kill -TERM $$"});
  ASSERT_TRUE(killed);
  ASSERT_EQ(wait_process(*killed, &st), *killed);
  EXPECT_EQ(exit_code_of(st), 128 + SIGTERM);
}

TEST(Process, AnExecFailureComesBackNamingTheCommand) {
  int e = 0;
  auto pid = spawn_process({"/no/such/program-pacer", "x"}, {}, &e);
  ASSERT_FALSE(pid);
  EXPECT_EQ(e, ENOENT);
  EXPECT_TRUE(contains(pid.error().message, "/no/such/program-pacer: cannot run: not found")) << pid.error().message;
  EXPECT_FALSE(spawn_process({}));
}

TEST(Process, TheChildsSignalMaskIsTheGivenOneNotTheParents) {
  sigset_t block, old;
  sigemptyset(&block);
  sigaddset(&block, SIGUSR1);
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &block, &old), 0);
  // With SIGUSR1 blocked in the child it would survive the kill and exit 0.
  auto pid = spawn_process({"sh", "-c", "kill -USR1 $$; exit 0"});
  ASSERT_TRUE(pid);
  int st = 0;
  ASSERT_EQ(wait_process(*pid, &st), *pid);
  EXPECT_EQ(exit_code_of(st), 128 + SIGUSR1);
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

TEST(Time, UtcIsoFormats) {
  // 2026-12-01T10:24:27.999Z
  const double t = 1796120667.9996;
  EXPECT_EQ(utc_iso(t), "2026-12-01T10:24:27Z");
  EXPECT_EQ(utc_iso(t, true), "2026-12-01T10:24:27.999Z");
  EXPECT_EQ(utc_compact(t), "20261201T102427Z");
  EXPECT_EQ(utc_iso(0), "1970-01-01T00:00:00Z");
  EXPECT_TRUE(std::regex_match(utc_iso_now(true), std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)")));
  EXPECT_LT(std::fabs(wall_now() - static_cast<double>(::time(nullptr))), 2.0);
}

}  // namespace
}  // namespace pacer
