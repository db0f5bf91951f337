// A stand-in for libnvidia-ml.so.1 (built under that name, found through
// LD_LIBRARY_PATH by the sampler's dlopen) with two Hopper GPUs. It counts
// every call by entry point so tests can check the sampling schedule, and
// returns NaN for one GPM metric, as NVML does over a too-short window.
// $PACER_FAKE_NVML_INIT (an NVML return code: 9 is "driver not loaded") makes
// nvmlInit fail; $PACER_FAKE_NVML_GPUS (0-2) shows fewer GPUs.
// GPU errors (vet's gpu.errors probe): each GPU has $PACER_FAKE_NVML_NVLINKS
// NVLinks (default 18), all up and error-free unless $PACER_FAKE_NVML_LINK_DOWN
// names a link of gpu0 that is down, $PACER_FAKE_NVML_NVLINK_CRC gives gpu0's
// link 1 that many CRC errors, or $PACER_FAKE_NVML_NVLINK_RISE makes gpu0's
// link 0 replay counter rise by that much at every read. $PACER_FAKE_NVML_XID
// delivers one Xid event of that number on gpu0. Page retirement is "not
// supported" (as on Hopper) unless $PACER_FAKE_NVML_RETIRED gives gpu0 that
// many double-bit retired pages ($PACER_FAKE_NVML_RETIRE_PENDING=1: pending).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

namespace {
std::mutex g_mu;
std::map<std::string, unsigned long> g_calls;
void count(const char* name) {
  std::lock_guard lk(g_mu);
  ++g_calls[name];
}
constexpr unsigned kGpus = 2;
int g_devices[kGpus];
int g_samples = 0;
constexpr int kSuccess = 0, kInvalidArgument = 2, kNotSupported = 3;

struct Memory2 {
  unsigned version;
  unsigned long long total, reserved, free, used;
};
struct Utilization {
  unsigned gpu, memory;
};
struct ProcessInfo {
  unsigned pid;
  unsigned long long used_gpu_memory;
  unsigned gpu_instance_id, compute_instance_id;
};
struct GpmSample {
  void* handle;
};
struct GpmMetric {
  unsigned metric_id;
  int nvml_return;
  double value;
  struct {
    char *short_name, *long_name, *unit;
  } info;
};
struct GpmMetricsGet {
  unsigned version, num_metrics;
  GpmSample sample1, sample2;
  GpmMetric metrics[16];  // the first num_metrics are read
};
struct GpmSupport {
  unsigned version, is_supported_device;
};
int device_index(void* dev) {
  for (unsigned i = 0; i < kGpus; ++i)
    if (dev == &g_devices[i]) return static_cast<int>(i);
  return -1;
}
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}
}  // namespace

#define FAKE(name) count(#name)
#define CHECK_DEV(d) \
  if (device_index(d) < 0) return kInvalidArgument

