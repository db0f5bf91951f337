// A stand-in NCCL network plugin: just the exported struct whose first member
// is the plugin's name, which is all hw::nccl_net_plugin reads.
extern "C" {
struct FakeNcclNet {
  const char* name;
  void* rest[16];
};
__attribute__((visibility("default"))) FakeNcclNet ncclNetPlugin_v8 = {"PacerFake", {}};
__attribute__((visibility("default"))) FakeNcclNet ncclNetPlugin_v7 = {"PacerFakeOld", {}};
}
