"""dp_plugin.torch: a drop-in for ``horovod.torch`` 0.28.1 on PyTorch 2.x.

Change ``import horovod.torch as hvd`` to ``import dp_plugin.torch as hvd``;
the names below are horovod.torch's public API, with its signatures and
semantics (differences are stated in each function's docstring).
``HorovodInternalError`` (Horovod's error for a failed collective) is
dp_plugin's base error, ``DPPluginError``: every error dp_plugin raises on
purpose is one. ``hvd.elastic`` is ``horovod.torch.elastic``'s API
(``TorchState``, ``ElasticSampler``, ``run``) for restarts under
``torchrun --max-restarts``; see docs/elastic.md.
"""

from dp_plugin.api import horovod_api as _api
from dp_plugin.api.horovod_api import *  # noqa: F403 - ops, process sets, capabilities
from dp_plugin.errors import DPPluginError as HorovodInternalError
from dp_plugin.errors import NonFiniteGradientError
from dp_plugin.torch import elastic
from dp_plugin.torch.autograd_ops import (
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    reducescatter,
)
from dp_plugin.torch.basics import (
    NotInitializedError,
    cross_rank,
    cross_size,
    cuda_built,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from dp_plugin.torch.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from dp_plugin.torch.collectives import (
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    reducescatter_async,
)
from dp_plugin.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from dp_plugin.torch.handles import poll, synchronize
from dp_plugin.torch.joining import join
from dp_plugin.torch.optimizer import DistributedOptimizer
from dp_plugin.torch.optimizer_state import SynchronizationError
from dp_plugin.torch.sparse import sparse_allreduce_async
from dp_plugin.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    "CheckpointError",
    "DistributedOptimizer",
    "HorovodInternalError",
    "NonFiniteGradientError",
    "NotInitializedError",
    "SyncBatchNorm",
    "SynchronizationError",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "elastic",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "load_checkpoint",
    "local_rank",
    "local_size",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "rocm_built",
    "save_checkpoint",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
__all__ += _api.__all__
