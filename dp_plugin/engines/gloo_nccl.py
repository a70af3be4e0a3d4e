"""The two torch.distributed backends as engines: ``gloo`` (CPU) and ``nccl``
(CUDA, one GPU per rank). Everything they share is ``TorchDistEngine``
(``torch_dist.py``); here is only what differs: availability, the device
buffers live on, and Gloo's shared-memory and hierarchical all-reduces.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np

from dp_plugin.config import Config
from dp_plugin.engines import hierarchical, shm
from dp_plugin.engines.base import Availability, Handle, ReduceOp
from dp_plugin.engines.hierarchical import HierarchicalAllreduce
from dp_plugin.engines.torch_dist import TorchDistEngine
from dp_plugin.launch.topology import Topology
from dp_plugin.reduce.arrays import as_numpy

log = logging.getLogger("dp_plugin")


class GlooEngine(TorchDistEngine):
    """torch.distributed with Gloo: CPU buffers (CUDA ones are staged by torch).

    All-reduces of CPU buffers go through shared memory (``shm.py``) when
    every rank runs on one host (by the launcher's count; a channel or
    process set inherits the job's answer), and are hierarchical
    (``hierarchical.py``) on several hosts of several ranks, where a process
    set keeps the flat ring; each channel has segments of its own. Every
    other collective is Gloo's."""

    name = "gloo"
    backend = "gloo"
    _shm: shm.ShmTransport | None = None
    _hier: HierarchicalAllreduce | None = None

    def __init__(self, topology: Topology, config: Config, *,
                 parent: GlooEngine | None = None, group: Any = None) -> None:
        super().__init__(topology, config, parent=parent, group=group)
        self._shm_wanted: bool = (parent._shm_wanted if parent is not None else
                                  config.shared_memory and topology.local_size == topology.size)
        if self.size == 1:
            return
        # Collective: every rank of the group takes the same branch
        # (hierarchical.decide, shm.connect).
        if parent is None:
            self._hier = self._connect_hierarchical()
        elif parent.hierarchical:
            return  # a channel: the parent gives it its own hierarchy (_channel)
        if self._hier is None:
            self._shm = shm.connect(self.exchange_rows, self.rank, self.size, self._shm_wanted,
                                    config.timeout_s, budget_bytes=config.shared_memory_budget)

    @classmethod
    def availability(cls, topology: Topology) -> Availability:
        avail = super().availability(topology)
        if not avail.ok:
            return avail
        return Availability(True, f"{avail.reason}; {shm.describe(max(2, topology.local_size))}")

    @property
    def shared_memory(self) -> bool:
        """Whether all-reduces of CPU buffers go through shared memory."""
        return self._shm is not None or self._hier is not None

    @property
    def hierarchical(self) -> bool:
        """Whether all-reduces are hierarchical (``hierarchical.py``)."""
        return self._hier is not None

    def exchange_rows(self, row: np.ndarray, what: str) -> np.ndarray:
        """All-gather one fixed-length int64 row per rank: a (size, n) table
        (what ``shm.connect`` exchanges to set a segment up). One ``_allgather``."""
        gathered = self._allgather(row[None, :], [1] * self.size, f"{what} (headers)")
        return np.asarray(as_numpy(gathered))

    def scaled_sum_async(self, buf: Any, factor: float, name: str = "allreduce") -> Handle | None:
        """Shared memory multiplies the sum as it copies it out
        (``shm.SCALED_DTYPES``); None on any other route."""
        self._check_usable(f"allreduce {name!r}")
        t = self._tensor(buf, f"allreduce {name!r}")
        if (self._shm is None or not self._shm.takes(t) or not t.numel()
                or str(t.dtype).removeprefix("torch.") not in shm.SCALED_DTYPES):
            return None
        description = self.describe("allreduce", name, t.nbytes)
        return self._shm.allreduce_async(t, ReduceOp.SUM, description, self.mark_broken,
                                         self.wait_board(), factor)

    def _allreduce_async(self, buf: Any, op: ReduceOp, name: str) -> Handle:
        """The one route of every all-reduce, a joined rank's standing one too
        (it must meet the others' on the same route)."""
        route = self._hier or self._shm  # never both
        if route is None:  # across hosts: Gloo's path validates the buffer itself
            return super()._allreduce_async(buf, op, name)
        t = self._tensor(buf, f"allreduce {name!r}")
        if route.takes(t) and t.numel():
            return route.allreduce_async(t, op, self.describe("allreduce", name, t.nbytes),
                                         self.mark_broken, self.wait_board())
        return super()._allreduce_async(buf, op, name)

    def _close(self) -> None:
        for route in (self._shm, self._hier):
            if route is not None:
                route.close()
        super()._close()

    def _channel(self, name: str) -> GlooEngine:
        child = super()._channel(name)
        assert isinstance(child, GlooEngine)
        if self._hier is not None:
            child._hier = self._connect_hierarchical()
        return child

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """The job rank of each group rank (``Engine.subgroup``)."""
        return self._global_ranks

    @global_ranks.setter
    def global_ranks(self, ranks: tuple[int, ...]) -> None:
        # A process set's or channel's engine connects its shared memory
        # before Engine names its job ranks: the transport's messages follow.
        self._global_ranks = ranks
        if self._shm is not None:
            self._shm.ranks, self._shm.job_rank = ranks, ranks[self.rank]

    def _connect_hierarchical(self) -> HierarchicalAllreduce | None:
        """The hierarchy of one engine or channel, if the job takes it
        (``hierarchical.decide``), else None on every rank. Collective over
        the job: the cross-host groups, one per local rank, are made by
        every rank, as torch requires."""
        table = self.exchange_rows(hierarchical.row(self.topology, self.config),
                                   "hierarchical layout")
        layout, why = hierarchical.decide(table)
        flat = "dp_plugin: all-reduces use one flat Gloo ring, not the hierarchical path: %s"
        if layout is None:
            if (table[:, 0] == hierarchical.FORCED).any():
                log.warning(flat, why)
            elif why and self.rank == 0:
                log.info(flat, why)
            return None
        host = layout.host_of(self.rank)
        connect = functools.partial(shm.connect, self.exchange_rows, host.index(self.rank),
                                    len(host), timeout_s=self.config.timeout_s,
                                    budget_bytes=self.config.shared_memory_budget, members=host)
        transport = connect(eligible=self.config.shared_memory)
        if transport is None:
            log.warning(flat, "shared memory cannot be set up on every host")
            return None
        # A row's host index (hierarchical.row) is the cross-host groups' host key.
        cross, hosts = None, table[:, 1].tolist()
        for peers in layout.peer_groups() if len(layout.hosts) > 1 else []:
            made = self.subgroup(list(peers), hosts, "hierarchical cross-host")
            cross = made if made is not None else cross
        # The all-gather stage's own segment (hierarchical.py, **Pipelined.**).
        gather = connect(eligible=True, instead="the hierarchical all-reduce runs its steps one "
                         "after another, not pipelined (a second segment is needed)")
        if self.rank == 0:
            log.info("dp_plugin: gloo all-reduces hierarchically over %d hosts x %d ranks, %s "
                     "(launcher topology; DP_PLUGIN_HIERARCHICAL_ALLREDUCE=0 for one flat ring)",
                     len(layout.hosts), len(host),
                     "pipelined" if gather is not None else "unpipelined")
        return HierarchicalAllreduce(transport, cross, gather)

    @classmethod
    def _backend_problem(cls, topology: Topology) -> str | None:
        import torch.distributed as dist

        return None if dist.is_gloo_available() else "this torch build has no Gloo backend"

    def _select_device(self) -> Any:
        return self._torch.device("cpu")


class NcclEngine(TorchDistEngine):
    """torch.distributed with NCCL: CUDA buffers, one GPU per rank
    (``cuda:local_rank``); Average is the base class's, not NCCL's AVG. CPU
    buffers (``hvd.allreduce(torch.tensor(x))``, ``barrier``, Keras' numpy
    buffers) are copied to the GPU, reduced there and copied back (``_staged``)."""

    name = "nccl"
    backend = "nccl"

    @classmethod
    def _backend_problem(cls, topology: Topology) -> str | None:
        import torch
        import torch.distributed as dist

        if not torch.cuda.is_available():
            return "no CUDA device is visible (NCCL needs one GPU per rank); use gloo on CPUs"
        if not dist.is_nccl_available():
            return "this torch build has no NCCL backend; install a CUDA build of torch"
        count = torch.cuda.device_count()
        if topology.local_size > count:
            return (
                f"{topology.local_size} ranks on this host but {count} CUDA device(s); NCCL "
                "needs one GPU per rank: start at most that many processes per host"
            )
        return None

    def _select_device(self) -> Any:
        return self._torch.device("cuda", self.topology.local_rank)

    def _check_device(self, t: Any, what: str) -> None:
        if t.device.type not in ("cuda", "cpu"):
            raise TypeError(
                f"{what}: the nccl engine takes CUDA buffers (CPU ones are staged through "
                f"this rank's GPU), got one on {t.device}; move it to the GPU or to the CPU"
            )
