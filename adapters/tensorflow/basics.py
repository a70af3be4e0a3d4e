"""Process-level API, as ``horovod.tensorflow``: init, shutdown, rank and size.

Thin over ``dp_plugin.runtime``: the launcher decides the ranks and the
engine (gloo under torchrun, Horovod's ring under horovodrun, MPI under
mpirun); no TensorFlow extension is involved.
"""

from __future__ import annotations

from typing import Any

from dp_plugin import process_sets as _process_sets
from dp_plugin import runtime
from dp_plugin.config import Config


def init(config: Config | None = None, process_sets: Any = None) -> None:
    """Start the engine the launcher calls for. Collective: every rank calls it once.

    ``config`` defaults to ``Config.from_env()`` (``DP_PLUGIN_*`` variables).
    Calling it again is harmless. ``process_sets`` (Horovod's): a list of
    ``ProcessSet`` to register now, in order, or None / ``"dynamic"``; under
    the horovod engine, sets can be added later only if it is not None.
    """
    runtime.init(config, process_sets=process_sets is not None)
    _process_sets.setup(process_sets, "dp_plugin.tensorflow")


def shutdown() -> None:
    """Release the engine (collective for gloo and MPI). ``init()`` may follow."""
    _process_sets.reset()
    runtime.shutdown()


def is_initialized() -> bool:
    return runtime.is_initialized()


def rank() -> int:
    """This process's rank, 0 .. size()-1. ``NotInitializedError`` before ``init()``."""
    return runtime.rank()


def size() -> int:
    """Number of processes (workers) in the job."""
    return runtime.size()


def local_rank() -> int:
    """This process's index among the processes on its host."""
    return runtime.topology().local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return runtime.topology().local_size
