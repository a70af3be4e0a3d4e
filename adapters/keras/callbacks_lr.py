"""Learning-rate schedule and warmup callbacks with Horovod's semantics, for Keras 3.

``LearningRateScheduleCallback`` and ``LearningRateWarmupCallback`` behave as
``horovod.keras.callbacks``'s (0.28.1): the learning rate is
``initial_lr * multiplier(epoch)``, set at the first batch of each epoch
(staircase) or at every batch with a fractional epoch (smooth), and the
momentum is corrected for the batch in which the learning rate changes
("Accurate, Large Minibatch SGD", Goyal et al., 2017,
https://arxiv.org/abs/1706.02677). Horovod's versions target Keras 2
hyper-parameters; here the learning rate is the Keras 3 optimizer's
``learning_rate`` variable, and how the momentum is changed on each backend
is in ``LearningRateScheduleCallback``. One module for both backends.

Neither callback communicates: every rank computes the same learning rate
from the same epoch and batch numbers, provided all ranks run the same
number of steps per epoch.
"""

from __future__ import annotations

import importlib
import numbers
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import keras
from dp_plugin.validate import check_int, check_positive_float

Multiplier = Callable[[float], float]


class Momentum(Protocol):
    """An optimizer's momentum as a value the next train step reads."""

    def get(self) -> float: ...

    def set(self, value: float) -> None: ...


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` between two epochs.

    Between ``start_epoch`` (inclusive) and ``end_epoch`` (exclusive) the
    optimizer's learning rate becomes ``initial_lr * multiplier(epoch)``;
    outside it is left alone. The optimizer must have been created with a
    float learning rate (not a ``LearningRateSchedule``). Every epoch's logs
    get ``'lr'``, the learning rate at the end of the epoch.

    On TensorFlow, Keras 3 keeps ``momentum`` as a Python float that the
    compiled train step would freeze, so for momentum correction the first
    fit with this callback replaces ``optimizer.momentum`` by an equal float
    backed by a variable (its config and serialization are unchanged) and
    lets ``fit`` trace the train step again if it had been traced before. On
    torch the step reads ``optimizer.momentum`` each time: it is set directly.

    Distributed contract: none; no collectives. Every rank sets the same
    learning rate as long as all ranks run the same epochs and batches.

    Args:
        initial_lr: the learning rate the multiplier scales (required, > 0).
        multiplier: a function ``f(epoch) -> float``, or a constant ``c`` for
            exponential decay, ``c ** (epoch - start_epoch)``.
        start_epoch: first epoch adjusted. Defaults to 0.
        end_epoch: first epoch no longer adjusted; ``None`` for no end.
        staircase: True: adjusted at the first batch of each epoch, with an
            integer ``epoch``; False: before every batch, with the fractional
            ``epoch + batch / steps_per_epoch``.
        momentum_correction: with an optimizer with momentum (``SGD``,
            ``RMSprop``; also under a mixed-precision ``LossScaleOptimizer``),
            multiply the momentum by ``new_lr / old_lr`` for the batch in which
            the learning rate changes and restore it after, as Horovod does.
        steps_per_epoch: batches per epoch for ``staircase=False``; when
            ``None``, what ``fit`` knows (``self.params['steps']``), which it
            does not for a generator or a dataset of unknown length without
            its own ``steps_per_epoch``.
    """

    def __init__(
        self,
        initial_lr: float,
        multiplier: float | Multiplier,
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if initial_lr is None:
            raise ValueError(
                f"{name}: parameter `initial_lr` is required; pass the learning rate the "
                "schedule starts from (usually the base learning rate times dp.size())"
            )
        check_positive_float("initial_lr", initial_lr, where=name)
        check_int("start_epoch", start_epoch, minimum=0, where=name)
        if end_epoch is not None:
            check_int("end_epoch", end_epoch, minimum=0, where=name)
            if end_epoch <= start_epoch:
                raise ValueError(
                    f"{name}: end_epoch={end_epoch} must be greater than start_epoch="
                    f"{start_epoch} (end_epoch is exclusive), or None for no end"
                )
        if steps_per_epoch is not None:
            check_int("steps_per_epoch", steps_per_epoch, minimum=1, where=name)
        self.multiplier: Multiplier
        if callable(multiplier):
            self.multiplier = multiplier
        elif isinstance(multiplier, numbers.Real) and not isinstance(multiplier, bool):
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor ** (epoch - start_epoch)
        else:
            raise TypeError(
                f"{name}: multiplier={multiplier!r} is neither a number nor a function; pass "
                "a constant (exponential decay) or f(epoch) -> float"
            )
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = bool(staircase)
        self.momentum_correction = bool(momentum_correction)
        self.steps_per_epoch = steps_per_epoch
        self._given_steps_per_epoch = steps_per_epoch
        self.current_epoch: int | None = None
        self.restore_momentum: float | None = None
        self._momentum: Momentum | None = None
        self._momentum_of: Any = None  # the optimizer self._momentum was looked up for

    # -- Keras hooks ----------------------------------------------------------
    def set_model(self, model: Any) -> None:
        super().set_model(model)
        # fit() calls this before it builds its train function: installing the
        # dynamic momentum here lets a model whose train step was already
        # traced (an earlier fit) get it traced again, before any callback's
        # on_train_begin runs.
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and self._prepare_momentum(optimizer):
            model.train_function = None  # fit() builds it again next

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        optimizer = self._optimizer()
        if not isinstance(optimizer.learning_rate, keras.Variable):
            raise TypeError(
                f"{type(self).__name__} sets the learning rate, but "
                f"{type(optimizer).__name__}'s learning_rate is "
                f"{optimizer.learning_rate!r}, which cannot be set (a LearningRateSchedule or "
                "a callable); create the optimizer with a float learning_rate"
            )
        if self._prepare_momentum(optimizer):
            # set_model saw no optimizer: retrace in case the step was traced.
            self.model.make_train_function(force=True)
        # Detected at each fit (``_steps``): a later fit may have another number of steps.
        self.steps_per_epoch = self._given_steps_per_epoch

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        epoch = self.current_epoch
        if epoch is None or epoch < self.start_epoch or (
            self.end_epoch is not None and epoch >= self.end_epoch
        ):
            return  # outside the adjusted epochs
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(epoch)
        else:
            self._adjust_learning_rate(epoch + float(batch) / self._steps())

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # Overriding this hook also keeps Keras from dispatching batch-end
        # callbacks on a thread: the momentum must be restored before the next
        # train step starts.
        if self.restore_momentum is not None and self._momentum is not None:
            self._momentum.set(self.restore_momentum)
        self.restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = self._current_lr()

    # -- internals ------------------------------------------------------------
    def _optimizer(self) -> Any:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None:
            raise ValueError(
                f"{type(self).__name__} needs a compiled model; call model.compile(optimizer, "
                "loss) before fit"
            )
        return optimizer

    def _prepare_momentum(self, optimizer: Any) -> bool:
        """Find (or install) ``optimizer``'s run-time momentum once per optimizer;
        True when it was installed now, so a traced train step must be retraced."""
        if not self.momentum_correction or optimizer is self._momentum_of:
            return False
        self._momentum_of = optimizer
        self._momentum, installed = _momentum(optimizer, type(self).__name__)
        return installed

    def _current_lr(self) -> float:
        return float(self._optimizer().learning_rate)

    def _adjust_learning_rate(self, epoch: float) -> None:
        old_lr = self._current_lr()
        new_lr = self.initial_lr * float(self.multiplier(epoch))
        # The setter assigns the variable (through a LossScaleOptimizer too).
        self._optimizer().learning_rate = new_lr
        # A learning rate of 0 gives no ratio to scale the velocity by; Horovod
        # would divide by zero, this leaves the momentum as it is.
        if self._momentum is not None and old_lr != 0.0:
            self.restore_momentum = self._momentum.get()
            self._momentum.set(self.restore_momentum * new_lr / old_lr)

    def _steps(self) -> int:
        if self.steps_per_epoch:
            return self.steps_per_epoch
        params = self.params or {}
        if params.get("steps"):
            self.steps_per_epoch = int(params["steps"])
        elif params.get("samples") and params.get("batch_size"):
            self.steps_per_epoch = int(params["samples"]) // int(params["batch_size"])
        else:
            raise ValueError(
                "Could not autodetect the number of steps per epoch. Please specify the "
                f"steps_per_epoch parameter to the {type(self).__name__}(): fit() does not "
                "know it for a generator or a dataset of unknown length unless it gets "
                "steps_per_epoch itself"
            )
        return self.steps_per_epoch


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warmup from ``initial_lr / size()`` to ``initial_lr`` over ``warmup_epochs``.

    Goyal et al. (https://arxiv.org/abs/1706.02677), as Horovod implements
    it: before every batch of the first ``warmup_epochs`` epochs, with
    ``e = epoch + (batch + 1) / steps_per_epoch`` and ``n = dp.size()``::

        lr = initial_lr / n * (e * (n - 1) / warmup_epochs + 1)

    so the learning rate grows linearly from about ``initial_lr / n`` at the
    first batch to exactly ``initial_lr`` at the last batch of the warmup.
    Afterwards it is left alone (add a ``LearningRateScheduleCallback`` with
    ``start_epoch=warmup_epochs`` to continue). Momentum correction as in
    ``LearningRateScheduleCallback``. With ``verbose > 0`` rank 0 prints a
    line when the warmup ends.

    Distributed contract: none; reads ``dp.size()`` and ``dp.rank()``, so
    ``dp.init()`` must have run.

    Args:
        initial_lr: the learning rate at the end of the warmup (> 0).
        warmup_epochs: length of the warmup in epochs (>= 1). Defaults to 5.
        momentum_correction: scale the momentum in the batch of a change.
        steps_per_epoch: batches per epoch; autodetected from ``fit`` when ``None``.
        verbose: 0 (silent) or 1 (announce the end of the warmup on rank 0).
    """

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        check_int("warmup_epochs", warmup_epochs, minimum=1, where=type(self).__name__)
        super().__init__(
            initial_lr, self._warmup_multiplier, start_epoch=0, end_epoch=warmup_epochs,
            staircase=False, momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def _warmup_multiplier(self, epoch: float) -> float:
        # One batch ahead, so that the last batch of each epoch lands on a
        # round value (Horovod does the same, for TensorBoard's sake).
        epoch += 1.0 / self._steps()
        size = int(_dp().size())
        return 1.0 / size * (epoch * (size - 1) / self.warmup_epochs + 1)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and int(_dp().rank()) == 0:
            print(
                f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                f"{self._current_lr():g}."
            )


class _EagerMomentum:
    """``optimizer.momentum`` itself: Keras's torch optimizers read it at every
    step (the step runs eagerly), so setting it takes effect at the next one."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def get(self) -> float:
        return float(self.optimizer.momentum)

    def set(self, value: float) -> None:
        self.optimizer.momentum = value


def _momentum(optimizer: Any, who: str) -> tuple[Momentum | None, bool]:
    """The momentum of ``optimizer`` to correct, or None when it has none; and
    whether the train step must be traced again (TensorFlow installed a
    run-time momentum now)."""
    if keras.backend.backend() == "tensorflow":
        tf_lr = importlib.import_module("dp_plugin.tensorflow.callbacks_lr")
        return tf_lr.dynamic_momentum(optimizer, who)
    while hasattr(optimizer, "inner_optimizer"):  # LossScaleOptimizer
        optimizer = optimizer.inner_optimizer
    momentum = getattr(optimizer, "momentum", None)
    if momentum is None or (isinstance(momentum, numbers.Real) and momentum == 0):
        return None, False  # nothing to correct
    if not isinstance(momentum, numbers.Real):
        warnings.warn(
            f"{who}: momentum correction is not applied to {type(optimizer).__name__} "
            f"(momentum={momentum!r}, not a number); pass momentum_correction=False to "
            "silence this", stacklevel=3)
        return None, False
    return _EagerMomentum(optimizer), False


def _dp() -> Any:
    """The backend's adapter (``dp_plugin.tensorflow`` or ``dp_plugin.torch``), for
    ``size()`` and ``rank()``; imported when first used: the TensorFlow adapter
    re-exports this module."""
    backend = keras.backend.backend()
    return importlib.import_module("dp_plugin.tensorflow" if backend == "tensorflow"
                                   else "dp_plugin.torch")
