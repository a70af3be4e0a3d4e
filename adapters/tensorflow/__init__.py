"""dp_plugin.tensorflow (also ``dp_plugin.keras``): data-parallel Keras 3 on TensorFlow.

A Horovod-style API for TensorFlow >= 2.16, where ``tf.keras`` is Keras 3
and Horovod's Keras integration no longer works::

    import dp_plugin.tensorflow as dp

    dp.init()                                    # engine chosen from the launcher
    model.compile(optimizer=keras.optimizers.SGD(0.01 * dp.size()), loss="mse")
    model.fit(dp.shard(dataset).batch(64), callbacks=[dp.DistributedCallback()])

Launch with ``torchrun``, ``horovodrun`` or ``mpirun``; the core's engines
(gloo, Horovod's ring, MPI, or local for one process) do the communication,
with the same fusion, compression and configuration as PyTorch. No Horovod
TensorFlow extension is needed. A model may use ``MirroredStrategy`` over the
devices of its process: Keras sums the local replicas, the plugin adds one
cross-worker all-reduce per fusion bucket.

Also: ``DistributedOptimizer`` (compile() without the callback) with
``BroadcastGlobalVariablesCallback``; ``DistributedGradientTape`` and
``broadcast_variables`` for custom loops; ``MetricAverageCallback``,
``LearningRateWarmupCallback``, ``LearningRateScheduleCallback``.
Horovod's tensor API too: ``allreduce``, ``allgather``, ``broadcast``,
``alltoall``, ``reducescatter`` (and grouped variants, with gradients, eager
or in ``tf.function``), ``broadcast_object``, ``allgather_object``,
``barrier``, ``join``, process sets, ``SyncBatchNormalization``, the
``callbacks`` namespace and ``load_model``.
Supported Keras: see ``compat.SUPPORTED_KERAS_SPEC``.
"""

from dp_plugin.api import horovod_api as _api
from dp_plugin.api.horovod_api import *  # noqa: F403 - ops, process sets, capabilities
from dp_plugin.errors import LayoutMismatchError, NotInitializedError
from dp_plugin.tensorflow import callbacks, elastic
from dp_plugin.tensorflow import util as util
from dp_plugin.tensorflow.basics import (
    cross_rank,
    cross_size,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_threads_supported,
    rank,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from dp_plugin.tensorflow.broadcast import broadcast_variables
from dp_plugin.tensorflow.callbacks import BroadcastGlobalVariablesCallback, DistributedCallback
from dp_plugin.tensorflow.callbacks_lr import (
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
)
from dp_plugin.tensorflow.checkpoint import BestModelCheckpoint, load_model
from dp_plugin.tensorflow.collectives import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from dp_plugin.tensorflow.compat import UnsupportedKerasError, UnsupportedStrategyError
from dp_plugin.tensorflow.data import shard
from dp_plugin.tensorflow.functions import (
    allgather_object,
    barrier,
    broadcast_global_variables,
    broadcast_object,
    cuda_built,
    join,
    nccl_built,
    rocm_built,
)
from dp_plugin.tensorflow.graph_ops import (
    BroadcastGlobalVariablesHook,
    broadcast_,
    broadcast_object_fn,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)
from dp_plugin.tensorflow.metric_average import MetricAverageCallback
from dp_plugin.tensorflow.optimizer import DistributedOptimizer
from dp_plugin.tensorflow.sync_batch_norm import SyncBatchNormalization
from dp_plugin.tensorflow.tape import DistributedGradientTape, PartialDistributedGradientTape
from dp_plugin.tensorflow.util import _executing_eagerly as _executing_eagerly
from dp_plugin.tensorflow.util import refs_to_vars, vars_to_refs

__all__ = [
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "BroadcastGlobalVariablesHook",
    "DistributedCallback",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "LayoutMismatchError",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "NotInitializedError",
    "PartialDistributedGradientTape",
    "SyncBatchNormalization",
    "UnsupportedKerasError",
    "UnsupportedStrategyError",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "callbacks",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "elastic",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "load_model",
    "local_rank",
    "local_rank_op",
    "local_size",
    "local_size_op",
    "mpi_threads_supported",
    "nccl_built",
    "process_set_included_op",
    "rank",
    "rank_op",
    "reducescatter",
    "refs_to_vars",
    "rocm_built",
    "shard",
    "shutdown",
    "size",
    "size_op",
    "start_timeline",
    "stop_timeline",
    "vars_to_refs",
]
__all__ += _api.__all__
