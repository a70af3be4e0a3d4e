"""The body of Lightning's ``HorovodStrategy``, on ``dp_plugin.torch``.

Lightning 2.x ships one code base under two import names, ``lightning.pytorch``
and ``pytorch_lightning``, and each ``Trainer`` accepts only strategies derived
from its own ``ParallelStrategy``. ``HorovodStrategyBody`` is written once,
against neither; ``dp_plugin.lightning`` puts it in front of each installed
package's ``ParallelStrategy`` (a two-line class per package).

What it does, Lightning 1.x's ``HorovodStrategy`` on dp_plugin:

- ranks come from dp_plugin's launcher detection (``hvd.init()``), so one
  script runs under horovodrun, torchrun, mpirun, srun or the env launcher;
  Lightning launches nothing itself;
- every optimizer becomes ``hvd.DistributedOptimizer`` with
  ``backward_passes_per_step`` equal to ``accumulate_grad_batches``;
  parameters, buffers and optimizer state are broadcast from rank 0;
- gradients are synchronized right after the step's last backward, before
  Lightning's clipping and ``on_before_optimizer_step``, so
  ``gradient_clip_val`` clips the averaged gradient, as under DDP;
- ``reduce``, ``all_gather``, ``broadcast`` and ``barrier`` are dp_plugin's
  collectives; ``barrier`` is ``hvd.join()``, so a rank that ran out of batches
  answers the others' gradient reductions with zeros while it waits.

Unlike Lightning 1.x, the learning rate is not multiplied by the number of
ranks: the gradient is averaged, as under ``strategy="ddp"``, and a run
trains as DDP does on the same seed (docs/lightning.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_only

import dp_plugin.torch as hvd
import torch
from dp_plugin.errors import DPPluginError
from dp_plugin.torch import joining as _joining

OPTIMIZER_OPTIONS = ("compression", "op", "gradient_predivide_factor", "num_groups", "groups",
                     "sparse_as_dense")
"""``hvd.DistributedOptimizer`` arguments the strategy passes on; it sets
``named_parameters`` and ``backward_passes_per_step`` itself."""

_REDUCE_OPS = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "min": hvd.Min,
               "max": hvd.Max, "product": hvd.Product}


class HorovodStrategyBody:
    """``Trainer(strategy="horovod")``: data parallel training on dp_plugin.

    Start the script with any launcher dp_plugin detects, one process per
    device; ``devices`` and ``num_nodes`` do not start processes. Extra
    keyword arguments go to ``hvd.DistributedOptimizer`` (one of
    ``OPTIMIZER_OPTIONS``, e.g. ``compression=hvd.Compression.fp16``).

    Distributed contract: every rank builds the same ``Trainer`` and model and
    calls the same ``fit``/``validate``/``test``/``predict``; the collectives
    below run in the same order on every rank (``self.log(...,
    sync_dist=True)`` is one all-reduce per logged value).
    """

    strategy_name = "horovod"
    optimizers: list[Any]
    """Lightning's ``Strategy.optimizers`` (a property of the base this body is
    put in front of); declared for the type checker only."""

    def __init__(self, accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None,
                 **optimizer_options: Any) -> None:
        unknown = sorted(set(optimizer_options) - set(OPTIMIZER_OPTIONS))
        if unknown:
            raise TypeError(
                f"HorovodStrategy got unexpected keyword argument(s) {unknown}; it passes "
                f"only {list(OPTIMIZER_OPTIONS)} to hvd.DistributedOptimizer (it sets "
                "named_parameters, and backward_passes_per_step from the Trainer's "
                "accumulate_grad_batches)")
        super().__init__(accelerator=accelerator,  # type: ignore[call-arg]
                         parallel_devices=parallel_devices, cluster_environment=None,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._optimizer_options = optimizer_options

    # -- where this process sits: dp_plugin's launcher detection -------------------
    def set_world_ranks(self) -> None:
        """Start dp_plugin (collective, idempotent); the Trainer calls it when built."""
        hvd.init()
        rank_zero_only.rank = hvd.rank()  # type: ignore[attr-defined]

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
    def is_distributed(self) -> bool:
        """Read by the Trainer: it adds a ``DistributedSampler`` and lets
        ``self.log(..., sync_dist=True)`` reduce."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]  # type: ignore[attr-defined]
        if devices[0].type != "cuda":
            return devices[0]
        if self.local_rank >= torch.cuda.device_count():
            raise DPPluginError(
                f"rank {self.global_rank}: local rank {self.local_rank} has no GPU of its own "
                f"(this host has {torch.cuda.device_count()}); start at most one process per "
                "GPU on each host, or use accelerator='cpu'")
        return torch.device("cuda", self.local_rank)

    def setup_environment(self) -> None:
        self.set_world_ranks()
        super().setup_environment()  # type: ignore[misc]

    def model_to_device(self) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        self.model.to(self.root_device)  # type: ignore[attr-defined]

    # -- training ------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        if getattr(self, "_layer_sync", None) is not None:
            raise ValueError(
                "Trainer(sync_batchnorm=True) converts to torch.nn.SyncBatchNorm, which "
                "HorovodStrategy does not run; use dp_plugin.torch.SyncBatchNorm in the "
                "model instead and leave sync_batchnorm=False")
        super().setup(trainer)  # type: ignore[misc]
        if trainer.state.fn != "fit":
            return
        module = self.lightning_module  # type: ignore[attr-defined]
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        for optimizer in self.optimizers:
            # A fresh optimizer has no state to send. Horovod's broadcast would
            # make some with a zero-gradient step, and Adam's step count would
            # then differ from DDP's. Before wrapping: no reduction of its own.
            if hvd.broadcast_object(bool(optimizer.state), root_rank=0):
                hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        passes = trainer.accumulate_grad_batches
        self.optimizers = [self._distributed(opt, module, passes) for opt in self.optimizers]

    def _distributed(self, optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                     passes: int) -> Any:
        if hasattr(optimizer, "synchronize"):  # wrapped already (configure_optimizers did)
            return optimizer
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        named = [(name, p) for name, p in module.named_parameters() if id(p) in mine]
        return hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                        backward_passes_per_step=passes,
                                        **self._optimizer_options)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Follow ``accumulate_grad_batches`` when it changes between epochs
        (``GradientAccumulationScheduler``): the optimizers are idle here."""
        passes = self.lightning_module.trainer.accumulate_grad_batches  # type: ignore[attr-defined]
        for optimizer in self.optimizers:
            if optimizer.backward_passes_per_step != passes:
                optimizer.set_backward_passes_per_step(passes)
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        """The step, with the gradients averaged right after ``closure``'s
        backward: before the precision plugin unscales or clips them and
        before ``on_before_optimizer_step`` (Horovod's ``synchronize()`` then
        ``skip_synchronize()``). In manual optimization ``closure`` runs
        nothing, and ``opt.step()`` averages first, then steps."""

        def averaged() -> Any:
            result = closure()
            optimizer.synchronize()
            return result

        with optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, averaged, model, **kwargs)  # type: ignore[misc]

    def teardown(self) -> None:
        """Lightning's teardown; the optimizers this strategy wrapped stop
        taking part in ``hvd.join()`` (the next ``Trainer``'s barriers)."""
        for optimizer in self.optimizers:
            _joining.retire(optimizer)
        super().teardown()  # type: ignore[misc]

    # -- collectives ----------------------------------------------------------------
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """All-reduce ``tensor`` over every rank (``"mean"``, ``"sum"``, ``"min"``,
        ``"max"``, ``"product"`` or a ``torch.distributed.ReduceOp``); any other
        value is returned unchanged, as Lightning's strategies do."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        _check_group(group, "reduce")
        return hvd.allreduce(tensor, op=_reduce_op(reduce_op))

    def all_gather(self, tensor: torch.Tensor, group: Any = None,
                   sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension, as
        DDP's; with ``sync_grads`` the result is differentiable."""
        _check_group(group, "all_gather")
        if sync_grads:
            return hvd.allgather(tensor.unsqueeze(0))
        with torch.no_grad():
            return hvd.allgather(tensor.detach().unsqueeze(0))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, name: str | None = None) -> None:
        """``hvd.join()``: a rank that arrives early answers the others'
        gradient reductions (zeros) until every rank is here."""
        hvd.join()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name in ("horovod", "dp_plugin"):
            strategy_registry.register(
                name, cls, description="data parallel training on dp_plugin (Horovod's API)",
                override=True)


def _check_group(group: Any, what: str) -> None:
    if group is not None:
        raise ValueError(
            f"HorovodStrategy.{what}: group={group!r} is not supported; it runs over every "
            "rank. Leave group=None, or call dp_plugin.torch's collectives with a "
            "process_set= for a subset of ranks")


def _reduce_op(reduce_op: Any) -> Any:
    if reduce_op is None:
        return hvd.Average
    name = getattr(reduce_op, "name", reduce_op)  # torch.distributed.ReduceOp.SUM -> "SUM"
    op = _REDUCE_OPS.get(str(name).lower())
    if op is None:
        raise ValueError(
            f"HorovodStrategy.reduce: reduce_op={reduce_op!r} is not supported; use one of "
            f"{sorted(_REDUCE_OPS)} or a torch.distributed.ReduceOp of the same names")
    return op
