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
from dp_plugin.tensorflow import basics, callbacks, elastic, functions, graph_ops
from dp_plugin.tensorflow import util as util
from dp_plugin.tensorflow.basics import *  # noqa: F403 - init, ranks, timeline
from dp_plugin.tensorflow.broadcast import broadcast_variables
from dp_plugin.tensorflow.callbacks import *  # noqa: F403 - the Keras callbacks
from dp_plugin.tensorflow.checkpoint import load_model
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
from dp_plugin.tensorflow.functions import *  # noqa: F403 - objects, barrier, join, builds
from dp_plugin.tensorflow.graph_ops import *  # noqa: F403 - TF1 graph helpers
from dp_plugin.tensorflow.optimizer import DistributedOptimizer
from dp_plugin.tensorflow.sync_batch_norm import SyncBatchNormalization
from dp_plugin.tensorflow.tape import DistributedGradientTape, PartialDistributedGradientTape
from dp_plugin.tensorflow.util import _executing_eagerly as _executing_eagerly
from dp_plugin.tensorflow.util import refs_to_vars, vars_to_refs

__all__ = [
    "DistributedGradientTape",
    "DistributedOptimizer",
    "LayoutMismatchError",
    "NotInitializedError",
    "PartialDistributedGradientTape",
    "SyncBatchNormalization",
    "UnsupportedKerasError",
    "UnsupportedStrategyError",
    "allgather",
    "allreduce",
    "alltoall",
    "broadcast",
    "broadcast_variables",
    "callbacks",
    "elastic",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "load_model",
    "reducescatter",
    "refs_to_vars",
    "shard",
    "vars_to_refs",
]
__all__ += basics.__all__ + callbacks.__all__ + functions.__all__ + graph_ops.__all__
__all__ += _api.__all__
