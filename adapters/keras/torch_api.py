"""``dp_plugin.keras`` on the torch backend (``KERAS_BACKEND=torch``).

The same Keras names as on TensorFlow (``DistributedCallback``,
``DistributedOptimizer``, ``BroadcastGlobalVariablesCallback``,
``SyncBatchNormalization``, ...), built on the torch adapter: the gradients
go through ``dp_plugin.torch``'s fused, overlapped reduction (see
``torch_optimizer``). The process-level API and the tensor collectives are
``dp_plugin.torch``'s (on torch tensors). TensorFlow is never imported.
"""

from dp_plugin.api import horovod_api as _api
from dp_plugin.api.horovod_api import *  # noqa: F403 - ops, process sets, capabilities
from dp_plugin.errors import LayoutMismatchError, NotInitializedError
from dp_plugin.keras import torch_callbacks as callbacks
from dp_plugin.keras.callbacks_lr import LearningRateScheduleCallback, LearningRateWarmupCallback
from dp_plugin.keras.metric_average import MetricAverageCallback
from dp_plugin.keras.torch_callbacks import (
    BroadcastGlobalVariablesCallback,
    DistributedCallback,
)
from dp_plugin.keras.torch_optimizer import DistributedOptimizer
from dp_plugin.keras.torch_sync_batch_norm import SyncBatchNormalization
from dp_plugin.torch import (
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    cross_rank,
    cross_size,
    cuda_built,
    grouped_allreduce,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_threads_supported,
    nccl_built,
    rank,
    reducescatter,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "DistributedCallback",
    "DistributedOptimizer",
    "LayoutMismatchError",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "NotInitializedError",
    "SyncBatchNormalization",
    "allgather",
    "allgather_object",
    "allreduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "callbacks",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "grouped_allreduce",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
__all__ += _api.__all__
