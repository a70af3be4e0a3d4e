"""``Fabric(strategy="horovod")``: Lightning Fabric's loop on ``dp_plugin.torch``.

Fabric's strategies are their own class tree (``lightning.fabric.strategies``),
so this is a strategy of its own, over the same torch adapter as the
``Trainer``'s (``strategy.py``), with the same collectives (``collectives.py``):

- ranks come from dp_plugin's launcher detection (``hvd.init()`` in
  ``fabric.launch()``); Fabric starts no processes;
- ``fabric.setup(model, optimizer)`` broadcasts the model's parameters and
  buffers from rank 0, then the optimizer's state if rank 0 has any, and
  wraps the optimizer in ``hvd.DistributedOptimizer``: ``fabric.backward``
  starts the fused all-reduce of each gradient bucket as backward produces
  it, and ``optimizer.step()`` waits for the average, then steps;
- ``fabric.clip_gradients`` clips the averaged gradient, as under DDP;
- ``all_reduce``, ``all_gather``, ``broadcast`` and ``barrier`` are
  dp_plugin's (``barrier`` is ``hvd.join()``).

Gradient accumulation is ``backward_passes_per_step=N`` (N backward passes,
then one step); ``fabric.no_backward_sync`` does nothing here (Fabric warns).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.fabric.strategies import ParallelStrategy

import dp_plugin.torch as hvd
import torch
from dp_plugin.lightning import collectives
from dp_plugin.lightning.process import OnDPPlugin, distributed_optimizer, refuse_unknown_options
from dp_plugin.torch import joining as _joining

FABRIC_OPTIMIZER_OPTIONS = ("compression", "op", "gradient_predivide_factor", "num_groups",
                            "groups", "sparse_as_dense", "backward_passes_per_step")
"""``hvd.DistributedOptimizer`` arguments the Fabric strategy passes on; it
sets ``named_parameters`` itself."""


class HorovodFabricStrategy(OnDPPlugin, ParallelStrategy):
    """``Fabric(strategy="horovod")``: data parallel training on dp_plugin.

    Start the script with any launcher dp_plugin detects, one process per
    device, and call ``fabric.launch()``; ``devices`` and ``num_nodes`` start
    no processes. Extra keyword arguments go to ``hvd.DistributedOptimizer``
    (one of ``FABRIC_OPTIMIZER_OPTIONS``).

    Distributed contract: every rank runs the same ``setup`` calls and the
    same steps; each ``optimizer.step()`` is a collective, and so is each
    ``fabric.all_reduce``/``all_gather``/``broadcast``/``barrier``.
    """

    def __init__(self, accelerator: Any = None, parallel_devices: list[torch.device] | None = None,
                 checkpoint_io: Any = None, precision: Any = None,
                 **optimizer_options: Any) -> None:
        refuse_unknown_options("HorovodFabricStrategy", optimizer_options,
                               FABRIC_OPTIMIZER_OPTIONS, "named_parameters")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=None, checkpoint_io=checkpoint_io,
                         precision=precision)
        self._optimizer_options = optimizer_options
        self._optimizers: list[Any] = []
        self._synchronized: set[int] = set()
        """``id`` of optimizers averaged already in this step (by a clip)."""

    # -- where this process sits: dp_plugin's launcher detection -------------------
    def module_to_device(self, module: torch.nn.Module) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        module.to(self.root_device)

    # -- training ------------------------------------------------------------------
    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: list[Any],
                                    scheduler: Any = None) -> tuple[Any, list[Any], Any]:
        module = self.setup_module(module)
        return module, [self._distributed(opt, module) for opt in optimizers], scheduler

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """``fabric.setup_optimizers(opt)`` alone: no module to name the
        parameters by, so they are named by their place in the optimizer."""
        return self._distributed(optimizer, None)

    def _distributed(self, optimizer: torch.optim.Optimizer,
                     module: torch.nn.Module | None) -> Any:
        wrapped = distributed_optimizer(optimizer, module, **self._optimizer_options)
        self._optimizers.append(wrapped)
        return wrapped

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The step; its gradients were averaged already if they were clipped."""
        if id(optimizer) not in self._synchronized:
            return super().optimizer_step(optimizer, **kwargs)
        self._synchronized.discard(id(optimizer))
        with optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, **kwargs)

    def clip_gradients_norm(self, module: torch.nn.Module, optimizer: Any, max_norm: Any,
                            norm_type: Any = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        with self._averaged(optimizer):
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type,
                                               error_if_nonfinite)

    def clip_gradients_value(self, module: torch.nn.Module, optimizer: Any,
                             clip_val: Any) -> None:
        with self._averaged(optimizer):
            super().clip_gradients_value(module, optimizer, clip_val)

    @contextmanager
    def _averaged(self, optimizer: Any) -> Iterator[None]:
        """Average the gradients before a clip, as DDP's are; the step then skips it."""
        if hasattr(optimizer, "synchronize") and id(optimizer) not in self._synchronized:
            optimizer.synchronize()
            self._synchronized.add(id(optimizer))
        yield

    def teardown(self) -> None:
        """Fabric's teardown; the wrapped optimizers stop taking part in ``hvd.join()``."""
        for optimizer in self._optimizers:
            _joining.retire(optimizer)
        self._optimizers = []
        super().teardown()

    # -- collectives ----------------------------------------------------------------
    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return collectives.reduce(tensor, group, reduce_op, "HorovodFabricStrategy.all_reduce")

    def all_gather(self, tensor: torch.Tensor, group: Any = None,
                   sync_grads: bool = False) -> torch.Tensor:
        return collectives.all_gather(tensor, group, sync_grads,
                                      "HorovodFabricStrategy.all_gather")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, name: str | None = None) -> None:
        """``hvd.join()``: a rank that arrives early answers the others'
        gradient reductions (zeros) until every rank is here."""
        hvd.join()
