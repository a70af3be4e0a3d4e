"""Horovod's API as both adapters export it, written once.

The reduce ops and ``Compression`` (``horovod_names``), process sets
(``process_sets``) and the engine/build queries (``capabilities``):
``dp_plugin.torch`` and ``dp_plugin.tensorflow`` star-import this module and
add its ``__all__`` to theirs, so the list is written once.

``HorovodBasics`` is the process-level API: each adapter makes one and binds
its methods as module functions, all on the one engine of ``dp_plugin.launch.runtime``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from dp_plugin.agree.edge import caller, public
from dp_plugin.api import capabilities
from dp_plugin.api import process_sets as _process_sets
from dp_plugin.api.capabilities import *  # noqa: F403 - each module lists its names once
from dp_plugin.api.horovod_names import Adasum, Average, Compression, Max, Min, Product, Sum
from dp_plugin.api.process_sets import *  # noqa: F403
from dp_plugin.api.timeline import shared_timeline
from dp_plugin.config import Config
from dp_plugin.engines.base import Engine
from dp_plugin.errors import NotInitializedError
from dp_plugin.launch import runtime
from dp_plugin.launch.launchers import detect

__all__ = ["Adasum", "Average", "Compression", "Max", "Min", "Product", "Sum"]
__all__ += capabilities.__all__
__all__ += _process_sets.__all__


def _topology_query(attr: str, doc: str) -> Callable[[HorovodBasics], Any]:
    """Horovod's ``hvd.<attr>()``: ``Topology.<attr>`` of the running engine."""
    def query(self: HorovodBasics) -> Any:
        return getattr(self.engine().topology, attr)

    query.__name__ = query.__qualname__ = attr
    query.__doc__ = doc
    return public(f"hvd.{attr}()")(query)


class HorovodBasics:
    """Horovod's process-level API for the adapter ``module`` (e.g. ``"dp_plugin.torch"``).

    Names, signatures and return types follow Horovod 0.28.1's
    ``HorovodBasics``. Every method that needs ``init()`` first raises
    ``error(what)`` before it, ``what`` naming the call; so do the process
    sets' calls (as Horovod's frameworks call ``process_sets._setup``).
    ``reset`` runs at ``shutdown()``: the adapter's own state (torch's handles).
    """

    def __init__(self, module: str, error: type[NotInitializedError],
                 reset: Callable[[], None] = lambda: None) -> None:
        self.module = module
        self.error = error
        self.reset = reset
        if issubclass(error, _process_sets.not_initialized_error):  # torch's, over the core's
            _process_sets.not_initialized_error = error

    def engine(self) -> Engine:
        """The running global engine; ``error`` naming the caller before ``init()``."""
        if not runtime.is_initialized():
            raise self.error(caller(self.module))
        return runtime.engine()

    # -- init / shutdown ------------------------------------------------------------

    def init(self, comm: Any = None, process_sets: Any = None, *,
             config: Config | None = None) -> None:
        """Start dp_plugin on this process: detect the launcher, start the engine.

        Collective: every rank calls it. Idempotent while running.

        ``comm`` exists for signature compatibility with Horovod: ``None``, an
        empty list, the list of all ranks, or an mpi4py communicator congruent
        with ``COMM_WORLD`` all mean "every rank of the job". A subset of ranks
        raises ``NotImplementedError`` (use process sets instead).
        ``process_sets``: ``ProcessSet`` objects to register now (see
        ``dp_plugin.api.process_sets``), or ``"dynamic"``; under the horovod engine,
        sets can be added later only if it is not None (Horovod's rule).
        ``config`` defaults to ``Config.from_env()`` (``DP_PLUGIN_*`` variables).
        """
        _check_comm(comm)
        eng = runtime.init(config, process_sets=process_sets is not None)
        shared_timeline.open_from_config(eng.config.timeline, eng.rank,
                                         eng.config.timeline_max_bytes)
        _process_sets.setup(process_sets, self.module)

    def shutdown(self) -> None:
        """Stop dp_plugin on this process: close the timeline, forget the process
        sets (and the adapter's state), release the engine (collective for gloo
        and MPI). ``init()`` may be called again afterwards."""
        shared_timeline.stop()
        self.reset()
        _process_sets.reset()
        runtime.shutdown()

    def is_initialized(self) -> bool:
        return runtime.is_initialized()

    # -- ranks: where this process sits (the running engine's ``Topology``) -----------

    size = _topology_query("size", "Number of processes in the job.")
    rank = _topology_query("rank", "This process's rank, 0 .. size()-1.")
    local_size = _topology_query("local_size", "Number of processes on this host.")
    local_rank = _topology_query(
        "local_rank", "Index of this process among those on its host (pin your GPU with it).")
    cross_size = _topology_query(
        "cross_size", "Number of hosts (Horovod: processes with this process's local rank).")
    cross_rank = _topology_query("cross_rank", "Index of this process's host.")
    is_homogeneous = _topology_query(
        "is_homogeneous", "True when every host runs the same number of processes.")

    @public("hvd.mpi_threads_supported()")
    def mpi_threads_supported(self) -> bool:
        """Whether MPI runs with ``MPI_THREAD_MULTIPLE``; ``ValueError`` unless MPI is enabled."""
        return capabilities.mpi_threads_supported(self.engine())

    # -- timeline -------------------------------------------------------------------

    @public("hvd.start_timeline()")
    def start_timeline(self, file_path: str, mark_cycles: bool = False) -> None:
        """Start writing this rank's Chrome trace to ``file_path`` (per-rank file names as
        ``DP_PLUGIN_TIMELINE``: ``{rank}`` replaced, else ``.rankN`` before the extension).

        Every ``DistributedOptimizer`` of this process records into it from its
        next step on, including ones created earlier. A timeline already running
        is closed first. ``mark_cycles`` adds an instant event at every step.
        Local: no communication.
        """
        eng = self.engine()
        if not isinstance(file_path, str) or not file_path:
            raise ValueError(
                f"start_timeline: file_path must be a non-empty string, got {file_path!r}")
        shared_timeline.start(file_path, eng.rank, mark_cycles, eng.config.timeline_max_bytes)

    @public("hvd.stop_timeline()")
    def stop_timeline(self) -> None:
        """Stop recording and close the timeline file (nothing happens if none is running)."""
        self.engine()
        shared_timeline.stop()


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
