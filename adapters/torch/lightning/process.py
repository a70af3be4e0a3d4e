"""This process as Lightning's strategies see it, taken from dp_plugin.

The ``Trainer``'s strategy (``strategy.py``) and Fabric's (``fabric.py``) are
separate class trees in Lightning, but they ask the same questions of the
process (its ranks, its device, the sampler's arguments) and set up their
optimizers the same way. ``OnDPPlugin`` answers the questions; both
strategies put it first among their bases. ``distributed_optimizer`` is the
setup of one optimizer; ``refuse_unknown_options`` checks the keyword
arguments a strategy passes on to it.
"""

from __future__ import annotations

from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_only

import dp_plugin.torch as hvd
import torch
from dp_plugin.errors import DPPluginError


def refuse_unknown_options(owner: str, options: dict[str, Any], allowed: tuple[str, ...],
                           sets: str) -> None:
    """``TypeError`` naming the keyword arguments of ``owner`` that are not
    among the ``hvd.DistributedOptimizer`` arguments it passes on; ``sets``
    says what it sets itself."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(
            f"{owner} got unexpected keyword argument(s) {unknown}; it passes "
            f"only {list(allowed)} to hvd.DistributedOptimizer (it sets {sets})")


class OnDPPlugin:
    """Ranks from dp_plugin's launcher detection (after ``hvd.init()``), the
    device of the local rank, the ``DistributedSampler``'s arguments, and the
    registry names ``"horovod"`` and ``"dp_plugin"``."""

    parallel_devices: list[torch.device] | None
    """Lightning's ``ParallelStrategy.parallel_devices``; declared for the type checker."""

    def set_world_ranks(self) -> None:
        """Start dp_plugin (collective, idempotent); the Trainer calls it when built."""
        hvd.init()
        rank_zero_only.rank = hvd.rank()  # type: ignore[attr-defined]

    def setup_environment(self) -> None:
        self.set_world_ranks()
        super().setup_environment()  # type: ignore[misc]

    @property
    def global_rank(self) -> int:
        return hvd.rank()

    @property
    def local_rank(self) -> int:
        return hvd.local_rank()

    @property
    def node_rank(self) -> int:
        return hvd.cross_rank()

    @property
    def world_size(self) -> int:
        return hvd.size()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def root_device(self) -> torch.device:
        """The GPU of this process's local rank, or the CPU."""
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type != "cuda":
            return devices[0]
        if self.local_rank >= torch.cuda.device_count():
            raise DPPluginError(
                f"rank {self.global_rank}: local rank {self.local_rank} has no GPU of its own "
                f"(this host has {torch.cuda.device_count()}); start at most one process per "
                "GPU on each host, or use accelerator='cpu'")
        return torch.device("cuda", self.local_rank)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name in ("horovod", "dp_plugin"):
            strategy_registry.register(
                name, cls, description="data parallel training on dp_plugin (Horovod's API)",
                override=True)


def distributed_optimizer(optimizer: torch.optim.Optimizer, module: torch.nn.Module | None,
                          **options: Any) -> Any:
    """Rank 0's optimizer state on every rank, then ``optimizer`` wrapped in
    ``hvd.DistributedOptimizer`` (unless it is already), its parameters named
    by ``module`` (by their place in the optimizer when None). Collective."""
    # A fresh optimizer has no state to send. Horovod's broadcast would make
    # some with a zero-gradient step, and Adam's step count would then differ
    # from DDP's. Before wrapping: no reduction of its own.
    if hvd.broadcast_object(bool(optimizer.state), root_rank=0):
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if hasattr(optimizer, "synchronize"):  # wrapped already (by the user's code)
        return optimizer
    named = None
    if module is not None:
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        named = [(name, p) for name, p in module.named_parameters() if id(p) in mine]
    return hvd.DistributedOptimizer(optimizer, named_parameters=named, **options)
