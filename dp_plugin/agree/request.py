"""One description of a tensor collective: the ``Request`` every caller builds
before it runs one, and the ``Agreed`` outcome every rank gets back.

Both adapters and the core describe what they are about to run as a
``Request`` (a fused collective's layout and settings too: ``Request.fused``)
and hand it to the one check (``dp_plugin.agree.check``), which compares it across
ranks. ``CHECKS`` says, per kind, which fields the ranks must share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dp_plugin.engines.base import ReduceOp
from dp_plugin.reduce.fusion import TensorSpec

CHECKS: dict[str, tuple[str, ...]] = {
    "allreduce": ("op", "dtype", "device", "shape", "scales"),
    "allgather": ("dtype", "device", "trailing"),
    "broadcast": ("dtype", "device", "shape", "root"),
    "alltoall": ("dtype", "device", "trailing"),
    "reducescatter": ("op", "dtype", "device", "shape", "scales"),
    "barrier": (),
    "subgroup": ("members",),
    "fused": (),  # its layout, then its settings (check_messages.layout_text, settings_text)
}
"""Which fields must agree, per kind (kind, group size and name always must)."""

CHECK_TAG = "dp_plugin.agree.check"
"""The agreement tag of every request (one tag, so that two ranks in
different collectives compare their requests and say so)."""


@dataclass(frozen=True, kw_only=True)
class Request:
    """What this rank asks for: one collective over one or more tensors."""

    kind: str
    name: str | None = None
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    """Dtype names as the framework spells them without its prefix ("float32", "bool")."""
    devices: tuple[str, ...] = ()
    """Device kinds ("cpu", "cuda"): 'cuda:0' and 'cuda:1' are the same kind."""
    op: ReduceOp | None = None
    scales: tuple[float, float] = (1.0, 1.0)
    root: int = -1
    """``root_rank`` as the user passed it (broadcast; job-wide)."""
    splits: Any = None
    """Rows to send to each rank as the user passed them (alltoall; None: even)."""
    members: Any = None
    """The ranks of a new process set as the user passed them (subgroup)."""
    layout: tuple[TensorSpec, ...] = ()
    """A fused collective's tensors, in order (kind "fused")."""
    settings: Mapping[str, Any] | None = None
    """Values every rank of a fused collective must share (fusion threshold,
    compression, scales ...), by name; compared as their ``repr``."""

    @classmethod
    def of(cls, kind: str, bufs: Sequence[Any], **fields: Any) -> Request:
        """The request over numpy arrays, torch or TensorFlow tensors ``bufs``."""
        return cls(kind=kind, shapes=tuple(tuple(int(d) for d in b.shape) for b in bufs),
                   dtypes=tuple(dtype_name(b.dtype) for b in bufs),
                   devices=tuple(_device_kind(b) for b in bufs), **fields)

    @classmethod
    def fused(cls, layout: Sequence[TensorSpec], what: str,
              settings: Mapping[str, Any] | None = None) -> Request:
        """A fused collective over ``layout`` with ``settings``; ``what`` names
        its tensors in messages ("the {what} registered for all-reduce differ")."""
        return cls(kind="fused", name=what, layout=tuple(layout), settings=settings)


def dtype_name(dtype: Any) -> str:
    """'float32', 'bool', 'uint16' ... for a numpy, torch or TensorFlow dtype."""
    name = getattr(dtype, "name", None)  # torch.dtype has none
    return name if isinstance(name, str) else str(dtype).removeprefix("torch.")


def _device_kind(buf: Any) -> str:
    device = getattr(buf, "device", "cpu")
    kind = getattr(device, "type", None)  # torch.device
    if kind is None:  # numpy: no device (a str attribute on some versions); TF: a string
        kind = "gpu" if "GPU" in str(device).upper() else "cpu"
    return str(kind)


@dataclass(frozen=True)
class Agreed:
    """What every rank agreed to run (the same on every rank)."""

    table: list[list[int]]
    """``table[rank]``: the rank's first dimension of each tensor (0 on a
    joined rank), then its splits (alltoall) or host key (subgroup)."""
    count: int
    """Tensors in the request."""
    joined: tuple[int, ...] = ()
    members: tuple[int, ...] = ()
    """The agreed, valid member list (subgroup)."""
    root: int = -1
    """The agreed root as a rank of the engine (broadcast)."""

    def rows(self, index: int = 0) -> list[int]:
        """Every rank's first dimension of tensor ``index`` (allgather)."""
        return [numbers[index] for numbers in self.table]

    def counts(self) -> np.ndarray:
        """``counts[i, j]``: rows rank i sends to rank j (alltoall)."""
        return np.array([n[self.count:] for n in self.table], dtype=np.int64)

    def hosts(self) -> list[int]:
        """Every rank's host key (subgroup)."""
        return [n[0] for n in self.table]