extern "C" {
unsigned long fake_nvml_calls(const char* name) {
  std::lock_guard lk(g_mu);
  auto it = g_calls.find(name);
  return it == g_calls.end() ? 0 : it->second;
}
void fake_nvml_reset() {
  std::lock_guard lk(g_mu);
  g_calls.clear();
}
int nvmlInit_v2() { return FAKE(nvmlInit_v2), env_int("PACER_FAKE_NVML_INIT", kSuccess); }
int nvmlShutdown() { return FAKE(nvmlShutdown), kSuccess; }
const char* nvmlErrorString(int) { return "fake error"; }
int nvmlDeviceGetCount_v2(unsigned* n) {
  FAKE(nvmlDeviceGetCount_v2);
  const int visible = env_int("PACER_FAKE_NVML_GPUS", static_cast<int>(kGpus));
  *n = visible >= 0 && visible < static_cast<int>(kGpus) ? static_cast<unsigned>(visible) : kGpus;
  return kSuccess;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void** dev) {
  FAKE(nvmlDeviceGetHandleByIndex_v2);
  if (i >= kGpus) return kInvalidArgument;
  *dev = &g_devices[i];
  return kSuccess;
}
int nvmlDeviceGetName(void* d, char* buf, unsigned n) {
  FAKE(nvmlDeviceGetName);
  CHECK_DEV(d);
  std::snprintf(buf, n, "NVIDIA H200");
  return kSuccess;
}
int nvmlDeviceGetUUID(void* d, char* buf, unsigned n) {
  FAKE(nvmlDeviceGetUUID);
  CHECK_DEV(d);
  std::snprintf(buf, n, "GPU-fake-%d", device_index(d));
  return kSuccess;
}
int nvmlDeviceGetMemoryInfo_v2(void* d, Memory2* m) {
  FAKE(nvmlDeviceGetMemoryInfo_v2);
  CHECK_DEV(d);
  m->total = 141ull << 30;
  m->reserved = 0;
  m->used = 1ull << 30;
  m->free = m->total - m->used;
  return kSuccess;
}
// One process holds each GPU.
int nvmlDeviceGetComputeRunningProcesses_v2(void* d, unsigned* n, ProcessInfo* p) {
  FAKE(nvmlDeviceGetComputeRunningProcesses_v2);
  CHECK_DEV(d);
  if (!p || *n < 1) {
    *n = 1;
    return 7;  // insufficient size
  }
  *n = 1;
  p[0] = ProcessInfo{4242, 1ull << 30, 0, 0};
  return kSuccess;
}
int nvmlDeviceGetTotalEccErrors(void* d, int, int, unsigned long long* n) {
  FAKE(nvmlDeviceGetTotalEccErrors);
  CHECK_DEV(d);
  *n = 0;
  return kSuccess;
}
int nvmlDeviceGetRemappedRows(void* d, unsigned* c, unsigned* u, unsigned* p, unsigned* f) {
  FAKE(nvmlDeviceGetRemappedRows);
  CHECK_DEV(d);
  *c = *u = *p = *f = 0;
  return kSuccess;
}
#define GETTER(name, T, v)      \
  int name(void* d, T* out) { \
    FAKE(name);               \
    CHECK_DEV(d);             \
    *out = v;                 \
    return kSuccess;          \
  }
constexpr Utilization kUtilization{50, 20};
GETTER(nvmlDeviceGetCurrentClocksEventReasons, unsigned long long, 0)
GETTER(nvmlDeviceGetUtilizationRates, Utilization, kUtilization)
GETTER(nvmlDeviceGetCurrPcieLinkGeneration, unsigned, 5)
GETTER(nvmlDeviceGetMaxPcieLinkGeneration, unsigned, 5)
GETTER(nvmlDeviceGetCurrPcieLinkWidth, unsigned, 16)
GETTER(nvmlDeviceGetMaxPcieLinkWidth, unsigned, 16)
GETTER(nvmlDeviceGetPowerUsage, unsigned, 350000)
// Temperature and clocks take a sensor or clock type first.
#define TYPED_UINT_GETTER(name, v)          \
  int name(void* d, int, unsigned* out) { \
    FAKE(name);                             \
    CHECK_DEV(d);                           \
    *out = v;                               \
    return kSuccess;                        \
  }
TYPED_UINT_GETTER(nvmlDeviceGetTemperature, 40)
TYPED_UINT_GETTER(nvmlDeviceGetClockInfo, 1980)
TYPED_UINT_GETTER(nvmlDeviceGetMaxClockInfo, 1980)
int nvmlDeviceGetTotalEnergyConsumption(void* d, unsigned long long* mj) {
  FAKE(nvmlDeviceGetTotalEnergyConsumption);
  CHECK_DEV(d);
  static unsigned long long e = 0;
  *mj = (e += 1000);
  return kSuccess;
}
int nvmlGpmQueryDeviceSupport(void* d, GpmSupport* s) {
  FAKE(nvmlGpmQueryDeviceSupport);
  CHECK_DEV(d);
  s->is_supported_device = 1;
  return kSuccess;
}
int nvmlGpmSampleAlloc(GpmSample* s) {
  FAKE(nvmlGpmSampleAlloc);
  s->handle = new int(0);
  return kSuccess;
}
int nvmlGpmSampleFree(GpmSample s) {
  FAKE(nvmlGpmSampleFree);
  delete static_cast<int*>(s.handle);
  return kSuccess;
}
int nvmlGpmSampleGet(void* d, GpmSample s) {
  FAKE(nvmlGpmSampleGet);
  CHECK_DEV(d);
  *static_cast<int*>(s.handle) = ++g_samples;
  return kSuccess;
}
// Utilizations 25%; the NVLink rates (ids 60, 61) NaN, as on a GPU whose
// window was too short; PCIe (20, 21) not supported.
int nvmlGpmMetricsGet(GpmMetricsGet* g) {
  FAKE(nvmlGpmMetricsGet);
  for (unsigned i = 0; i < g->num_metrics; ++i) {
    GpmMetric& m = g->metrics[i];
    m.nvml_return = kSuccess;
    if (m.metric_id == 60 || m.metric_id == 61) m.value = std::nan("");
    else if (m.metric_id == 20 || m.metric_id == 21) m.nvml_return = kNotSupported;
    else m.value = 25.0;
  }
  return kSuccess;
}
int nvmlSystemGetDriverVersion(char* buf, unsigned n) {
  std::snprintf(buf, n, "580.00-fake");
  return kSuccess;
}
struct PciInfo {
  char bus_id_legacy[16];
  unsigned domain, bus, device, pci_device_id, pci_subsystem_id;
  char bus_id[32];
};
constexpr unsigned kPciBus[kGpus] = {0x3b, 0x86};
int nvmlDeviceGetPciInfo_v3(void* d, PciInfo* p) {
  FAKE(nvmlDeviceGetPciInfo_v3);
  CHECK_DEV(d);
  *p = PciInfo{};
  p->bus = kPciBus[device_index(d)];
  std::snprintf(p->bus_id, sizeof(p->bus_id), "00000000:%02X:00.0", p->bus);
  return kSuccess;
}
int nvmlDeviceGetNvLinkState(void* d, unsigned link, int* active) {
  FAKE(nvmlDeviceGetNvLinkState);
  CHECK_DEV(d);
  if (link >= static_cast<unsigned>(env_int("PACER_FAKE_NVML_NVLINKS", 18))) return kNotSupported;
  *active = !(device_index(d) == 0 && static_cast<int>(link) == env_int("PACER_FAKE_NVML_LINK_DOWN", -1));
  return kSuccess;
}
int nvmlDeviceGetNvLinkErrorCounter(void* d, unsigned link, int counter, unsigned long long* v) {
  FAKE(nvmlDeviceGetNvLinkErrorCounter);
  CHECK_DEV(d);
  if (link >= static_cast<unsigned>(env_int("PACER_FAKE_NVML_NVLINKS", 18))) return kNotSupported;
  *v = 0;
  if (device_index(d) != 0) return kSuccess;
  static unsigned long long replays = 0;
  if (link == 0 && counter == 0) *v = (replays += static_cast<unsigned long long>(env_int("PACER_FAKE_NVML_NVLINK_RISE", 0)));
  if (link == 1 && counter == 2) *v = static_cast<unsigned long long>(env_int("PACER_FAKE_NVML_NVLINK_CRC", 0));
  return kSuccess;
}
int nvmlDeviceGetRetiredPages(void* d, int cause, unsigned* n, unsigned long long*) {
  FAKE(nvmlDeviceGetRetiredPages);
  CHECK_DEV(d);
  const int retired = env_int("PACER_FAKE_NVML_RETIRED", -1);
  if (retired < 0) return kNotSupported;
  *n = device_index(d) == 0 && cause == 1 ? static_cast<unsigned>(retired) : 0;
  return kSuccess;
}
int nvmlDeviceGetRetiredPagesPendingStatus(void* d, int* pending) {
  FAKE(nvmlDeviceGetRetiredPagesPendingStatus);
  CHECK_DEV(d);
  *pending = device_index(d) == 0 && env_int("PACER_FAKE_NVML_RETIRE_PENDING", 0);
  return kSuccess;
}
struct EventData {
  void* device;
  unsigned long long event_type, event_data;
  unsigned gpu_instance_id, compute_instance_id;
};
int g_event_set;
bool g_xid_delivered = false;
int nvmlEventSetCreate(void** set) {
  FAKE(nvmlEventSetCreate);
  *set = &g_event_set;
  return kSuccess;
}
int nvmlDeviceRegisterEvents(void* d, unsigned long long, void*) {
  FAKE(nvmlDeviceRegisterEvents);
  CHECK_DEV(d);
  return kSuccess;
}
int nvmlEventSetWait_v2(void*, EventData* e, unsigned) {
  FAKE(nvmlEventSetWait_v2);
  const int xid = env_int("PACER_FAKE_NVML_XID", 0);
  if (xid <= 0 || g_xid_delivered) return 10;  // timeout, at once: the tests do not wait
  g_xid_delivered = true;
  *e = EventData{&g_devices[0], 0x8, static_cast<unsigned long long>(xid), 0, 0};
  return kSuccess;
}
int nvmlEventSetFree(void*) { return FAKE(nvmlEventSetFree), kSuccess; }
}
