"""``SyncBatchNormalization``: batch normalization with statistics over every rank's batch.

As Horovod 0.28.1's: in training, each rank's batch mean and mean of squares
are averaged over the ranks of the process set (one fused all-reduce), and
the variance is ``mean(x^2) - mean(x)^2`` of those averages, so every rank
normalizes with the statistics of the global batch (ranks weigh equally:
use equal per-rank batch sizes). The gradient flows through the all-reduce
(Horovod's: averaged over the ranks). Inference uses the moving statistics,
which every rank updates identically. Everything else is Keras 3's
``BatchNormalization`` (same arguments, saving, masks).

Distributed contract: every rank of the set calls the layer in training mode
at the same steps (each call is a collective).
"""

from __future__ import annotations

from typing import Any

import keras

import tensorflow as tf
from dp_plugin.edge import calling
from dp_plugin.engines.base import ReduceOp
from dp_plugin.process_sets import engine_of, global_process_set
from dp_plugin.tensorflow.collectives import grouped_allreduce


@keras.saving.register_keras_serializable(package="dp_plugin")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Keras 3 ``BatchNormalization`` whose batch statistics are all-reduced across ranks."""

    def __init__(self, *args: Any, process_set: Any = global_process_set, **kwargs: Any) -> None:
        if kwargs.get("synchronized"):
            raise ValueError(
                "SyncBatchNormalization: synchronized=True is Keras's tf.distribute "
                "synchronization; leave it False, this layer synchronizes across dp_plugin ranks"
            )
        super().__init__(*args, **kwargs)
        self.process_set = process_set

    def _moments(self, inputs: Any, mask: Any) -> Any:
        mean, variance = super()._moments(inputs, mask)
        with calling("SyncBatchNormalization"):
            size = engine_of(self.process_set).size
        if size == 1:
            return mean, variance
        mean_of_square = variance + tf.math.square(mean)
        group_mean, group_mean_of_square = grouped_allreduce(
            [mean, mean_of_square], op=ReduceOp.AVERAGE, process_set=self.process_set,
            name="sync_batch_norm")
        return group_mean, group_mean_of_square - tf.math.square(group_mean)
