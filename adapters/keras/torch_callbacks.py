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

from dp_plugin.keras import torch_optimizer
from dp_plugin.keras.base_callbacks import BroadcastBase, DistributedBase
from dp_plugin.keras.callbacks_lr import LearningRateScheduleCallback, LearningRateWarmupCallback
from dp_plugin.keras.metric_average import MetricAverageCallback
from dp_plugin.keras.torch_optimizer import (
    DistributedApply,
    checked_settings,
    find_hook,
)
from dp_plugin.torch import broadcast_parameters


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


class BroadcastGlobalVariablesCallback(BroadcastBase):
    """Broadcast the model's weights and optimizer state from ``root_rank``
    when training starts, so that every rank starts from the same state.

    Use it with ``DistributedOptimizer``; ``DistributedCallback`` does this
    itself. The optimizer's variables are created first if needed. A model
    whose weights do not exist yet (a subclassed model never called) is
    broadcast after the first batch instead, with a warning. Under mixed
    precision it moves ``DistributedOptimizer``'s reduction onto the
    ``LossScaleOptimizer`` that ``compile()`` wrapped around it, so that every
    rank skips the same steps. Ranks with different numbers of batches per
    epoch are refused before the first step, on every rank.

    Distributed contract: every rank's ``fit`` starts together (collective);
    all ranks hold the same model and optimizer layout, else
    ``LayoutMismatchError`` on every rank.
    """

    _hooks = torch_optimizer

    def _check_backend(self, model: Any) -> None:
        if model.jit_compile:
            # torch.compile would trace the reduction's hooks and waits into fit's step.
            warnings.warn(
                f"{self._who}: turning off jit_compile for model {model.name!r}: torch.compile "
                "cannot compile the cross-process reduction inside fit's train step. Pass "
                "jit_compile=False to compile() to silence this warning", stacklevel=4)
            model.jit_compile = False
            model.make_train_function(force=True)

    def _broadcast(self, model: Any, first: bool) -> None:
        broadcast_model_state(model, self.root_rank)
        hook = find_hook(model.optimizer)[1]
        if first and hook is not None:  # agree on the layout now: the first step overlaps
            hook.attach(model.trainable_weights)

    def _moved_hook(self, optimizer: Any, hook: Any) -> Any:
        return DistributedApply(optimizer, owner=hook.owner, settings=hook.settings,
                                groups=hook.groups)


class DistributedCallback(DistributedBase, BroadcastGlobalVariablesCallback):
    """Data-parallel ``model.fit`` across processes, in one callback.

    ``model.fit(x, y, callbacks=[dp.DistributedCallback()])``. At the start of
    each ``fit`` it installs the cross-process gradient reduction into
    ``model.optimizer`` (the torch adapter's fused, overlapped all-reduce) and
    broadcasts the weights and the optimizer state from ``root_rank``. It
    stays installed after ``fit``; ``evaluate`` and ``predict`` are unaffected.
    Arguments as ``DistributedOptimizer``.

    Errors: an uncompiled model; an optimizer already wrapped by
    ``DistributedOptimizer`` (it would reduce twice); different models on
    different ranks (``LayoutMismatchError`` on every rank); ranks with
    different numbers of batches per epoch.

    Distributed contract: every rank runs the same ``fit`` calls with the same
    number of steps; each train step is a collective.
    """

    def _checked_settings(self, **settings: Any) -> Any:
        return checked_settings(self._who, **settings)

    def _new_hook(self, optimizer: Any) -> Any:
        return DistributedApply(optimizer, owner=self._who, settings=self._settings)


__all__ = [
    "BroadcastGlobalVariablesCallback", "DistributedCallback", "LearningRateScheduleCallback",
    "LearningRateWarmupCallback", "MetricAverageCallback",
]
