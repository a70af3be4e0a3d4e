"""Learning-rate callbacks on TensorFlow: Keras 3's (``dp_plugin.keras.callbacks_lr``),
with the momentum made a run-time value that the compiled step reads.

``LearningRateScheduleCallback`` and ``LearningRateWarmupCallback`` are one
implementation for every Keras backend; what is TensorFlow's alone is here:
``dynamic_momentum``, which they call for momentum correction.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import keras

import tensorflow as tf
from dp_plugin.keras.callbacks_lr import LearningRateScheduleCallback, LearningRateWarmupCallback

# Optimizers whose compiled step turns ``momentum`` into a tensor (ops.cast /
# ops.multiply) and only compares it with 0 in Python, so a
# ``_DynamicMomentum`` changes what the step computes. Others would keep the
# value traced at the first step, so they get a warning instead.
_MOMENTUM_CORRECTABLE = (keras.optimizers.SGD, keras.optimizers.RMSprop)


class _DynamicMomentum(float):
    """A Python float whose value inside compiled steps is read from a variable.

    Keras 3 optimizers keep ``momentum`` as a plain float, which the compiled
    train step folds in as a constant when ``fit`` traces it: assigning
    ``optimizer.momentum`` later changes nothing. This float keeps every
    Python use at the constructor's value (``momentum != 0`` checks,
    ``get_config``, serialization), while TensorFlow converts it through
    ``__tf_tensor__`` into a read of ``variable``, so ``set`` takes effect at
    the next step without retracing. ``dtype = float`` makes Keras's dtype
    promotion treat it as the weakly typed Python float it replaces.
    """

    dtype = float
    variable: tf.Variable

    def __new__(cls, value: float) -> _DynamicMomentum:
        self = super().__new__(cls, value)
        # float64 holds the Python float exactly; casting it to the step's
        # dtype rounds as converting the Python float would.
        with tf.init_scope():
            self.variable = tf.Variable(
                float(value), trainable=False, dtype=tf.float64, name="dp_plugin_momentum"
            )
        return self

    def __tf_tensor__(self, dtype: Any = None, name: str | None = None) -> tf.Tensor:
        value = self.variable.read_value()
        return value if dtype is None else tf.cast(value, dtype, name=name)

    def get(self) -> float:
        return float(self.variable.numpy())

    def set(self, value: float) -> None:
        self.variable.assign(value)


def dynamic_momentum(optimizer: Any, who: str) -> tuple[_DynamicMomentum | None, bool]:
    """The run-time momentum of ``optimizer`` (installed on first use), or None
    when it has no momentum to correct; and whether it was installed now."""
    while hasattr(optimizer, "inner_optimizer"):  # LossScaleOptimizer
        optimizer = optimizer.inner_optimizer
    momentum = getattr(optimizer, "momentum", None)
    if isinstance(momentum, _DynamicMomentum):
        return momentum, False
    if momentum is None or (isinstance(momentum, numbers.Real) and momentum == 0):
        return None, False  # nothing to correct
    if not isinstance(optimizer, _MOMENTUM_CORRECTABLE) or not isinstance(momentum, float):
        warnings.warn(
            f"{who}: momentum correction is not applied to {type(optimizer).__name__} "
            f"(momentum={momentum!r}): only SGD and RMSprop read their momentum in a way it "
            "can be changed between steps; pass momentum_correction=False to silence this",
            stacklevel=3,
        )
        return None, False
    dynamic = _DynamicMomentum(momentum)
    optimizer.momentum = dynamic
    return dynamic, True


__all__ = ["LearningRateScheduleCallback", "LearningRateWarmupCallback", "dynamic_momentum"]
