"""``SyncBatchNormalization``: batch normalization with statistics over every rank's batch.

Horovod 0.28.1's layer on Keras 3 (``dp_plugin.keras.base_sync_batch_norm``:
the statistics of the global batch, through one fused all-reduce of the
TensorFlow adapter). Everything else is Keras 3's ``BatchNormalization``
(same arguments, saving, masks).

Keras 2 arguments. Horovod's layer subclassed Keras 2's
``BatchNormalization``, whose ``fused``, ``virtual_batch_size`` and
``adjustment`` Keras 3 removed (it refuses unknown keyword arguments), so a
Horovod script passing them would fail here. They are taken and dropped:

- ``fused=False`` (Horovod's default, and the only value its layer allowed)
  is what Keras 3 always computes (the unfused moments, the biased batch
  variance in the moving variance); ``fused=True`` or ``None`` raise
  Horovod's ``ValueError``, as its layer did;
- ``virtual_batch_size`` and ``adjustment`` other than ``None`` would have
  changed the statistics (ghost batches, a scale/offset adjustment) and
  Keras 3 has no equivalent: a ``UserWarning`` says so, once per process,
  and the layer normalizes with the statistics of the whole global batch.

Distributed contract: every rank of the set calls the layer in training mode
at the same steps (each call is a collective).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import keras

from dp_plugin.api.process_sets import global_process_set
from dp_plugin.engines.base import ReduceOp
from dp_plugin.keras.base_sync_batch_norm import SyncBatchNormBase
from dp_plugin.tensorflow.collectives import grouped_allreduce

_warned: set[str] = set()  # Keras 2 arguments already warned about in this process
_warned_lock = threading.Lock()


def _warn_once(argument: str, value: Any, effect: str) -> None:
    with _warned_lock:
        if argument in _warned:
            return
        _warned.add(argument)
    warnings.warn(
        f"SyncBatchNormalization: {argument}={value!r} is ignored: it is a Keras 2 argument "
        f"({effect}) that Keras 3 removed; the layer normalizes with the statistics of the "
        f"whole global batch. Drop {argument}= to silence this warning",
        UserWarning, stacklevel=4)


@keras.saving.register_keras_serializable(package="dp_plugin")
class SyncBatchNormalization(SyncBatchNormBase):
    """Keras 3 ``BatchNormalization`` whose batch statistics are all-reduced across ranks.

    Also takes Horovod's (Keras 2) ``fused=False``, ``virtual_batch_size`` and
    ``adjustment`` (module docstring).
    """

    def __init__(self, *args: Any, process_set: Any = global_process_set, fused: Any = False,
                 virtual_batch_size: Any = None, adjustment: Any = None,
                 **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")  # Horovod's
        if fused is not False:
            raise TypeError(f"SyncBatchNormalization: fused takes False, got {fused!r}")
        if virtual_batch_size is not None:
            _warn_once("virtual_batch_size", virtual_batch_size,
                       "ghost batch normalization over sub-batches of that size")
        if adjustment is not None:
            _warn_once("adjustment", adjustment, "a scale and offset applied to the "
                       "normalized batch")
        super().__init__(*args, process_set=process_set, **kwargs)

    def _grouped_average(self, tensors: list[Any]) -> list[Any]:
        return grouped_allreduce(tensors, op=ReduceOp.AVERAGE, process_set=self.process_set,
                                 name="sync_batch_norm")
