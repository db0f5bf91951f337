"""pacer.telemetry: training metrics into the job catalog, without blocking the loop.

::

    import pacer.telemetry as tm
    for step, batch in enumerate(loader):
        ...
        tm.step(step=step, loss=loss.item(), tokens=n_tokens, data_wait_s=t_data, comm_s=t_comm)
    tm.close()                                   # also done at exit

Records go to ``$PACER_TELEMETRY_DB`` (set by ``pacer monitor`` for the
command it runs, so steps land in the same run as the system samples), else
to the job's default catalog (``pacer-$SLURM_JOB_ID.db``). The rank comes from
SLURM_PROCID, RANK, OMPI_COMM_WORLD_RANK or PMI_RANK and the node is this
host. ``step()`` only appends to a bounded queue that a background thread
writes out; when the queue is full the record is dropped and counted
(``dropped()``), never waited for. ``flops`` is the model FLOPs this rank's
step computed (forward and backward, e.g. 6 x parameters x tokens for a dense
transformer): with it ``pacer report`` charts MFU. Any further keyword
(``lr=3e-4``) is kept as JSON in the step's ``extra`` column.
"""
import atexit
import json
import os
import threading

from . import _pacer
from . import run as _run

__all__ = ["open", "step", "event", "flush", "close", "written", "dropped", "Error"]

Error = _pacer.Error
_lock = threading.Lock()
_recorder = None


def open(db=None, rank=None, queue_capacity=65536, flush_interval_s=0.5):  # noqa: A001 (module-level API)
    """Opens (or reopens) the process-wide recorder; step() does this on first use with the defaults."""
    global _recorder
    with _lock:
        if _recorder is not None:
            _recorder.close()
        _recorder = _pacer._Recorder(None if db is None else str(db), rank, int(queue_capacity), float(flush_interval_s))
        _record_data_version(_recorder)
        return _recorder


def _record_data_version(recorder):
    """The run's data-set version (PACER_DATA_VERSION, docs/curate.md) as a "data.version" event."""
    version = os.environ.get("PACER_DATA_VERSION")
    if version:
        recorder.event("data.version", version)


def _get():
    r = _recorder
    if r is None:
        with _lock:
            if _recorder is None:
                globals()["_recorder"] = _pacer._Recorder(None, None, 65536, 0.5)
                _record_data_version(_recorder)
            r = _recorder
    return r


def _number(name, value):
    if value is None:
        return None
    if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        raise Error(f"telemetry.step: {name}={value!r} is not a number") from None


def step(step, loss=None, tokens=None, data_wait_s=None, comm_s=None, step_time_s=None, t=None, flops=None, **extra):
    """Queues one step record; returns False when it was dropped (queue full). Also a pacer.run heartbeat."""
    n = int(step)
    _run.heartbeat(n if n >= 0 else None)
    extra_json = json.dumps(extra, default=str) if extra else ""
    return _get().step(int(step), _number("loss", loss), _number("tokens", tokens), _number("data_wait_s", data_wait_s),
                       _number("comm_s", comm_s), _number("step_time_s", step_time_s), _number("t", t), extra_json,
                       _number("flops", flops))


def event(kind, detail=""):
    """Queues an event (kind like "checkpoint.saved"; detail text or JSON)."""
    if not isinstance(detail, str):
        detail = json.dumps(detail, default=str)
    return _get().event(str(kind), detail)


def flush():
    """Blocks until everything queued so far is written; raises the first write error."""
    if _recorder is not None:
        _recorder.flush()


def close():
    global _recorder
    with _lock:
        if _recorder is not None:
            _recorder.close()
            _recorder = None


def written():
    return 0 if _recorder is None else _recorder.written


def dropped():
    return 0 if _recorder is None else _recorder.dropped


atexit.register(close)
