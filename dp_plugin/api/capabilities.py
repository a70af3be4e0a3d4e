"""Horovod's build and transport queries that do not depend on the framework.

``gloo_built``/``mpi_built`` say which of dp_plugin's engines this
installation can run; ``gloo_enabled``/``mpi_enabled``/``mpi_threads_supported``
what the running engine moves data with (Horovod's own answer when the
``horovod`` engine runs). The adapters export these (``mpi_threads_supported``
through ``horovod_api.HorovodBasics``); the framework-specific queries
(``cuda_built``, ``nccl_built``, ...) stay in each adapter.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from dp_plugin.agree.edge import caller
from dp_plugin.engines.base import Engine
from dp_plugin.launch import runtime

__all__ = ["ccl_built", "ddl_built", "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled"]


def gloo_built() -> bool:
    """True when the ``gloo`` engine can run (torch.distributed with Gloo is installed)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_gloo_available())


def mpi_built() -> bool:
    """True when mpi4py is installed (the ``mpi`` engine). Does not start MPI."""
    return importlib.util.find_spec("mpi4py") is not None


def ddl_built() -> bool:
    """Always False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """Always False: oneCCL is not supported."""
    return False


def gloo_enabled() -> bool:
    """True when the running engine moves data with Gloo (False before ``init()``)."""
    return _moves_data_with("gloo")


def mpi_enabled() -> bool:
    """True when the running engine moves data with MPI (False before ``init()``)."""
    return _moves_data_with("mpi")


def mpi_threads_supported(engine: Engine) -> bool:
    """Whether the running ``engine``'s MPI runs with ``MPI_THREAD_MULTIPLE``;
    ``ValueError`` naming the caller unless MPI is enabled."""
    if not mpi_enabled():
        raise ValueError(
            f"{caller('mpi_threads_supported()')}: MPI is not enabled (the running engine "
            f"is {engine.name!r}); launch with mpirun and DP_PLUGIN_ENGINE=mpi (or auto) to use MPI"
        )
    if engine.name == "horovod":
        return bool(_horovod().mpi_threads_supported())
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def _horovod() -> Any:
    # The horovod engine runs Horovod's torch extension (dp_plugin.engines.horovod),
    # which it imported: only reached while that engine runs.
    import horovod.torch

    return horovod.torch


def _moves_data_with(transport: str) -> bool:
    """Whether the running engine is ``transport``'s (or Horovod's, built on it)."""
    if not runtime.is_initialized():
        return False
    engine = runtime.engine()
    if engine.name == "horovod":
        return bool(getattr(_horovod(), f"{transport}_enabled")())
    return engine.name == transport
