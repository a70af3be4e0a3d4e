"""Keras callbacks: ``DistributedCallback`` and ``BroadcastGlobalVariablesCallback``.

Also the ``callbacks`` namespace of Horovod's Keras API: ``dp.callbacks.X``
names every callback (``MetricAverageCallback``, ``LearningRateWarmupCallback``,
``LearningRateScheduleCallback``, ``BestModelCheckpoint`` are re-exported here).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from dp_plugin.keras.base_callbacks import BroadcastBase, DistributedBase
from dp_plugin.tensorflow import optimizer as _optimizer
from dp_plugin.tensorflow.broadcast import broadcast_model_state
from dp_plugin.tensorflow.callbacks_lr import (
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
)
from dp_plugin.tensorflow.checkpoint import BestModelCheckpoint
from dp_plugin.tensorflow.compat import check_keras, check_strategy
from dp_plugin.tensorflow.metric_average import MetricAverageCallback
from dp_plugin.tensorflow.xla_split import install_split_train_function, is_split, is_split_for


def _rebuild_train_function(model: Any, hook: _optimizer.DistributedApply | None, changed: bool,
                            who: str) -> None:
    """Make ``model.train_function`` contain the reduction (``changed``: the hook was
    (re)installed since it was built). With ``jit_compile`` the step is split around
    the reduction (``xla_split``) so that XLA is kept; else it is rebuilt as Keras
    builds it."""
    if hook is not None and model.jit_compile:
        replicas = int(model.distribute_strategy.num_replicas_in_sync)
        if replicas == 1:
            if changed or not is_split_for(model, hook):
                install_split_train_function(model, hook)
            return
        # XLA cannot compile the numpy bridge, and a step of several replicas
        # cannot be split: train without XLA.
        warnings.warn(
            f"{who}: turning off jit_compile (XLA) for model {model.name!r}: its train step "
            f"runs {replicas} replicas, whose gradients are summed between the parts XLA "
            "would compile, and XLA cannot compile the cross-worker reduction (a "
            "tf.numpy_function). Pass jit_compile=False to compile() to silence this warning",
            stacklevel=2,
        )
        model.jit_compile = False
        changed = True
    if changed or is_split(model):  # a split step, but jit_compile was turned off since
        model.make_train_function(force=True)


class BroadcastGlobalVariablesCallback(BroadcastBase):
    """Broadcast the model's weights and optimizer state from ``root_rank`` when
    training starts, so that every rank starts from the same state (Horovod's).

    Use it with ``DistributedOptimizer``; ``DistributedCallback`` does this
    itself. The optimizer's variables are created first if needed. A model
    whose weights do not exist yet (a subclassed model never called) is
    broadcast after the first batch instead, with a warning: that batch
    starts from different weights, as with Horovod. Under mixed precision it
    also moves ``DistributedOptimizer``'s reduction onto the
    ``LossScaleOptimizer`` that ``compile()`` wrapped around it.

    Distributed contract: every rank's ``fit`` starts together (collective);
    all ranks must hold the same model and optimizer layout, else
    ``LayoutMismatchError`` on every rank.
    """

    _hooks = _optimizer
    _peers = "workers"
    _equal_shards = ("make the shards equal: dp.shard(dataset) before batching, and "
                     "dataset.batch(n, drop_remainder=True) or dataset.take(k) to drop the "
                     "remainder")

    def _check_backend(self, model: Any) -> None:
        check_keras()
        check_strategy(model.distribute_strategy, f"{self._who} (model {model.name!r})")

    def _prepare(self, model: Any, changed: bool) -> None:
        _rebuild_train_function(model, _optimizer.find_hook(model.optimizer)[1], changed, self._who)

    def _broadcast(self, model: Any, first: bool) -> None:
        broadcast_model_state(model, self.root_rank)

    def _moved_hook(self, optimizer: Any,
                    hook: _optimizer.DistributedApply) -> _optimizer.DistributedApply:
        return dataclasses.replace(hook, optimizer=optimizer)  # the same bridge and settings


class DistributedCallback(DistributedBase, BroadcastGlobalVariablesCallback):
    """Data-parallel ``model.fit`` across workers, in one callback.

    ``model.fit(x, y, callbacks=[dp.DistributedCallback()])``. At the start of
    each ``fit`` it:

    1. installs the cross-worker gradient reduction into ``model.optimizer``
       (the compiled train step is rebuilt if it was traced without it; with
       ``jit_compile=True`` it is split around the reduction so that XLA is
       kept, see ``xla_split``); the replicas of a ``MirroredStrategy`` are first summed in-process,
       then one all-reduce per fusion bucket runs per worker, through the
       core (same engines, fusion and configuration as PyTorch);
    2. broadcasts the weights and the optimizer state from ``root_rank``.

    It stays installed after ``fit`` (later ``fit`` calls reuse the traced
    step; every rank must run them). ``evaluate`` and ``predict`` are
    unaffected. Arguments as ``DistributedOptimizer``: ``op`` (``dp.Average``
    or ``dp.Sum``), ``compression``, ``backward_passes_per_step``,
    ``gradient_predivide_factor``, ``average_aggregated_gradients``.

    Errors: an uncompiled model; an optimizer already wrapped by
    ``DistributedOptimizer`` (it would reduce twice); a model under
    ``MultiWorkerMirroredStrategy``; different models on different ranks
    (``LayoutMismatchError`` on every rank); an unsupported Keras.

    Distributed contract: every rank runs the same ``fit`` calls with the same
    number of steps; each train step is a collective.
    """

    def _checked_settings(self, **settings: Any) -> dict[str, Any]:
        _optimizer.parse_reduction(self._who, settings["op"], settings["compression"],
                                   settings["backward_passes_per_step"],
                                   settings["gradient_predivide_factor"])
        return settings

    def _new_hook(self, optimizer: Any) -> Any:
        return _optimizer.make_hook(optimizer, owner=self._who, **self._settings)


__all__ = [
    "BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "DistributedCallback",
    "LearningRateScheduleCallback", "LearningRateWarmupCallback", "MetricAverageCallback",
]
