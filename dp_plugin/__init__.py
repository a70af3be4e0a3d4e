"""dp_plugin: Horovod-style data parallelism, framework-agnostic core.

Importing this package loads neither torch nor tensorflow; engines and array
backends import their framework lazily, when first used.

Typical use goes through an adapter (``import dp_plugin.torch as hvd``). The
core API is for adapters and advanced users::

    import dp_plugin
    from dp_plugin.reduce.reducer import GradientScheduler
    dp_plugin.init()                 # detect the launcher, pick the engine
    sched = GradientScheduler(specs, ...)
"""

from dp_plugin.config import Config
from dp_plugin.engines import exit_bounds as _exit_bounds  # noqa: F401 - its exit hook, early
from dp_plugin.errors import (
    CollectiveTimeoutError,
    DPPluginError,
    LaunchError,
    LayoutMismatchError,
    MismatchError,
    NotInitializedError,
)
from dp_plugin.launch.runtime import engine, init, is_initialized, rank, shutdown, size, topology

__version__ = "0.1.0"

__all__ = [
    "CollectiveTimeoutError",
    "Config",
    "DPPluginError",
    "LaunchError",
    "LayoutMismatchError",
    "MismatchError",
    "NotInitializedError",
    "__version__",
    "engine",
    "init",
    "is_initialized",
    "rank",
    "shutdown",
    "size",
    "topology",
]
