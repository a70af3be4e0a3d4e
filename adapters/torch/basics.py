"""Process-level API of ``dp_plugin.torch``: init, ranks, build flags, timeline.

Names, signatures and return types follow ``horovod.torch`` 0.28.1. The
answers are about *our* engines: ``gloo_built()`` says whether torch can run
Gloo, ``mpi_enabled()`` whether the running engine is MPI, and so on.

Every function that needs ``init()`` first raises ``NotInitializedError``
before it: a ``DPPluginError`` and, like Horovod's error, a ``ValueError``.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from dp_plugin import capabilities as _capabilities
from dp_plugin import process_sets as _process_sets
from dp_plugin import runtime
from dp_plugin.edge import caller, public
from dp_plugin.engines.base import Engine
from dp_plugin.errors import NotInitializedError as _CoreNotInitializedError
from dp_plugin.launch import detect
from dp_plugin.timeline import NullTimeline, Timeline, open_timeline
from dp_plugin.torch import handles as _handles


class NotInitializedError(_CoreNotInitializedError, ValueError):
    """``dp_plugin.torch`` was used before ``init()`` (or after ``shutdown()``).

    Also a ``ValueError``, the type Horovod raises here, so existing
    ``except ValueError`` clauses keep working.
    """

    def __init__(self, what: str = "dp_plugin.torch") -> None:
        Exception.__init__(
            self,
            f"{what} needs dp_plugin.torch to be initialized; call hvd.init() "
            "(dp_plugin.torch.init()) once per process, after the launcher has started it "
            "and before any other hvd call",
        )


_process_sets.use_not_initialized_error(NotInitializedError)


def engine() -> Engine:
    """The running global engine; ``NotInitializedError`` naming the caller before ``init()``."""
    if not runtime.is_initialized():
        raise NotInitializedError(caller("dp_plugin.torch"))
    return runtime.engine()


# -- init / shutdown ------------------------------------------------------------


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start dp_plugin on this process: detect the launcher, start the engine.

    Collective: every rank calls it. Idempotent while running.

    ``comm`` exists for signature compatibility with Horovod: ``None``, an
    empty list, the list of all ranks, or an mpi4py communicator congruent
    with ``COMM_WORLD`` all mean "every rank of the job". A subset of ranks
    raises ``NotImplementedError`` (use process sets instead).
    ``process_sets``: ``ProcessSet`` objects to register now (see
    ``dp_plugin.process_sets``), or ``"dynamic"``; under the horovod engine,
    sets can be added later only if it is not None (Horovod's rule).
    """
    _check_comm(comm)
    eng = runtime.init(process_sets=process_sets is not None)
    shared_timeline.open_from_config(eng)
    _process_sets.setup(process_sets, "dp_plugin.torch")


def shutdown() -> None:
    """Stop dp_plugin on this process: close the timeline, forget the process sets
    and the collectives' handles, release the engine.

    ``init()`` may be called again afterwards.
    """
    shared_timeline.stop()
    _handles.reset()
    _process_sets.reset()
    runtime.shutdown()


def is_initialized() -> bool:
    return runtime.is_initialized()


def _check_comm(comm: Any) -> None:
    if comm is None:
        return
    if isinstance(comm, list | tuple | range):
        ranks = list(comm)
        if not ranks:
            return  # Horovod's own default: the whole world
        size = detect().size
        if ranks == list(range(size)):
            return
        raise NotImplementedError(
            f"init(comm={ranks!r}): dp_plugin runs on every rank the launcher started "
            f"(0..{size - 1}) and cannot restrict the job to a subset. Call init() without "
            "comm and use hvd.ProcessSet / hvd.add_process_set for collectives over a subset"
        )
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and isinstance(comm, mpi.Comm):
        relation = mpi.Comm.Compare(comm, mpi.COMM_WORLD)
        if relation in (mpi.IDENT, mpi.CONGRUENT):
            return
        raise NotImplementedError(
            f"init(comm=<mpi4py communicator of {comm.Get_size()} rank(s)>): only a "
            "communicator congruent with MPI.COMM_WORLD is supported. Call init() without "
            "comm and use hvd.ProcessSet for collectives over a subset of ranks"
        )
    raise ValueError(
        f"init(comm=...) expects None, a list of ranks or an mpi4py communicator, got "
        f"{type(comm).__name__}"
    )


# -- ranks ----------------------------------------------------------------------


@public("hvd.size()")
def size() -> int:
    """Number of processes in the job."""
    return engine().size


@public("hvd.rank()")
def rank() -> int:
    """This process's rank, 0 .. size()-1."""
    return engine().rank


@public("hvd.local_size()")
def local_size() -> int:
    """Number of processes on this host."""
    return engine().topology.local_size


@public("hvd.local_rank()")
def local_rank() -> int:
    """Index of this process among those on its host (pin your GPU with it)."""
    return engine().topology.local_rank


