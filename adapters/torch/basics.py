"""Process-level API of ``dp_plugin.torch``: init, ranks, build flags, timeline.

Names, signatures and return types follow ``horovod.torch`` 0.28.1. The
process-level functions are ``dp_plugin.api.horovod_api.HorovodBasics``'s, shared
with ``dp_plugin.tensorflow``; what is torch's own is here: the error before
``init()``, the collectives' handles that ``shutdown()`` forgets, and what
torch was built with (``cuda_built()``, ``nccl_built()``, ``rocm_built()``).
"""

from __future__ import annotations

import torch
from dp_plugin.api.horovod_api import HorovodBasics
from dp_plugin.errors import NotInitializedError as _CoreNotInitializedError
from dp_plugin.torch import handles as _handles

__all__ = [
    "NotInitializedError", "cross_rank", "cross_size", "cuda_built", "init", "is_homogeneous",
    "is_initialized", "local_rank", "local_size", "mpi_threads_supported", "nccl_built", "rank",
    "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
]


class NotInitializedError(_CoreNotInitializedError, ValueError):
    """``dp_plugin.torch`` was used before ``init()`` (or after ``shutdown()``).

    Also a ``ValueError``, the type Horovod raises here, so existing
    ``except ValueError`` clauses keep working.
    """

    def __init__(self, what: str = "dp_plugin.torch") -> None:
        Exception.__init__(
            self,
            f"{what} needs dp_plugin.torch to be initialized; call hvd.init() "
            "(dp_plugin.torch.init()) once per process, after the launcher has started it "
            "and before any other hvd call",
        )


_basics = HorovodBasics("dp_plugin.torch", NotInitializedError, reset=_handles.reset)
engine = _basics.engine
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


# -- what is built, what is running ---------------------------------------------


def nccl_built() -> int:
    """NCCL version code (e.g. 21803 for 2.18.3) when torch has NCCL, else 0 (as Horovod)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    version = torch.cuda.nccl.version()
    if isinstance(version, tuple):
        major, minor, patch = [*version, 0, 0, 0][:3]
        return int(major) * 10000 + int(minor) * 100 + int(patch)
    return int(version)


def cuda_built() -> bool:
    """True when torch was built with CUDA."""
    return bool(torch.backends.cuda.is_built())


def rocm_built() -> bool:
    """True when torch was built with ROCm (HIP)."""
    return torch.version.hip is not None
