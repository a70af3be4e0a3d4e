"""Keras 3 on the torch backend: ``DistributedCallback`` and ``BroadcastGlobalVariablesCallback``.

Also the ``callbacks`` namespace of Horovod's Keras API on this backend:
``dp.callbacks.X`` names every callback (``MetricAverageCallback``,
``LearningRateWarmupCallback``, ``LearningRateScheduleCallback``, shared with
TensorFlow, are re-exported here).

The same names, arguments and contract as on TensorFlow (docs/keras.md). The
gradient reduction is ``torch_optimizer.DistributedApply`` (the torch
adapter's ``DistributedOptimizer`` underneath); the broadcast is the torch
adapter's ``broadcast_parameters`` of the variables' torch tensors, in place.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
from dp_plugin import runtime
from dp_plugin.edge import calling
from dp_plugin.errors import DPPluginError, NotInitializedError
from dp_plugin.horovod_names import Average, Compression
from dp_plugin.keras.callbacks_lr import LearningRateScheduleCallback, LearningRateWarmupCallback
from dp_plugin.keras.metric_average import MetricAverageCallback
from dp_plugin.keras.torch_optimizer import (
    DistributedApply,
    checked_settings,
    find_hook,
    hook_of,
    install,
)
from dp_plugin.torch import broadcast_parameters
from dp_plugin.validate import check_int


def broadcast_model_state(model: Any, root_rank: int) -> None:
    """Broadcast the model's weights and its optimizer's variables from
    ``root_rank``, in place. The optimizer's variables are created first if
    needed, so that every rank holds the same set. Seed generator states
    (``model.variables`` minus ``model.weights``) are left alone: each rank
    keeps its own dropout randomness."""
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    named = [(f"weights[{i}] {v.path}", v.value) for i, v in enumerate(model.weights)]
    # Optimizer variable paths embed the model's layer names, which differ
    # between processes that built different numbers of layers.
    named += [(f"optimizer.variables[{i}]", v.value) for i, v in enumerate(optimizer.variables)]
    broadcast_parameters(named, root_rank)


def _checked_model(model: Any, who: str) -> Any:
    if model is None:
        raise DPPluginError(f"{who} has no model; pass it to model.fit(callbacks=[...])")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise DPPluginError(
            f"{who}: model {model.name!r} is not compiled, so it has no optimizer to "
            "distribute; call model.compile(optimizer=..., loss=...) before model.fit")
    if not runtime.is_initialized():
        raise NotInitializedError(who)
    if model.jit_compile:
        # torch.compile would trace the reduction's hooks and waits into fit's step.
        warnings.warn(
            f"{who}: turning off jit_compile for model {model.name!r}: torch.compile cannot "
            "compile the cross-process reduction inside fit's train step. Pass "
            "jit_compile=False to compile() to silence this warning", stacklevel=3)
        model.jit_compile = False
        model.make_train_function(force=True)
    return model


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's weights and optimizer state from ``root_rank``
    when training starts, so that every rank starts from the same state.

    Use it with ``DistributedOptimizer``; ``DistributedCallback`` does this
    itself. The optimizer's variables are created first if needed. A model
    whose weights do not exist yet (a subclassed model never called) is
    broadcast after the first batch instead, with a warning. Under mixed
    precision it moves ``DistributedOptimizer``'s reduction onto the
    ``LossScaleOptimizer`` that ``compile()`` wrapped around it, so that every
    rank skips the same steps.

    Distributed contract: every rank's ``fit`` starts together (collective);
    all ranks hold the same model and optimizer layout, else
    ``LayoutMismatchError`` on every rank.
    """

    _who = "BroadcastGlobalVariablesCallback"

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
        model = _checked_model(self.model, self._who)
        self._install(model.optimizer)
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
            broadcast_model_state(model, self.root_rank)
            hook = find_hook(model.optimizer)[1]
            if hook is not None:  # agree on the layout now: the first step overlaps
                hook.attach(model.trainable_weights)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._pending:
            self._pending = False
            with calling(self._who):
                broadcast_model_state(self.model, self.root_rank)

    def _install(self, optimizer: Any) -> None:
        """Move ``DistributedOptimizer``'s reduction onto a ``LossScaleOptimizer``
        that ``compile()`` wrapped around it, whose finiteness check would else
        run before the reduction (and differ between ranks)."""
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or hook_of(optimizer):
            return
        target, hook = find_hook(optimizer)
        if hook is not None:
            install(optimizer, DistributedApply(optimizer, owner=hook.owner,
                                                settings=hook.settings, groups=hook.groups),
                    replacing=target)


class DistributedCallback(BroadcastGlobalVariablesCallback):
    """Data-parallel ``model.fit`` across processes, in one callback.

    ``model.fit(x, y, callbacks=[dp.DistributedCallback()])``. At the start of
    each ``fit`` it installs the cross-process gradient reduction into
    ``model.optimizer`` (the torch adapter's fused, overlapped all-reduce) and
    broadcasts the weights and the optimizer state from ``root_rank``. It
    stays installed after ``fit``; ``evaluate`` and ``predict`` are unaffected.
    Arguments as ``DistributedOptimizer``.

    Errors: an uncompiled model; an optimizer already wrapped by
    ``DistributedOptimizer`` (it would reduce twice); different models on
    different ranks (``LayoutMismatchError`` on every rank).

    Distributed contract: every rank runs the same ``fit`` calls with the same
    number of steps; each train step is a collective.
    """

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
        self._settings = checked_settings(
            self._who, compression=compression, op=op,
            backward_passes_per_step=backward_passes_per_step,
            gradient_predivide_factor=gradient_predivide_factor,
            average_aggregated_gradients=average_aggregated_gradients,
            sparse_as_dense=sparse_as_dense)

    def _install(self, optimizer: Any) -> None:
        target, existing = find_hook(optimizer)
        if existing is not None and existing.owner != self._who:
            raise ValueError(
                f"{self._who}: optimizer {target.name!r} was wrapped by "
                f"dp.{existing.owner}, so it already reduces gradients across processes and "
                "the callback would reduce them twice. Use either DistributedCallback with "
                "the plain optimizer, or DistributedOptimizer with "
                "BroadcastGlobalVariablesCallback")
        hook = DistributedApply(optimizer, owner=self._who, settings=self._settings)
        if existing is not None and target is optimizer and existing.same_settings(hook):
            return  # installed by an earlier fit
        install(optimizer, hook, replacing=target if existing is not None else None)


__all__ = [
    "BroadcastGlobalVariablesCallback", "DistributedCallback", "LearningRateScheduleCallback",
    "LearningRateWarmupCallback", "MetricAverageCallback",
]
