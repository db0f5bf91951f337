"""pacer: keep large training runs on shared clusters fast and alive.

Checkpointing (see pacer.checkpoint and docs/checkpoint.md)::

    ck = pacer.Checkpointer(root, fast_tier=None, keep_last=3, keep_every=0, group=None)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
             "loader": loader.state_dict(), "rng": pacer.rng_state()}
    h = ck.save(step, state, meta={"loss": 2.5})  # returns once staged (CUDA tensors copied)
    h.wait()                                      # durable and committed (on every rank)
    ck.latest()                                   # newest valid step or None
    step, state, meta = ck.load()                 # the same structure, tensors on the CPU
    ck.load(into=state)                           # or: filled in place, then each part's load_state_dict
"""
from ._pacer import Error, Reader, SaveHandle, __version__, optimal_interval
from . import checkpoint  # pacer.checkpoint: states as trees of blobs
from .checkpoint import (Checkpointer, Loaded, PerRank, Shard, TorchCommunicator, export_safetensors, prune, rng_state,
                         set_rng_state)
from . import data  # pacer.data: shards and the loader
from . import telemetry  # pacer.telemetry: training metrics into the job catalog
from . import run  # pacer.run: the checkpoint request contract of `pacer run`

__all__ = ["Checkpointer", "Error", "Loaded", "PerRank", "Reader", "SaveHandle", "Shard", "TorchCommunicator", "export_safetensors",
           "optimal_interval", "prune", "rng_state", "set_rng_state", "__version__"]
