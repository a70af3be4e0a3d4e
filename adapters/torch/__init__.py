"""dp_plugin.torch: a drop-in for ``horovod.torch`` 0.28.1 on PyTorch 2.x.

Change ``import horovod.torch as hvd`` to ``import dp_plugin.torch as hvd``;
the names in ``__all__`` are horovod.torch's public API, with its signatures and
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
from dp_plugin.torch import autograd_ops, basics, collectives, elastic, functions
from dp_plugin.torch.autograd_ops import *  # noqa: F403 - collectives with autograd
from dp_plugin.torch.basics import *  # noqa: F403 - init, ranks, timeline, builds
from dp_plugin.torch.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from dp_plugin.torch.collectives import *  # noqa: F403 - the *_async collectives, barrier
from dp_plugin.torch.functions import *  # noqa: F403 - parameters, optimizer state, objects
from dp_plugin.torch.handles import poll, synchronize
from dp_plugin.torch.joining import join
from dp_plugin.torch.optimizer import DistributedOptimizer
from dp_plugin.torch.optimizer_state import SynchronizationError
from dp_plugin.torch.sparse import sparse_allreduce_async
from dp_plugin.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    "CheckpointError", "DistributedOptimizer", "HorovodInternalError", "NonFiniteGradientError",
    "SyncBatchNorm", "SynchronizationError", "elastic", "join", "load_checkpoint", "poll",
    "save_checkpoint", "sparse_allreduce_async", "synchronize",
]
__all__ += autograd_ops.__all__ + basics.__all__ + collectives.__all__ + functions.__all__
__all__ += _api.__all__
