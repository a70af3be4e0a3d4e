"""Keras 3 on the torch backend: ``SyncBatchNormalization``.

As on TensorFlow (``base_sync_batch_norm``): the batch statistics are
averaged over the ranks of the process set in one fused all-reduce of the
torch adapter (``dp_plugin.torch.grouped_allreduce``, through which the
gradient flows, averaged over the ranks).

Distributed contract: every rank of the set calls the layer in training mode
at the same steps (each call is a collective).
"""

from __future__ import annotations

from typing import Any

import dp_plugin.torch as _torch_dp
import keras
from dp_plugin.engines.base import ReduceOp
from dp_plugin.keras.base_sync_batch_norm import SyncBatchNormBase


@keras.saving.register_keras_serializable(package="dp_plugin")
class SyncBatchNormalization(SyncBatchNormBase):
    """Keras 3 ``BatchNormalization`` whose batch statistics are all-reduced across ranks."""

    def _grouped_average(self, tensors: list[Any]) -> list[Any]:
        return _torch_dp.grouped_allreduce(tensors, op=ReduceOp.AVERAGE,
                                           process_set=self.process_set,
                                           name="sync_batch_norm")
