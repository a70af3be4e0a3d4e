"""Engine registry: name -> class, loaded lazily.

Importing this package imports no framework: each entry is a
``"module:Class"`` string resolved on first use, so asking for ``local``
never loads torch, and asking for ``gloo`` never loads mpi4py or horovod.

Pick by explicit name (``DP_PLUGIN_ENGINE``); only ``auto`` falls back, via
``choose_engine``, to what the launcher and hardware support.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from dp_plugin.config import ENGINE_NAMES as _CONFIG_NAMES
from dp_plugin.errors import EngineUnavailableError

if TYPE_CHECKING:
    from dp_plugin.config import Config
    from dp_plugin.engines.base import Availability, Engine
    from dp_plugin.topology import Topology

log = logging.getLogger("dp_plugin")

_REGISTRY: dict[str, str] = {
    "horovod": "dp_plugin.engines.horovod:HorovodEngine",
    "gloo": "dp_plugin.engines.gloo_nccl:GlooEngine",
    "nccl": "dp_plugin.engines.gloo_nccl:NcclEngine",
    "mpi": "dp_plugin.engines.mpi:MPIEngine",
    "local": "dp_plugin.engines.local:LocalEngine",
}

ENGINE_NAMES: tuple[str, ...] = tuple(n for n in _CONFIG_NAMES if n != "auto")
"""Every concrete engine name, in ``config.EngineName``'s order (the one
list of names; ``auto`` is resolved by ``choose_engine``). ``_REGISTRY``
has exactly these (tests/unit/test_registry.py checks it)."""


def engine_class(name: str) -> type[Engine]:
    """The class registered under ``name``; imports its module on first use."""
    target = _REGISTRY.get(name)
    if target is None:
        raise ValueError(
            f"engine {name!r} is not known; valid engines: {', '.join(ENGINE_NAMES)} "
            "or 'auto' (set DP_PLUGIN_ENGINE to one of them)"
        )
    module_name, _, class_name = target.partition(":")
    cls: type[Engine] = getattr(importlib.import_module(module_name), class_name)
    return cls


def availability(name: str, topology: Topology) -> Availability:
    """Whether engine ``name`` can run under ``topology``, and why not."""
    return engine_class(name).availability(topology)


def availability_report(topology: Topology) -> dict[str, Availability]:
    """Every engine's availability here, in registry order (``make check``)."""
    return {name: availability(name, topology) for name in ENGINE_NAMES}


def choose_engine(topology: Topology) -> tuple[str, str]:
    """What ``auto`` picks for this launcher and hardware: ``(name, reason)``.

    - no launcher, one process: ``local`` (nothing to communicate);
    - horovodrun: ``horovod`` (Horovod's own ring) when its torch extension
      is built with Gloo, else ``gloo`` through Horovod's rendezvous;
    - mpirun/mpiexec: ``mpi`` when mpi4py imports, else ``gloo``;
    - torchrun or srun: ``nccl`` with CUDA, else ``gloo``.
    """
    launcher = topology.launcher
    if launcher == "single" and topology.size == 1:
        return "local", "single process without a launcher: no communication needed"
    preferred = ("horovod" if launcher == "horovodrun" else "mpi" if topology.is_mpi
                 else "nccl")
    avail = availability(preferred, topology)
    if avail.ok:
        return preferred, f"launched by {launcher}; {preferred} is available ({avail.reason})"
    return "gloo", f"launched by {launcher}; {preferred} is not available: {avail.reason}"


def choose_for_job(requested: str, topology: Topology, config: Config) -> tuple[str, str]:
    """The engine this job runs, ``(name, reason)``: ``requested``, or for
    ``auto`` what ``choose_engine`` picks, after one check for the whole job
    that Horovod's engine can connect its hosts (``horovod_hosts``).

    Collective under horovodrun across hosts: every rank must call it, and
    every rank gets the same name. Where Horovod's engine cannot connect the
    hosts, ``auto`` runs ``gloo`` and an explicit ``horovod`` raises
    ``EngineUnavailableError`` with the cause and the fix, on every rank.
    """
    if requested == "auto":
        name, reason = choose_engine(topology)
    else:
        name, reason = requested, "requested by DP_PLUGIN_ENGINE / Config.engine"
    if name != "horovod" or not availability(name, topology).ok:
        return name, reason  # create_engine says why an unavailable engine cannot run
    from dp_plugin.engines.horovod_hosts import FIX, job_problem

    problem = job_problem(topology, config)
    if not problem:
        return name, reason
    if requested == "auto":
        return "gloo", f"launched by horovodrun; horovod cannot connect the hosts: {problem}"
    raise EngineUnavailableError(
        f"rank {topology.rank}: engine 'horovod' cannot run this job: {problem}. Fix: {FIX}"
    )


def create_engine(name: str, topology: Topology, config: Config) -> Engine:
    """Start engine ``name`` (or the one ``auto`` picks) for this process.

    Collective: every rank must call it with the same name. An engine that
    cannot run here raises ``EngineUnavailableError`` with the reason and the
    engines that can.
    """
    if name == "auto":
        name, reason = choose_engine(topology)
        log.debug("dp_plugin: auto engine -> %s (%s)", name, reason)
    cls = engine_class(name)
    avail = cls.availability(topology)
    if not avail.ok:
        usable = [n for n in ENGINE_NAMES if n != name and availability(n, topology).ok]
        hint = (
            f"Engines that can run here: {', '.join(usable)}; set DP_PLUGIN_ENGINE to one of "
            "them or to 'auto'"
            if usable else "No engine can run under this launcher; see `make check`"
        )
        raise EngineUnavailableError(
            f"engine {name!r} cannot run here (launcher {topology.launcher}, "
            f"{topology.size} rank(s)): {avail.reason}. {hint}"
        )
    return cls(topology, config)


__all__ = [
    "ENGINE_NAMES",
    "availability",
    "availability_report",
    "choose_engine",
    "choose_for_job",
    "create_engine",
    "engine_class",
]
