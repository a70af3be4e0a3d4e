"""``dp_plugin.keras`` on the TensorFlow backend: ``dp_plugin.tensorflow``, Horovod-Keras style.

Horovod spells its Keras entry ``import horovod.tensorflow.keras as hvd``
(or ``horovod.keras``); this is the same entry for dp_plugin. Everything is
``dp_plugin.tensorflow``'s, except the four tensor functions that
``horovod.tensorflow.keras`` defines with its own signatures
(``allreduce(value, name, average, prescale_factor, postscale_factor, op,
compression)``, ``allgather(value, name)``, ``broadcast(value, root_rank,
name)``, ``reducescatter(value, name, op)``): they take any tensor-like
value and, eagerly, return numpy arrays as Horovod's do (tensors inside
``tf.function``).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from dp_plugin.api.horovod_names import Average as _Average
from dp_plugin.api.horovod_names import Compression as _Compression
from dp_plugin.tensorflow import *  # noqa: F403 - this module is an alias
from dp_plugin.tensorflow import __all__ as __all__
from dp_plugin.tensorflow import collectives as _c


def _value(result: Any) -> Any:
    return result.numpy() if tf.executing_eagerly() else result


def allreduce(value: Any, name: str | None = None, average: Any = None,  # type: ignore[no-redef]
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Any = None,
              compression: Any = _Compression.none) -> Any:
    """Average (default) ``value`` over all ranks; a numpy array when eager."""
    return _value(_c.allreduce(tf.convert_to_tensor(value), average=average, name=name, op=op,
                               prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor, compression=compression))


def allgather(value: Any, name: str | None = None) -> Any:  # type: ignore[no-redef]
    """Concatenate every rank's ``value`` along the first dimension; numpy when eager."""
    return _value(_c.allgather(tf.convert_to_tensor(value), name=name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:  # type: ignore[no-redef]
    """``root_rank``'s ``value`` on every rank; numpy when eager."""
    return _value(_c.broadcast(tf.convert_to_tensor(value), root_rank, name=name))


def reducescatter(value: Any, name: str | None = None, op: Any = _Average) -> Any:  # type: ignore[no-redef]
    """Reduce ``value`` (Average by default) and keep this rank's rows; numpy when eager."""
    return _value(_c.reducescatter(tf.convert_to_tensor(value), name=name, op=op))
