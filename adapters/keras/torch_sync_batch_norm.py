"""Keras 3 on the torch backend: ``SyncBatchNormalization``.

As on TensorFlow (and Horovod 0.28.1): in training, each rank's batch mean
and mean of squares are averaged over the ranks of the process set, in one
fused all-reduce of the torch adapter (``dp_plugin.torch.grouped_allreduce``,
through which the gradient flows, averaged over the ranks), and the variance
is ``mean(x^2) - mean(x)^2`` of those averages: every rank normalizes with
the statistics of the global batch (ranks weigh equally: use equal per-rank
batch sizes). Inference uses the moving statistics, which every rank updates
identically. Everything else is Keras 3's ``BatchNormalization``.

Distributed contract: every rank of the set calls the layer in training mode
at the same steps (each call is a collective).
"""

from __future__ import annotations

from typing import Any

import dp_plugin.torch as _torch_dp
import keras
from dp_plugin.edge import calling
from dp_plugin.engines.base import ReduceOp
from dp_plugin.process_sets import engine_of, global_process_set


@keras.saving.register_keras_serializable(package="dp_plugin")
class SyncBatchNormalization(keras.layers.BatchNormalization):
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
        group_mean, group_mean_of_square = _torch_dp.grouped_allreduce(
            [mean, variance + mean * mean], op=ReduceOp.AVERAGE, process_set=self.process_set,
            name="sync_batch_norm")
        return group_mean, group_mean_of_square - group_mean * group_mean
