// hw's run-time libraries: the symbol binder every dlopen'ed library (NCCL, cuBLASLt) is read through.
#include "pacer/hw/libraries.hpp"
#include "vet/probes.hpp"

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace pacer::hw {
namespace {

TEST(HwSymbolBinder, BindsPresentSymbolsAndNamesTheFirstMissingOne) {
  void* libc = ::dlopen("libc.so.6", RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(libc, nullptr);
  std::size_t (*len)(const char*) = nullptr;
  int (*missing)() = nullptr;
  int (*also_missing)() = nullptr;
  SymbolBinder bind(libc, "libc");
  bind(len, "strlen");
  ASSERT_NE(len, nullptr);
  EXPECT_EQ(len("pacer"), 5u);
  EXPECT_TRUE(bind.ok());
  EXPECT_EQ(bind.error(), "");
  bind(missing, "pacer_no_such_function");
  bind(also_missing, "pacer_nor_this_one");
  EXPECT_EQ(missing, nullptr);
  EXPECT_FALSE(bind.ok());
  EXPECT_EQ(bind.error(), "libc lacks pacer_no_such_function (too old?)");
  ::dlclose(libc);
}

TEST(HwSymbolBinder, NoLibraryBindsNothing) {
  int (*fn)() = reinterpret_cast<int (*)()>(1);
  SymbolBinder bind(nullptr, "NCCL");
  bind(fn, "ncclGetVersion");
  EXPECT_EQ(fn, nullptr);
  EXPECT_EQ(bind.error(), "NCCL lacks ncclGetVersion (too old?)");
}

TEST(HwNcclLibrary, LoadedOnceAndEitherAHandleOrAReason) {
  const NcclLibrary& a = nccl_library();
  EXPECT_EQ(&a, &nccl_library());  // every user shares the one load
  EXPECT_NE(a.handle == nullptr, a.error.empty());
  if (!a.handle) {
    EXPECT_NE(a.error.find("PACER_NCCL_LIBRARY"), std::string::npos) << a.error;
  }
}

TEST(HwNcclNetPlugin, NamesTheNewestInterfaceAndTheFile) {
  ::setenv("NCCL_NET_PLUGIN", PACER_FAKE_NCCL_NET, 1);
  const std::string found = nccl_net_plugin();
  ::setenv("NCCL_NET_PLUGIN", "none", 1);
  const std::string none = nccl_net_plugin();
  ::setenv("NCCL_NET_PLUGIN", "/nonexistent/libnccl-net-pacer.so", 1);
  const std::string missing = nccl_net_plugin();
  ::unsetenv("NCCL_NET_PLUGIN");
  EXPECT_EQ(found.rfind("PacerFake v8 (", 0), 0u) << found;
  EXPECT_NE(found.find("fake_nccl_net"), std::string::npos) << found;
  EXPECT_EQ(none, "");
  EXPECT_EQ(missing, "");
}

TEST(HwLibfabric, VersionWhereTheLibraryLoads) {
  // In a child, as vet's software probe does: libfabric, once loaded, installs
  // signal handlers that would outlive this test in the test process.
  const auto f = pacer::vet::run_forked(
      [] { return std::string(::dlopen("libfabric.so.1", RTLD_LAZY | RTLD_LOCAL) ? "1" : "0") + libfabric_version(); }, 60);
  ASSERT_TRUE(f.error.empty()) << f.error;
  ASSERT_FALSE(f.data.empty());
  const std::string v = f.data.substr(1);
  if (f.data[0] == '0') {
    EXPECT_EQ(v, "");
    GTEST_SKIP() << "libfabric.so.1 is not installed";
  }
  // "MAJOR.MINOR (FILE)"
  ASSERT_FALSE(v.empty());
  EXPECT_TRUE(v[0] >= '1' && v[0] <= '9') << v;
  EXPECT_LT(v.find('.'), v.find(" ("));
  EXPECT_NE(v.find("libfabric"), std::string::npos) << v;
}

}  // namespace
}  // namespace pacer::hw
