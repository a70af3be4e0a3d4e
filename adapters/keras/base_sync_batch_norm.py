"""``SyncBatchNormalization``'s body, for every Keras backend.

As Horovod 0.28.1's: in training, each rank's batch mean and mean of squares
are averaged over the ranks of the process set (one fused all-reduce), and
the variance is ``mean(x^2) - mean(x)^2`` of those averages, so every rank
normalizes with the statistics of the global batch (ranks weigh equally:
use equal per-rank batch sizes). The gradient flows through the all-reduce
(averaged over the ranks). Inference uses the moving statistics, which every
rank updates identically. Everything else is Keras 3's ``BatchNormalization``.

A backend's layer (``dp_plugin.tensorflow.sync_batch_norm``,
``dp_plugin.keras.torch_sync_batch_norm``) supplies the fused all-reduce,
``_grouped_average``.

Distributed contract: every rank of the set calls the layer in training mode
at the same steps (each call is a collective).
"""

from __future__ import annotations

from typing import Any

import keras
from dp_plugin.agree.edge import calling
from dp_plugin.api.process_sets import engine_of, global_process_set


class SyncBatchNormBase(keras.layers.BatchNormalization):
    """Keras 3 ``BatchNormalization`` whose batch statistics are all-reduced across ranks."""

    def __init__(self, *args: Any, process_set: Any = global_process_set, **kwargs: Any) -> None:
        if kwargs.get("synchronized"):
            raise ValueError(
                "SyncBatchNormalization: synchronized=True is Keras's tf.distribute "
                "synchronization; leave it False, this layer synchronizes across dp_plugin ranks")
        super().__init__(*args, **kwargs)
        self.process_set = process_set

    def _moments(self, inputs: Any, mask: Any) -> Any:
        mean, variance = super()._moments(inputs, mask)
        with calling("SyncBatchNormalization"):
            size = engine_of(self.process_set).size
        if size == 1:
            return mean, variance
        group_mean, group_mean_of_square = self._grouped_average(
            [mean, variance + keras.ops.square(mean)])
        return group_mean, group_mean_of_square - keras.ops.square(group_mean)

    def _grouped_average(self, tensors: list[Any]) -> list[Any]:
        """*Backend*: ``tensors`` averaged over the process set, in one fused
        all-reduce through which the gradient flows."""
        raise NotImplementedError