@public("hvd.cross_size()")
def cross_size() -> int:
    """Number of hosts (Horovod: processes with this process's local rank)."""
    return engine().topology.cross_size


@public("hvd.cross_rank()")
def cross_rank() -> int:
    """Index of this process's host."""
    return engine().topology.cross_rank


@public("hvd.is_homogeneous()")
def is_homogeneous() -> bool:
    """True when every host runs the same number of processes."""
    return engine().topology.is_homogeneous


# -- what is built, what is running ---------------------------------------------


def nccl_built() -> int:
    """NCCL version code (e.g. 21803 for 2.18.3) when torch has NCCL, else 0 (as Horovod)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    version = torch.cuda.nccl.version()
    if isinstance(version, tuple):
        major, minor, patch = [*version, 0, 0, 0][:3]
        return int(major) * 10000 + int(minor) * 100 + int(patch)
    return int(version)


def cuda_built() -> bool:
    """True when torch was built with CUDA."""
    import torch

    return bool(torch.backends.cuda.is_built())


def rocm_built() -> bool:
    """True when torch was built with ROCm (HIP)."""
    import torch

    return torch.version.hip is not None


@public("hvd.mpi_threads_supported()")
def mpi_threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE``; ``ValueError`` unless MPI is enabled."""
    return _capabilities.mpi_threads_supported(engine())


# -- timeline -------------------------------------------------------------------


@public("hvd.start_timeline()")
def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing this rank's Chrome trace to ``file_path`` (per-rank file names as
    ``DP_PLUGIN_TIMELINE``: ``{rank}`` replaced, else ``.rankN`` before the extension).

    Every ``DistributedOptimizer`` of this process records into it from its
    next step on, including ones created earlier. A timeline already running
    is closed first. ``mark_cycles`` adds an instant event at every step.
    Local: no communication.
    """
    eng = engine()
    if not isinstance(file_path, str) or not file_path:
        raise ValueError(f"start_timeline: file_path must be a non-empty string, got {file_path!r}")
    shared_timeline.start(file_path, eng.rank, mark_cycles, eng.config.timeline_max_bytes)


@public("hvd.stop_timeline()")
def stop_timeline() -> None:
    """Stop recording and close the timeline file (nothing happens if none is running)."""
    engine()
    shared_timeline.stop()


class SharedTimeline:
    """The process's current timeline, shared by every scheduler of the adapter.

    Schedulers hold ``shared_timeline`` (below), which forwards to whatever
    timeline is current, so ``start_timeline``/``stop_timeline`` take effect
    for optimizers created before them. ``close()`` does nothing: the file
    belongs to ``start_timeline`` / ``stop_timeline`` (or to ``shutdown()``),
    not to any one scheduler.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: Timeline | NullTimeline = NullTimeline()
        self.mark_cycles = False
        self._atexit = False

    def open_from_config(self, eng: Engine) -> None:
        # DP_PLUGIN_TIMELINE / HOROVOD_TIMELINE record from init() on, as in
        # Horovod; HOROVOD_TIMELINE=DYNAMIC means "only via start_timeline()".
        path = eng.config.timeline
        with self._lock:
            if not path or path.upper() == "DYNAMIC" or self.current.enabled:
                return
        self.start(path, eng.rank, False, eng.config.timeline_max_bytes)

    def start(self, path: str, rank: int, mark_cycles: bool, max_bytes: int) -> None:
        # One writer per file per process (dp_plugin.trace_writer): a file
        # already open (e.g. by a core scheduler) is shared, not truncated.
        new = open_timeline(path, rank, max_bytes)
        with self._lock:
            old, self.current = self.current, new
            self.mark_cycles = bool(mark_cycles)
            if not self._atexit:
                atexit.register(self.stop)
                self._atexit = True
        old.close()

    def stop(self) -> None:
        with self._lock:
            old, self.current = self.current, NullTimeline()
            self.mark_cycles = False
        old.close()

    # -- what a scheduler calls ---------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.current.enabled

    def span(self, name: str, cat: str, start: float, end: float, tid: Any = "main",
             args: Mapping[str, Any] | None = None) -> None:
        self.current.span(name, cat, start, end, tid=tid, args=args)

    def instant(self, name: str, cat: str, t: float, tid: Any = "main",
                args: Mapping[str, Any] | None = None) -> None:
        self.current.instant(name, cat, t, tid=tid, args=args)

    def counter(self, name: str, values: Mapping[str, float], t: float) -> None:
        self.current.counter(name, values, t)

    def flush(self) -> None:
        # Schedulers flush once per step: that is where a cycle ends.
        current = self.current
        if self.mark_cycles:
            current.instant("CYCLE_START", "cycle", time.perf_counter(), tid="step")
        current.flush()

    def close(self) -> None:
        pass


shared_timeline = SharedTimeline()
