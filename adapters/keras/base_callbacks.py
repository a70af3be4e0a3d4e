"""The Keras callbacks that distribute ``model.fit``, written once for every backend.

``BroadcastGlobalVariablesCallback`` and ``DistributedCallback`` do the same
things on TensorFlow and on torch: check the model, refuse ranks with
different numbers of batches per epoch, install (or move) the gradient
reduction in the optimizer, and broadcast the model's state from
``root_rank``. ``BroadcastBase`` and ``DistributedBase`` hold that logic; a
backend's callbacks (``dp_plugin.tensorflow.callbacks``,
``dp_plugin.keras.torch_callbacks``) subclass them and fill in the few
methods marked *backend*: how its optimizer hook is found, built and
installed, and how the model's state travels.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
from dp_plugin.agree.edge import calling
from dp_plugin.api import objects
from dp_plugin.api.horovod_names import Average, Compression
from dp_plugin.api.process_sets import engine_of, global_process_set
from dp_plugin.errors import DPPluginError, NotInitializedError
from dp_plugin.launch import runtime
from dp_plugin.validate import check_int


class BroadcastBase(keras.callbacks.Callback):
    """The body of ``BroadcastGlobalVariablesCallback`` (see the backends' docstrings)."""

    _who = "BroadcastGlobalVariablesCallback"
    _peers = "processes"
    """What the ranks are called in messages (TensorFlow's: ``workers``)."""
    _hooks: Any = None
    """*Backend*: its optimizer module, whose ``find_hook(optimizer)``,
    ``hook_of(optimizer)`` and ``install(optimizer, hook, replacing=...)``
    place the reduction in a Keras optimizer's ``apply``."""
    _equal_shards = ("give every rank as many samples (cut the arrays, or a "
                     "DistributedSampler(drop_last=True) for a DataLoader)")
    """How to make the ranks' data equal, on this backend (for the uneven-steps error)."""

    def __init__(self, root_rank: int = 0, device: str = "",
                 local_variables: Any = None) -> None:
        super().__init__()
        if local_variables is not None:
            raise NotImplementedError(
                f"{self._who}: local_variables is not supported (every model weight and "
                "optimizer variable is broadcast); leave it None")
        self.device = device
        self.root_rank = check_int("root_rank", root_rank, minimum=0, where=self._who)
        self._pending = False

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        model = self._checked_model(self.model)
        check_equal_steps(self.params.get("steps"), self._who, self._equal_shards)
        self._prepare(model, self._install(model.optimizer))
        if not model.built:
            warnings.warn(
                f"{self._who}: model {model.name!r} has no weights before its first batch, so "
                f"they are broadcast from rank {self.root_rank} after it; the first step "
                "starts from different weights on each rank. Build the model first "
                "(keras.Input, or model.build(input_shape)) to start from equal weights",
                stacklevel=2)
            self._pending = True
            return
        with calling(self._who):
            self._broadcast(model, first=True)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._pending:
            self._pending = False
            with calling(self._who):
                self._broadcast(self.model, first=False)

    def _checked_model(self, model: Any) -> Any:
        if model is None:
            raise DPPluginError(f"{self._who} has no model; pass it to model.fit(callbacks=[...])")
        if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
            raise DPPluginError(
                f"{self._who}: model {model.name!r} is not compiled, so it has no optimizer to "
                "distribute; call model.compile(optimizer=..., loss=...) before model.fit")
        if not runtime.is_initialized():
            raise NotInitializedError(self._who)
        self._check_backend(model)
        return model

    def _install(self, optimizer: Any) -> bool:
        """Move ``DistributedOptimizer``'s reduction onto a ``LossScaleOptimizer``
        that ``compile()`` (mixed precision) wrapped around it, whose finiteness
        check would else run before the reduction (and differ between ranks).
        True if it moved (a traced step must be rebuilt)."""
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or \
                self._hooks.hook_of(optimizer):
            return False
        target, hook = self._hooks.find_hook(optimizer)
        if hook is None:
            return False
        self._hooks.install(optimizer, self._moved_hook(optimizer, hook), replacing=target)
        return True

    # -- backend ----------------------------------------------------------------------
    def _check_backend(self, model: Any) -> None:
        """Refuse (or adjust) what this backend cannot distribute."""

    def _prepare(self, model: Any, changed: bool) -> None:
        """After the reduction is installed (``changed``: it is new or moved)."""

    def _broadcast(self, model: Any, first: bool) -> None:
        """Make every rank's weights and optimizer variables ``root_rank``'s
        (``first``: at the start of training, not after a first batch)."""
        raise NotImplementedError

    def _moved_hook(self, optimizer: Any, hook: Any) -> Any:
        """``hook``'s reduction, rebuilt for ``optimizer`` (a ``LossScaleOptimizer``)."""
        raise NotImplementedError


class DistributedBase(BroadcastBase):
    """The body of ``DistributedCallback`` (see the backends' docstrings)."""

    _who = "DistributedCallback"

    def __init__(
        self,
        root_rank: int = 0,
        compression: Any = Compression.none,
        op: Any = Average,
        backward_passes_per_step: int = 1,
        gradient_predivide_factor: float = 1.0,
        average_aggregated_gradients: bool = False,
        sparse_as_dense: bool = False,
    ) -> None:
        super().__init__(root_rank)
        # Validated now, so a bad argument fails where it is written.
        self._settings = self._checked_settings(
            compression=compression, op=op, backward_passes_per_step=backward_passes_per_step,
            gradient_predivide_factor=gradient_predivide_factor,
            average_aggregated_gradients=average_aggregated_gradients,
            sparse_as_dense=sparse_as_dense)

    def _install(self, optimizer: Any) -> bool:
        """Install (or keep) the reduction in ``optimizer``; True if a traced step
        must be rebuilt."""
        target, existing = self._hooks.find_hook(optimizer)
        if existing is not None and existing.owner != self._who:
            raise ValueError(
                f"{self._who}: optimizer {target.name!r} was wrapped by "
                f"dp.{existing.owner}, so it already reduces gradients across {self._peers} "
                "and the callback would reduce them twice. Use either DistributedCallback "
                "with the plain optimizer, or DistributedOptimizer with "
                "BroadcastGlobalVariablesCallback")
        hook = self._new_hook(optimizer)
        if existing is not None and target is optimizer and existing.same_settings(hook):
            return False  # installed by an earlier fit: its traced step is still right
        self._hooks.install(optimizer, hook, replacing=target if existing is not None else None)
        return True

    # -- backend ----------------------------------------------------------------------
    def _checked_settings(self, **settings: Any) -> Any:
        """``DistributedOptimizer``'s arguments, validated, as the backend keeps them."""
        raise NotImplementedError

    def _new_hook(self, optimizer: Any) -> Any:
        """This callback's reduction for ``optimizer``, with ``self._settings``."""
        raise NotImplementedError


def check_equal_steps(steps: int | None, who: str, equal_shards: str) -> None:
    """Refuse, on every rank before the first step, a ``fit`` whose ranks have
    different numbers of batches per epoch (``steps``: Keras's count, None where
    the data's length is unknown): the rank with more would wait in an
    all-reduce that the others never start. ``equal_shards`` ends the message:
    how to make the data equal. Collective."""
    counts = objects.allgather_object(engine_of(global_process_set), steps,
                                      "dp_plugin.keras.steps")
    known = [c for c in counts if c is not None]
    if len(set(known)) <= 1:
        return
    each = "; ".join(f"rank {r}: {c if c is not None else 'unknown'}"
                     for r, c in enumerate(counts))
    raise ValueError(
        f"{who}: the ranks have different numbers of batches per epoch ({each}), so a "
        "rank would wait at the end of the epoch in an all-reduce the others never start. "
        f"Give every rank the same number: pass steps_per_epoch={min(known)} to fit (the "
        f"smallest), or {equal_shards}")
