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
Supported Keras: see ``compat.SUPPORTED_KERAS_SPEC``.
"""

from dp_plugin.errors import LayoutMismatchError, NotInitializedError
from dp_plugin.tensorflow.basics import (
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from dp_plugin.tensorflow.broadcast import broadcast_variables
from dp_plugin.tensorflow.callbacks import BroadcastGlobalVariablesCallback, DistributedCallback
from dp_plugin.tensorflow.callbacks_lr import (
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
)
from dp_plugin.tensorflow.compat import UnsupportedKerasError, UnsupportedStrategyError
from dp_plugin.tensorflow.data import shard
from dp_plugin.tensorflow.metric_average import MetricAverageCallback
from dp_plugin.tensorflow.ops import Adasum, Average, Compression, Max, Min, Product, Sum
from dp_plugin.tensorflow.optimizer import DistributedOptimizer
from dp_plugin.tensorflow.tape import DistributedGradientTape

__all__ = [
    "Adasum",
    "Average",
    "BroadcastGlobalVariablesCallback",
    "Compression",
    "DistributedCallback",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "LayoutMismatchError",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "Max",
    "MetricAverageCallback",
    "Min",
    "NotInitializedError",
    "Product",
    "Sum",
    "UnsupportedKerasError",
    "UnsupportedStrategyError",
    "broadcast_variables",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shard",
    "shutdown",
    "size",
]
