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
  answers the others' gradient reductions with zeros while it waits;
- a rank whose training batches of the epoch are done joins (``hvd.join()``)
  before its next collective, so ranks with different numbers of batches
  (a loader of one's own, ``use_distributed_sampler=False``) do not hang:
  the joined rank answers the others' remaining steps with zero gradients,
  divided by the full number of ranks as under DDP's ``Join``; then, when the
  counts differed, the rank that trained longest sends its parameters,
  buffers and optimizer state to the others.

Unlike Lightning 1.x, the learning rate is not multiplied by the number of
ranks: the gradient is averaged, as under ``strategy="ddp"``, and a run
trains as DDP does on the same seed (docs/lightning.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dp_plugin.torch as hvd
import torch
from dp_plugin.lightning import collectives
from dp_plugin.lightning.process import OnDPPlugin, distributed_optimizer, refuse_unknown_options
from dp_plugin.torch import joining as _joining

OPTIMIZER_OPTIONS = ("compression", "op", "gradient_predivide_factor", "num_groups", "groups",
                     "sparse_as_dense")
"""``hvd.DistributedOptimizer`` arguments the strategy passes on; it sets
``named_parameters`` and ``backward_passes_per_step`` itself."""

class HorovodStrategyBody(OnDPPlugin):
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
        refuse_unknown_options("HorovodStrategy", optimizer_options, OPTIMIZER_OPTIONS,
                               "named_parameters, and backward_passes_per_step from the "
                               "Trainer's accumulate_grad_batches")
        super().__init__(accelerator=accelerator,
                         parallel_devices=parallel_devices, cluster_environment=None,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._optimizer_options = optimizer_options
        self._fitting: Any = None
        """The ``Trainer`` during ``fit`` (set in ``setup``), else None."""
        self._joined_after = -1
        """``total.completed`` batches when this rank last joined at an epoch's end."""

    # -- where this process sits: dp_plugin's launcher detection -------------------
    @property
    def is_distributed(self) -> bool:
        """Read by the Trainer: it adds a ``DistributedSampler`` and lets
        ``self.log(..., sync_dist=True)`` reduce."""
        return True

    def model_to_device(self) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        self.model.to(self.root_device)

    # -- training ------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        if getattr(self, "_layer_sync", None) is not None:
            raise ValueError(
                "Trainer(sync_batchnorm=True) converts to torch.nn.SyncBatchNorm, which "
                "HorovodStrategy does not run; use dp_plugin.torch.SyncBatchNorm in the "
                "model instead and leave sync_batchnorm=False")
        super().setup(trainer)
        self._fitting = trainer if trainer.state.fn == "fit" else None
        self._joined_after = -1
        if trainer.state.fn != "fit":
            return
        module = self.lightning_module
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        passes = trainer.accumulate_grad_batches
        self.optimizers = [distributed_optimizer(opt, module, backward_passes_per_step=passes,
                                                 **self._optimizer_options)
                           for opt in self.optimizers]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Follow ``accumulate_grad_batches`` when it changes between epochs
        (``GradientAccumulationScheduler``): the optimizers are idle here."""
        self._join_if_out_of_batches()  # the last epoch ended with no collective
        if batch_idx == 0:
            self._check_batches_joinable()
        passes = self.lightning_module.trainer.accumulate_grad_batches
        for optimizer in self.optimizers:
            if optimizer.backward_passes_per_step != passes:
                optimizer.set_backward_passes_per_step(passes)
        super().on_train_batch_start(batch, batch_idx)

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
            return super().optimizer_step(optimizer, averaged, model, **kwargs)

    def on_train_end(self) -> None:
        self._join_if_out_of_batches()
        super().on_train_end()

    def on_validation_start(self) -> None:
        self._join_if_out_of_batches()
        super().on_validation_start()

    # -- uneven data: join where this rank's batches end ---------------------------
    def _join_if_out_of_batches(self) -> bool:
        """Join once this rank's last training batch of the epoch is complete
        (its step and ``on_train_batch_end`` done), at the first collective or
        hook after it: before validation and the epoch's end, whose
        collectives would else pair with the gradient reductions of ranks that
        have more batches. Every rank joins there, so an even epoch costs one
        join round. True if it joined."""
        if self._fitting is None:
            return False
        progress = self._fitting.fit_loop.epoch_loop.batch_progress
        done = progress.current.completed
        if not (progress.is_last_batch and done == progress.current.ready > 0):
            return False
        if self._joined_after == progress.total.completed:
            return False  # joined already at this epoch's end
        self._joined_after = progress.total.completed
        last = hvd.join()
        counts = hvd.allgather_object(done, name="dp_plugin.lightning.batches")
        if len(set(counts)) > 1:
            # The joined ranks skipped the others' last steps: the rank that
            # joined last trained through all of them.
            hvd.broadcast_parameters(self.lightning_module.state_dict(),
                                     root_rank=last)
            for optimizer in self.optimizers:
                hvd.broadcast_optimizer_state(optimizer, root_rank=last)
        return True

    def _check_batches_joinable(self) -> None:
        """Refuse, on every rank at the epoch's first batch, different numbers
        of batches per rank when dp_plugin's engine is torch.distributed's
        default group (the gloo and nccl engines): Lightning (2.6) then runs a
        ``torch.distributed.broadcast`` of its own before every training batch
        (its SIGTERM check), outside dp_plugin, which a rank that has joined
        cannot answer. Collective on those engines only."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        counts = hvd.allgather_object(self._fitting.num_training_batches,
                                      name="dp_plugin.lightning.epoch_batches")
        if len(set(counts)) <= 1:
            return
        each = "; ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        raise ValueError(
            f"HorovodStrategy: the ranks have different numbers of training batches per epoch "
            f"({each}). On the gloo and nccl engines dp_plugin shares torch.distributed's "
            "default process group with Lightning, which broadcasts on it before every "
            "training batch (its SIGTERM check), so a rank that ran out of batches cannot "
            "join the others' extra steps. Start the job under horovodrun or mpirun "
            "(DP_PLUGIN_ENGINE=horovod or mpi), or give every rank the same number of "
            "batches (Lightning's distributed sampler, use_distributed_sampler=True)")

    def teardown(self) -> None:
        """Lightning's teardown; the optimizers this strategy wrapped stop
        taking part in ``hvd.join()`` (the next ``Trainer``'s barriers)."""
        for optimizer in self.optimizers:
            _joining.retire(optimizer)
        self._fitting = None
        super().teardown()

    # -- collectives ----------------------------------------------------------------
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``collectives.reduce``, after joining if this rank's batches are done."""
        if isinstance(tensor, torch.Tensor):
            self._join_if_out_of_batches()
        return collectives.reduce(tensor, group, reduce_op, "HorovodStrategy.reduce")

    def all_gather(self, tensor: torch.Tensor, group: Any = None,
                   sync_grads: bool = False) -> torch.Tensor:
        """``collectives.all_gather``, after joining if this rank's batches are done."""
        self._join_if_out_of_batches()
        return collectives.all_gather(tensor, group, sync_grads, "HorovodStrategy.all_gather")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._join_if_out_of_batches()
        return hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, name: str | None = None) -> None:
        """``hvd.join()`` (see the module docstring), unless this rank joined just now."""
        if not self._join_if_out_of_batches():
            hvd.join()
