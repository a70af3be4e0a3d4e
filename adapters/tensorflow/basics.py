"""Process-level API, as ``horovod.tensorflow``: init, shutdown, ranks, timeline.

``dp_plugin.api.horovod_api.HorovodBasics``'s, shared with ``dp_plugin.torch``:
the launcher decides the ranks and the engine (gloo under torchrun,
Horovod's ring under horovodrun, MPI under mpirun); no TensorFlow extension
is involved. Before ``init()`` each raises the core's ``NotInitializedError``
naming the call. What TensorFlow was built with is in ``functions``.
"""

from __future__ import annotations

from dp_plugin.api.horovod_api import HorovodBasics
from dp_plugin.errors import NotInitializedError

__all__ = [
    "cross_rank", "cross_size", "init", "is_homogeneous", "is_initialized", "local_rank",
    "local_size", "mpi_threads_supported", "rank", "shutdown", "size", "start_timeline",
    "stop_timeline",
]

_basics = HorovodBasics("dp_plugin.tensorflow", NotInitializedError)
init = _basics.init
shutdown = _basics.shutdown
is_initialized = _basics.is_initialized
size = _basics.size
rank = _basics.rank
local_size = _basics.local_size
local_rank = _basics.local_rank
cross_size = _basics.cross_size
cross_rank = _basics.cross_rank
is_homogeneous = _basics.is_homogeneous
mpi_threads_supported = _basics.mpi_threads_supported
start_timeline = _basics.start_timeline
stop_timeline = _basics.stop_timeline
