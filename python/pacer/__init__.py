"""pacer: keep large training runs on shared clusters fast and alive.

Checkpointing::

    ck = pacer.Checkpointer(root, fast_tier=None, keep_last=3, keep_every=0)
    h = ck.save(step, {"weight": tensor_or_array}, meta={"lr": 0.1})  # returns once staged
    h.wait()                                   # durable and committed
    ck.latest()                                # newest valid step or None
    step, blobs, meta = ck.load(step=None)     # blobs: numpy arrays (torch tensors for bfloat16)
"""
import concurrent.futures
import json
import os
import warnings

from ._pacer import Error, Reader, SaveHandle, __version__, optimal_interval
from ._pacer import _Checkpointer
from . import data  # pacer.data: shards and the loader
from . import telemetry  # pacer.telemetry: training metrics into the job catalog
from . import run  # pacer.run: the checkpoint request contract of `pacer run`

__all__ = ["Checkpointer", "Error", "Reader", "SaveHandle", "optimal_interval", "__version__"]


def _as_blob(name, value):
    """(name, buffer, dtype, shape) without copying contiguous CPU data."""
    import numpy as np

    if type(value).__module__.startswith("torch"):
        import torch

        t = value.detach()
        if t.device.type != "cpu":
            raise Error(f"blob '{name}': tensor is on {t.device}; move it to the CPU first")
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            arr = t.view(torch.int16).numpy()
            return (name, arr.reshape(-1).view(np.uint8), "bfloat16", list(t.shape))
        arr = t.numpy()
    elif isinstance(value, (bytes, bytearray, memoryview)):
        return (name, memoryview(value).cast("B"), "bytes", [len(memoryview(value).cast("B"))])
    else:
        arr = np.asarray(value)
    if arr.dtype.kind not in "biufc":
        raise Error(f"blob '{name}': dtype {arr.dtype} cannot be saved (numbers and bools only; use bytes for the rest)")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))  # stored little-endian, as the manifest's dtype says
    if not arr.flags["C_CONTIGUOUS"]:
        arr = np.ascontiguousarray(arr)
    dtype = "bool" if arr.dtype == np.bool_ else arr.dtype.name
    return (name, arr.reshape(-1).view(np.uint8), dtype, list(arr.shape))


def _empty(dtype, shape):
    """An uninitialised array on page-aligned memory."""
    import numpy as np

    from ._pacer import HostBuffer

    if dtype == "bfloat16":
        import torch

        n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        return torch.frombuffer(HostBuffer(max(2 * n, 1)), dtype=torch.uint8)[: 2 * n].view(torch.bfloat16).reshape(shape)
    np_dtype = np.dtype(np.uint8 if dtype == "bytes" else dtype)
    n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    buf = HostBuffer(max(n * np_dtype.itemsize, 1))
    return np.frombuffer(buf, dtype=np.uint8)[: n * np_dtype.itemsize].view(np_dtype).reshape(shape)


def _buffer_of(obj):
    if type(obj).__module__.startswith("torch"):
        import torch

        return obj.view(torch.int16).numpy().reshape(-1).view("uint8")
    return obj.reshape(-1).view("uint8")


class Checkpointer:
    """Asynchronous, checksummed, crash-consistent checkpoints under `root`.

    `fast_tier` (node-local disk or /dev/shm) takes each save first and is
    copied to `root` in the background. Retention keeps the newest
    `keep_last` checkpoints and every step that is a multiple of `keep_every`.
    Saving copies the data into a bounded staging area (`staging_bytes`) and
    returns; the arrays may be modified right after `save` returns.
    """

    def __init__(self, root, fast_tier=None, keep_last=3, keep_every=0, staging_bytes=1 << 30, chunk_bytes=64 << 20):
        self._impl = _Checkpointer(str(root), None if fast_tier is None else str(fast_tier), keep_last, keep_every,
                                   staging_bytes, chunk_bytes)

    def save(self, step, blobs, meta=None):
        items = [_as_blob(name, value) for name, value in blobs.items()]
        try:
            meta_json = json.dumps(meta or {}, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise Error(f"meta cannot be stored as JSON: {e}") from None
        return self._impl.save(step, items, meta_json)

    def latest(self):
        return self._impl.latest()

    def open(self, step=None):
        """A Reader for `step` (default: the latest valid one)."""
        return self._impl.open_reader(step)

    def load(self, step=None):
        """(step, {name: array}, meta) of `step` or of the latest valid checkpoint.

        Every byte is checked against its checksum as it is read, once; a copy
        that fails is skipped with a warning and the next candidate (the other
        tier's copy, then the next older step) is read instead.
        """
        problems = []
        for reader in self._impl.candidates(step):
            try:
                specs = reader.blobs()
                outs = {name: _empty(dtype, shape) for name, dtype, shape, _size in specs}
                # Blobs are read (and checked) in parallel: the GIL is released
                # while each reads, so faults, reads and checksums overlap.
                with concurrent.futures.ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
                    for f in [pool.submit(reader.read_into, name, _buffer_of(out)) for name, out in outs.items()]:
                        f.result()
                return reader.step, outs, json.loads(reader.meta_json)
            except Error as e:
                warnings.warn(f"pacer: skipping step {reader.step} in {reader.dir}: {e}")
                problems.append(str(e))
        where = f"step {step}" if step is not None else "any step"
        raise Error(f"no valid checkpoint for {where}" + (": " + "; ".join(problems) if problems else ""))

    def flush(self):
        """Wait for every save and tier copy; raise the first error."""
        self._impl.flush()
