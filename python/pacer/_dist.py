"""Where this process stands in its job: rank and world size, as the launcher or torch.distributed says.

The one place pacer resolves them, so that the data loader, the checkpointer
and anything later agree on what "rank" means for a process.
"""
import os
import sys

from ._pacer import Error

# Launchers and the variables they set, in the order they are trusted: torchrun
# (and torch.distributed's env:// init), Slurm's srun, Open MPI's mpirun, then
# MPICH/Intel MPI (PMI).
_ENVIRONMENTS = (
    ("RANK", "WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
)


def _torch_dist():
    """torch.distributed when its process group is initialised, else None."""
    # A process that has not imported torch has no process group; importing
    # torch only to learn that would cost every Loader a second or more.
    if "torch" not in sys.modules:
        return None
    try:
        import torch.distributed as dist
    except Exception:  # a torch built without distributed
        return None
    try:
        return dist if dist.is_available() and dist.is_initialized() else None
    except Exception:
        return None


def environment_rank(environ=None):
    """(rank, world_size, "RANK/WORLD_SIZE") from the first launcher whose both variables are set; None when none is."""
    environ = os.environ if environ is None else environ
    for rank_var, size_var in _ENVIRONMENTS:
        r, w = environ.get(rank_var, ""), environ.get(size_var, "")
        if r.strip() and w.strip():
            try:
                return int(r), int(w), f"{rank_var}/{size_var}"
            except ValueError:
                raise Error(f"{rank_var}={r!r}, {size_var}={w!r}: not integers") from None
    return None


def _half_set(environ=None):
    """The first launcher variable set without its partner ("RANK=1 without WORLD_SIZE"), or None."""
    environ = os.environ if environ is None else environ
    for rank_var, size_var in _ENVIRONMENTS:
        r, w = environ.get(rank_var, "").strip(), environ.get(size_var, "").strip()
        if bool(r) != bool(w):
            return f"{rank_var}={r!r} without {size_var}" if r else f"{size_var}={w!r} without {rank_var}"
    return None


def resolve_rank(rank=None, world_size=None, what="pacer"):
    """(rank, world_size): explicit values win; the rest from torch.distributed when it is initialised,
    else from the launcher's environment, else 0 and 1.

    An explicit value that contradicts an initialised torch.distributed is an
    error naming both: a loader told rank 0 on rank 3 would read rank 0's data.
    So is one explicit value that contradicts the launcher's environment the
    other is taken from (world_size=4 with RANK=1 WORLD_SIZE=2 would leave two
    quarters of every batch unread), and taking a value from an environment
    that sets a rank without a world size (or the reverse).
    """
    dist = _torch_dist()
    if dist is not None:
        source, r, w = "torch.distributed", dist.get_rank(), dist.get_world_size()
    else:
        env = environment_rank()
        if env is not None:
            r, w, source = env
        else:
            r, w, source = 0, 1, None
            half = _half_set()
            if half is not None and (rank is None or world_size is None):
                raise Error(f"{what}: {half}: set both, or pass rank and world_size")
    if dist is not None:
        if rank is not None and int(rank) != r:
            raise Error(f"{what}: rank={rank} but torch.distributed says this is rank {r} of {w}")
        if world_size is not None and int(world_size) != w:
            raise Error(f"{what}: world_size={world_size} but torch.distributed's world has {w} ranks")
    elif source is not None and (rank is None) != (world_size is None):
        if rank is not None and int(rank) != r:
            raise Error(f"{what}: rank={rank} but {source} says this is rank {r} of {w} (pass world_size too, or neither)")
        if world_size is not None and int(world_size) != w:
            raise Error(f"{what}: world_size={world_size} but {source} says the world has {w} ranks (pass rank too, or neither)")
    rank = r if rank is None else int(rank)
    world_size = w if world_size is None else int(world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        origin = f" (from {source})" if source else ""
        raise Error(f"{what}: rank {rank} is outside a world of {world_size}{origin}")
    return rank, world_size
