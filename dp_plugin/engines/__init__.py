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
import socket
from typing import TYPE_CHECKING

from dp_plugin.config import ENGINE_NAMES as _CONFIG_NAMES
from dp_plugin.errors import EngineUnavailableError

if TYPE_CHECKING:
    from dp_plugin.config import Config
    from dp_plugin.engines.base import Availability, Engine
    from dp_plugin.launch.topology import Topology

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
    - horovodrun: see ``_under_horovodrun`` (``gloo`` on CPUs);
    - mpirun/mpiexec: ``mpi`` when mpi4py imports, else ``gloo``;
    - torchrun or srun: ``nccl`` with CUDA, else ``gloo``.

    This rank's own pick: under horovodrun the job then takes one choice for
    every rank (``choose_for_job``).
    """
    launcher = topology.launcher
    if launcher == "single" and topology.size == 1:
        return "local", "single process without a launcher: no communication needed"
    if launcher == "horovodrun":
        return _under_horovodrun(topology)
    preferred = "mpi" if topology.is_mpi else "nccl"
    avail = availability(preferred, topology)
    if avail.ok:
        return preferred, f"launched by {launcher}; {preferred} is available ({avail.reason})"
    return "gloo", f"launched by {launcher}; {preferred} is not available: {avail.reason}"


def _under_horovodrun(topology: Topology) -> tuple[str, str]:
    """``auto`` under horovodrun, by measurement rather than by the launcher's name.

    On CPUs, ``gloo`` through horovodrun's rendezvous: shared memory on one
    host, hierarchical across hosts, measured faster than Horovod's ring
    (BENCHMARKS.md, "Under horovodrun" and "Across hosts"), and Horovod's
    library then never starts its background thread. On GPUs, Horovod built
    with NCCL keeps Horovod's own NCCL path, what a Horovod user ran before,
    since no run here has compared it with the nccl engine yet; other GPU
    hosts run ``nccl``.
    """
    gpus = availability("nccl", topology)
    if not gpus.ok:
        return "gloo", (
            "launched by horovodrun on CPUs: gloo through horovodrun's rendezvous (shared "
            "memory on one host, hierarchical across hosts), measured faster than Horovod's "
            "ring; DP_PLUGIN_ENGINE=horovod runs Horovod's ring"
        )
    from dp_plugin.engines.horovod import built_with_nccl

    if availability("horovod", topology).ok and built_with_nccl():
        return "horovod", ("launched by horovodrun on GPUs with Horovod built with NCCL: "
                           "Horovod's own NCCL path (DP_PLUGIN_ENGINE=nccl for "
                           "torch.distributed's)")
    return "nccl", (f"launched by horovodrun on GPUs, Horovod here without NCCL: nccl through "
                    f"horovodrun's rendezvous ({gpus.reason})")


def choose_for_job(requested: str, topology: Topology, config: Config) -> tuple[str, str]:
    """The engine this job runs, ``(name, reason)``: ``requested``, or for
    ``auto`` what ``choose_engine`` picks.

    Collective under horovodrun for ``auto`` and ``horovod``: every rank must
    call it, whatever it has installed, and every rank gets the same name,
    or the same ``EngineUnavailableError`` naming the ranks, the cause and
    the fix (``job_choice``: Horovod missing on some host, or a host Horovod's
    Gloo cannot reach). Elsewhere every rank decides alone.
    """
    if requested == "auto":
        name, reason = choose_engine(topology)
    else:
        name, reason = requested, "requested by DP_PLUGIN_ENGINE / Config.engine"
    if (topology.launcher != "horovodrun" or topology.size == 1
            or requested not in ("auto", "horovod")):
        return name, reason  # create_engine says why an unavailable engine cannot run
    from dp_plugin.engines import horovod_hosts, job_choice

    horovod = unreachable = ""
    if name == "horovod":
        avail = availability("horovod", topology)
        horovod = "" if avail.ok else avail.reason
        if avail.ok and topology.local_size != topology.size:
            unreachable = horovod_hosts.this_host()  # one host: loopback reaches everyone
    mine = job_choice.Finding(
        host=topology.hostname or socket.gethostname(), pick=name, horovod=horovod,
        unreachable=unreachable,
        nccl=requested == "auto" and name != "gloo" and availability("nccl", topology).ok,
    )
    return job_choice.agree(requested, topology, config, mine, reason)


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
