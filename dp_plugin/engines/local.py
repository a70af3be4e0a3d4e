"""The do-nothing engine: one process, no communication.

With a single rank every collective is already complete: an all-reduce of
one contribution is that contribution (sum, min, max, product and average
alike), a broadcast from rank 0 leaves the buffer as it is, and an
all-gather, an all-to-all and a reduce-scatter return a copy of this rank's
buffer; the only process set is ``[0]``. Handles are complete when
returned, so ``wait()`` never blocks. ``shutdown`` releases nothing, but
collectives raise afterwards, as on every engine.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dp_plugin.config import Config
from dp_plugin.engines.base import Availability, Engine, Handle, ReduceOp
from dp_plugin.errors import EngineUnavailableError
from dp_plugin.launch.topology import Topology
from dp_plugin.reduce.arrays import is_torch


class LocalEngine(Engine):
    """World size 1; every collective completes immediately."""

    name = "local"

    def __init__(self, topology: Topology, config: Config, *,
                 parent: LocalEngine | None = None) -> None:
        avail = self.availability(topology)
        if not avail.ok:
            raise EngineUnavailableError(avail.reason)
        super().__init__(topology, config, parent=parent)

    @classmethod
    def availability(cls, topology: Topology) -> Availability:
        if topology.size != 1:
            return Availability(
                False,
                f"the local engine runs exactly one process, but {topology.launcher} started "
                f"{topology.size}; use a multi-rank engine (gloo, nccl, mpi or horovod, or "
                "'auto')",
            )
        return Availability(True, "one process, no communication")

    def _close(self) -> None:
        """Nothing to release."""

    def _allreduce_async(self, buf: Any, op: ReduceOp, name: str) -> Handle:
        return self._done(self.describe("allreduce", name))

    def _broadcast_async(self, buf: Any, root: int, name: str) -> Handle:
        return self._done(self.describe("broadcast", name))

    def _allgather(self, buf: Any, rows: list[int], name: str) -> Any:
        # A copy, as on every other engine: the caller may reuse its input.
        return buf.clone() if is_torch(buf) else buf.copy()

    def _barrier(self) -> None:
        """A single rank is always at the barrier."""

    def _alltoall(self, buf: Any, counts: np.ndarray, name: str) -> Any:
        # Every row goes to rank 0, this rank: the result is a copy of buf.
        return buf.detach().clone() if is_torch(buf) else np.array(buf, copy=True)

    def _subgroup(self, members: tuple[int, ...], topology: Topology | None,
                  name: str) -> Engine | None:
        # members can only be (0,): validated by Engine.subgroup.
        return None if topology is None else LocalEngine(topology, self.config, parent=self)
