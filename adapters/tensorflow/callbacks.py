"""Keras callbacks: ``DistributedCallback`` and ``BroadcastGlobalVariablesCallback``.

Also the ``callbacks`` namespace of Horovod's Keras API: ``dp.callbacks.X``
names every callback (``MetricAverageCallback``, ``LearningRateWarmupCallback``,
``LearningRateScheduleCallback``, ``BestModelCheckpoint`` are re-exported here).
"""

from __future__ import annotations

import warnings
from typing import Any

import keras

from dp_plugin import runtime
from dp_plugin.edge import calling
from dp_plugin.errors import DPPluginError, NotInitializedError
from dp_plugin.horovod_names import Average, Compression
from dp_plugin.tensorflow.broadcast import broadcast_model_state
from dp_plugin.tensorflow.callbacks_lr import (
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
)
from dp_plugin.tensorflow.checkpoint import BestModelCheckpoint
from dp_plugin.tensorflow.compat import check_keras, check_strategy
from dp_plugin.tensorflow.functions import allgather_object
from dp_plugin.tensorflow.metric_average import MetricAverageCallback
from dp_plugin.tensorflow.optimizer import (
    DistributedApply,
    find_hook,
    hook_of,
    install,
    make_hook,
    parse_reduction,
)
from dp_plugin.tensorflow.xla_split import install_split_train_function, is_split, is_split_for
from dp_plugin.validate import check_int


def _checked_model(model: Any, who: str) -> Any:
    check_keras()
    if model is None:
        raise DPPluginError(f"{who} has no model; pass it to model.fit(callbacks=[...])")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise DPPluginError(
            f"{who}: model {model.name!r} is not compiled, so it has no optimizer to "
            "distribute; call model.compile(optimizer=..., loss=...) before model.fit"
        )
    if not runtime.is_initialized():
        raise NotInitializedError(who)
    check_strategy(model.distribute_strategy, f"{who} (model {model.name!r})")
    return model


def _rebuild_train_function(model: Any, hook: DistributedApply | None, changed: bool,
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


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
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
        _check_equal_steps(self.params.get("steps"), self._who)
        changed = self._install(model.optimizer)
        _rebuild_train_function(model, find_hook(model.optimizer)[1], changed, self._who)
        if model.built:
            with calling(self._who):
                broadcast_model_state(model, self.root_rank)
            return
        warnings.warn(
            f"{self._who}: model {model.name!r} has no weights before its first batch, so "
            f"they are broadcast from rank {self.root_rank} after it; the first step starts "
            "from different weights on each rank. Build the model first (keras.Input, or "
            "model.build(input_shape)) to start from equal weights",
            stacklevel=2,
        )
        self._pending = True

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._pending:
            self._pending = False
            with calling(self._who):
                broadcast_model_state(self.model, self.root_rank)

    def _install(self, optimizer: Any) -> bool:
        """Move ``DistributedOptimizer``'s reduction onto a ``LossScaleOptimizer`` that
        ``compile()`` (``mixed_float16``) wrapped around it, whose overflow check
        would else run before the reduction (see ``optimizer``); True if it moved
        (the step must be retraced)."""
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or hook_of(optimizer):
            return False
        target, hook = find_hook(optimizer)
        if hook is None:
            return False
        moved = DistributedApply(
            optimizer, hook.bridge, owner=hook.owner,
            backward_passes_per_step=hook.backward_passes_per_step,
            average_aggregated_gradients=hook.average_aggregated_gradients,
            sparse_as_dense=hook.sparse_as_dense,
        )
        install(optimizer, moved, replacing=target)
        return True


def _check_equal_steps(steps: int | None, who: str) -> None:
    """Refuse, on every rank before the first step, a ``fit`` whose ranks have
    different numbers of batches per epoch (``steps``: Keras's count, None where
    the data's length is unknown): the rank with more would wait in an
    all-reduce that the others never start. Collective."""
    counts = allgather_object(steps, name="dp_plugin.keras.steps")
    known = [c for c in counts if c is not None]
    if len(set(known)) <= 1:
        return
    each = "; ".join(f"rank {r}: {c if c is not None else 'unknown'}"
                     for r, c in enumerate(counts))
    raise ValueError(
        f"{who}: the ranks have different numbers of batches per epoch ({each}), so a "
        "rank would wait at the end of the epoch in an all-reduce the others never start. "
        f"Give every rank the same number: pass steps_per_epoch={min(known)} to fit (the "
        "smallest), or make the shards equal: dp.shard(dataset) before batching, and "
        "dataset.batch(n, drop_remainder=True) or dataset.take(k) to drop the remainder")


class DistributedCallback(BroadcastGlobalVariablesCallback):
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
        parse_reduction(self._who, op, compression, backward_passes_per_step,
                        gradient_predivide_factor)
        self._settings: dict[str, Any] = dict(
            compression=compression, op=op, backward_passes_per_step=backward_passes_per_step,
            gradient_predivide_factor=gradient_predivide_factor,
            average_aggregated_gradients=average_aggregated_gradients,
            sparse_as_dense=sparse_as_dense,
        )

    def _install(self, optimizer: Any) -> bool:
        """Install (or keep) the reduction in ``optimizer``; True if the step must be retraced."""
        target, existing = find_hook(optimizer)
        if existing is not None and existing.owner != self._who:
            raise ValueError(
                f"{self._who}: optimizer {target.name!r} was wrapped by "
                f"dp.{existing.owner}, so it already reduces gradients across workers and "
                "the callback would reduce them twice. Use either DistributedCallback with "
                "the plain optimizer, or DistributedOptimizer with "
                "BroadcastGlobalVariablesCallback"
            )
        hook = make_hook(optimizer, owner=self._who, **self._settings)
        if existing is not None and target is optimizer and existing.same_settings(hook):
            return False  # installed by an earlier fit: its traced step is still right
        install(optimizer, hook, replacing=target if existing is not None else None)
        return True


__all__ = [
    "BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "DistributedCallback",
    "LearningRateScheduleCallback", "LearningRateWarmupCallback", "MetricAverageCallback",
]
