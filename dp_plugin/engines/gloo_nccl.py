"""The two torch.distributed backends as engines: ``gloo`` (CPU) and ``nccl``
(CUDA, one GPU per rank). Everything they share is ``TorchDistEngine``
(``torch_dist.py``); here is only what differs: availability, the device
buffers live on, and NCCL's native average.
"""

from __future__ import annotations

from typing import Any

from dp_plugin.engines.base import ReduceOp
from dp_plugin.engines.torch_dist import TorchDistEngine
from dp_plugin.launch import Topology


class GlooEngine(TorchDistEngine):
    """torch.distributed with Gloo: CPU buffers (CUDA ones are staged by torch)."""

    name = "gloo"
    backend = "gloo"

    @classmethod
    def _backend_problem(cls, topology: Topology) -> str | None:
        import torch.distributed as dist

        if not dist.is_gloo_available():
            return "this torch build has no Gloo backend"
        return None

    def _select_device(self) -> Any:
        return self._torch.device("cpu")


class NcclEngine(TorchDistEngine):
    """torch.distributed with NCCL: CUDA buffers, one GPU per rank
    (``cuda:local_rank``). Average uses NCCL's native AVG. CPU buffers
    (``hvd.allreduce(torch.tensor(x))``, ``barrier``, Keras' numpy buffers)
    are copied to the GPU, reduced there and copied back (``_staged``)."""

    name = "nccl"
    backend = "nccl"
    native_ops = frozenset(ReduceOp)

    @classmethod
    def _backend_problem(cls, topology: Topology) -> str | None:
        import torch
        import torch.distributed as dist

        if not torch.cuda.is_available():
            return "no CUDA device is visible (NCCL needs one GPU per rank); use gloo on CPUs"
        if not dist.is_nccl_available():
            return "this torch build has no NCCL backend; install a CUDA build of torch"
        count = torch.cuda.device_count()
        if topology.local_size > count:
            return (
                f"{topology.local_size} ranks on this host but {count} CUDA device(s); NCCL "
                "needs one GPU per rank: start at most that many processes per host"
            )
        return None

    def _select_device(self) -> Any:
        return self._torch.device("cuda", self.topology.local_rank)

    def _check_device(self, t: Any, what: str) -> None:
        if t.device.type not in ("cuda", "cpu"):
            raise TypeError(
                f"{what}: the nccl engine takes CUDA buffers (CPU ones are staged through "
                f"this rank's GPU), got one on {t.device}; move it to the GPU or to the CPU"
            )
