"""The training side of `pacer run`'s checkpoint request contract.

`pacer run` starts the training command with::

    PACER_CKPT_REQUEST_FILE  created when a checkpoint is wanted (always set; in a private directory)
    PACER_CKPT_SIGNAL        also sent to the command's process group (USR1, USR2 or TERM; unset: none)
    PACER_CKPT_DIR           the checkpoint root it watches for a newer committed step
    PACER_RUN_ATTEMPT        0 for the first start in this allocation, 1 after the first restart, ...

A training loop asks :func:`checkpoint_requested` once per step; when it says
yes, it saves with ``pacer.Checkpointer`` under :func:`ckpt_dir` and waits for
the save; the supervisor sees the committed step and stops the command::

    import pacer, pacer.run
    pacer.run.watch()                      # early: installs the handler for PACER_CKPT_SIGNAL
    ck = pacer.Checkpointer(pacer.run.ckpt_dir("/scratch/run42/ckpt"))
    saved = False                          # a save answered the pending request
    for step in range(start, steps):
        train_step()
        requested = pacer.run.checkpoint_requested()
        if step % 1000 == 0 or (requested and not saved):
            ck.save(step, state()).wait()
            saved = requested              # the request stays pending until the stop: save once

With several ranks, decide on rank 0 and broadcast the answer (every rank must
call ``save`` for the same step).

Progress: ``pacer.run.heartbeat(step)`` once per step (``pacer.telemetry.step()``
calls it too) lets ``pacer run --hang-timeout`` notice a rank that stopped
making progress; see docs/run.md, "Hangs".
"""
import faulthandler
import os
import signal
import stat
import threading

from ._pacer import PortLease, _run_heartbeat

REQUEST_FILE_ENV = "PACER_CKPT_REQUEST_FILE"
REQUEST_SIGNAL_ENV = "PACER_CKPT_SIGNAL"
CKPT_DIR_ENV = "PACER_CKPT_DIR"
ATTEMPT_ENV = "PACER_RUN_ATTEMPT"
HEARTBEAT_FILE_ENV = "PACER_HEARTBEAT_FILE"
STACKS_DIR_ENV = "PACER_STACKS_DIR"
STACKS_SIGNAL_ENV = "PACER_STACKS_SIGNAL"

__all__ = ["watch", "checkpoint_requested", "heartbeat", "ckpt_dir", "attempt", "supervised", "ports", "PortLease"]

_stacks_pending = True
_stacks_file = None  # kept open: faulthandler writes to its descriptor from the signal handler
_beat = None  # the C++ heartbeat once a supervisor's heartbeat file is known; None: nothing to do


def _install_stacks():
    """On $PACER_STACKS_SIGNAL, every thread's stack goes to $PACER_STACKS_DIR/stacks-PID.txt."""
    global _stacks_pending, _stacks_file, _beat
    _stacks_pending = False
    if os.environ.get(HEARTBEAT_FILE_ENV):
        _beat = _run_heartbeat
    folder = os.environ.get(STACKS_DIR_ENV)
    name = os.environ.get(STACKS_SIGNAL_ENV)
    if not folder or not name:
        return
    sig = getattr(signal, "SIG" + name.upper().removeprefix("SIG"), None)
    if sig is None:
        raise ValueError(f"${STACKS_SIGNAL_ENV}={name!r} is not a signal name")
    path = os.path.join(folder, f"stacks-{os.getpid()}.txt")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    _stacks_file = os.fdopen(os.open(path, flags, 0o600), "w")
    faulthandler.register(sig, file=_stacks_file, all_threads=True, chain=False)
    # A forked child (a data loader worker) would inherit the handler and
    # write its stacks into this rank's file, interleaved with them.
    os.register_at_fork(after_in_child=lambda: faulthandler.unregister(sig))


def heartbeat(step=None):
    """Tells ``pacer run`` that this rank made progress (call once per training step).

    Two stores into a shared page (the step, then a counter); nothing but the
    call when not under ``pacer run`` or with ``--hang-timeout 0``. The first call also
    installs the stack dump the supervisor asks for on a hang. Raises
    pacer.Error when the heartbeat file is unusable or the local rank is bad.
    """
    if _stacks_pending:
        _install_stacks()
    if _beat is not None:
        _beat(step)

_signalled = threading.Event()
_watching = False


def _on_signal(signum, frame):
    _signalled.set()


def watch():
    """Installs a handler for the request signal named in $PACER_CKPT_SIGNAL.

    Without it, that signal's default action would end the process. Call it
    early, from the main thread; later calls do nothing. Returns the signal
    watched, or None.
    """
    global _watching
    if _stacks_pending:
        _install_stacks()
    name = os.environ.get(REQUEST_SIGNAL_ENV)
    if not name:
        return None
    sig = getattr(signal, "SIG" + name.upper().removeprefix("SIG"))
    if not _watching and threading.current_thread() is threading.main_thread():
        signal.signal(sig, _on_signal)
        _watching = True
    return sig


def checkpoint_requested():
    """True once the supervisor asked for a checkpoint (its signal came or its request file exists).

    The request file counts only as a regular file (not a symlink) owned by
    this user, as ``pacer run`` creates it: a file another user planted does
    not. Cheap (one lstat); False when not running under ``pacer run``.
    """
    watch()
    if _signalled.is_set():
        return True
    path = os.environ.get(REQUEST_FILE_ENV)
    if not path:
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def ckpt_dir(default=None):
    """The checkpoint root the supervisor watches ($PACER_CKPT_DIR), else `default`."""
    return os.environ.get(CKPT_DIR_ENV, default)


def attempt():
    """0 for the first start in this allocation, n after the n-th restart."""
    return int(os.environ.get(ATTEMPT_ENV, "0"))


def supervised():
    """True when running under ``pacer run``."""
    return REQUEST_FILE_ENV in os.environ


def ports(count=1, job=None, local_rank=None, **plan):
    """A PortLease of `count` ports from this job's local rank's range (see `pacer ports`).

    The ports stay bound by this process until handed over: ``lease.release(port)``
    right before the service binds it, or ``lease.take_fd(port)`` to give the
    service the bound socket itself. `job` and `local_rank` default to
    $SLURM_JOB_ID and $SLURM_LOCALID (or LOCAL_RANK, ...); `plan` takes
    first, last, per_rank, ranks_per_job. Raises pacer.Error when the range is
    exhausted.
    """
    return PortLease.acquire(count, job, local_rank, **plan)
