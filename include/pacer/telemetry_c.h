/* Training metrics from C (and anything with a C FFI): per-step records written to the job catalog without blocking. */
#ifndef PACER_TELEMETRY_C_H
#define PACER_TELEMETRY_C_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A field set to NaN is "not given". Durations are seconds; t is Unix time
 * (0: now). rank < 0: the recorder's rank (SLURM_PROCID, RANK, ...). */
typedef struct pacer_step {
  int64_t step;
  double t;
  int rank;
  double step_time_s;
  double loss;
  double tokens;
  double data_wait_s;
  double comm_s;
  double flops; /* model FLOPs of this rank's step (the report's MFU); appended last so older fields keep their offsets */
} pacer_step;

/* A pacer_step with every optional field NaN and rank -1. */
pacer_step pacer_step_init(int64_t step);

/* Opens the process-wide recorder on `db` (NULL: PACER_TELEMETRY_DB, else the
 * default catalog name). Returns 0, or -1 with pacer_telemetry_error() set.
 * Opening again closes the previous recorder first. */
int pacer_telemetry_open(const char* db);
/* Queues one step; never blocks on I/O. Returns 0, or -1 when dropped (queue
 * full, or no recorder open). */
int pacer_telemetry_step(const pacer_step* step);
/* Waits until queued records are written. Returns 0 or -1. */
int pacer_telemetry_flush(void);
/* Flushes and closes. Safe to call when nothing is open. */
void pacer_telemetry_close(void);
/* Records dropped so far by the open recorder (0 when none is open). */
uint64_t pacer_telemetry_dropped(void);
/* The last error message of this API (empty when none); valid until the next call. */
const char* pacer_telemetry_error(void);

#ifdef __cplusplus
}
#endif

#endif /* PACER_TELEMETRY_C_H */
