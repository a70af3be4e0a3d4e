"""What the adapter relies on in Keras and tf.distribute, checked before it is used.

The adapter depends on one behaviour of Keras 3's TensorFlow optimizer that is
not public API: ``Optimizer.apply`` sums the gradients of the local replicas
(``keras/src/backend/tensorflow/optimizer.py``, ``_all_reduce_sum_gradients``,
called from ``_backend_update_step``) before it updates the variables. The
bridge (``dp_plugin.tensorflow.bridge``) hands that sum the cross-worker
result on the first replica and zeros on the others. The Keras versions below
are the ones whose sources were checked for it (3.15.1 is the one tested);
any other version is refused with ``UnsupportedKerasError`` rather than
risking a silently wrong gradient.

With ``jit_compile=True`` (``xla_split``) it also relies on
``make_train_function`` reading ``model.train_step`` and ``model.jit_compile``
when it builds the function (``keras/src/backend/tensorflow/trainer.py``); were
``train_step`` read later, the step would run unsplit without XLA (still
correct, only slower).
"""

from __future__ import annotations

import re
from typing import Any

from dp_plugin.errors import DPPluginError

SUPPORTED_KERAS = ((3, 3), (3, 16))
"""``[min, max)`` of Keras (major, minor) versions the adapter supports."""

SUPPORTED_KERAS_SPEC = "keras>=3.3,<3.16"


class UnsupportedKerasError(DPPluginError):
    """The installed Keras (version or backend) is not one the adapter supports."""


class UnsupportedStrategyError(DPPluginError):
    """The model lives under a tf.distribute strategy the adapter cannot combine with."""


def check_keras(keras_module: Any = None) -> None:
    """Raise ``UnsupportedKerasError`` unless Keras is a supported 3.x on TensorFlow.

    ``keras_module`` defaults to the installed ``keras`` (tests pass a stand-in).
    """
    if keras_module is None:
        import keras

        keras_module = keras
    version = str(getattr(keras_module, "__version__", "unknown"))
    match = re.match(r"\s*(\d+)\.(\d+)", version)  # '3.15.1', '3.16.0.dev2025'
    if match is None:
        raise UnsupportedKerasError(
            f"cannot read the Keras version {version!r}; dp_plugin.tensorflow needs "
            f"{SUPPORTED_KERAS_SPEC}"
        )
    low, high = SUPPORTED_KERAS
    if not low <= (int(match.group(1)), int(match.group(2))) < high:
        raise UnsupportedKerasError(
            f"Keras {version} is not supported by dp_plugin.tensorflow, which needs "
            f"{SUPPORTED_KERAS_SPEC}: it relies on the TensorFlow optimizer summing the "
            "local replicas' gradients inside apply() (Keras's private "
            "_all_reduce_sum_gradients), which was checked only for those versions. "
            f"Install a supported Keras, e.g. pip install '{SUPPORTED_KERAS_SPEC}'"
        )
    backend = keras_module.backend.backend()
    if backend != "tensorflow":
        raise UnsupportedKerasError(
            f"Keras runs on the {backend!r} backend, but dp_plugin.tensorflow needs the "
            "TensorFlow backend; set KERAS_BACKEND=tensorflow before importing keras "
            "(for PyTorch use dp_plugin.torch)"
        )


def check_strategy(strategy: Any, what: str) -> None:
    """Refuse strategies whose own cross-worker reduction would conflict with ours.

    Supported: the default strategy, ``OneDeviceStrategy`` and
    ``MirroredStrategy`` (replicas inside this process; the plugin adds the
    cross-worker step).
    """
    import tensorflow as tf

    name = type(strategy).__name__
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        raise UnsupportedStrategyError(
            f"{what}: the model was built under MultiWorkerMirroredStrategy ({name}), "
            "which already all-reduces gradients across workers; dp_plugin would reduce "
            "them a second time. Build the model under tf.distribute.MirroredStrategy() "
            "(the devices of this process) or no strategy, and let dp_plugin do the "
            "cross-worker step"
        )
    if isinstance(strategy, tf.distribute.MirroredStrategy | tf.distribute.OneDeviceStrategy):
        return
    if not tf.distribute.has_strategy() and strategy is tf.distribute.get_strategy():
        return  # the default strategy (a singleton)
    raise UnsupportedStrategyError(
        f"{what}: the model was built under {name}, which dp_plugin does not support; "
        "use the default strategy, OneDeviceStrategy or MirroredStrategy"
    )
