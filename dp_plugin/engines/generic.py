"""Collectives derived from all-gather and all-reduce, for engines whose
library has no native path (``Engine``'s defaults call these).

They run after the agreement (``dp_plugin.agree.check``), so their
inputs are valid and agreed by every rank. Also here: the one engine
Average (``average``) and the raw-bytes view of buffers whose dtype no
reduction takes (``as_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from dp_plugin.engines.handle import DoneHandle, Handle
from dp_plugin.reduce.arrays import as_numpy, as_torch, is_torch, ops_for
from dp_plugin.reduce.dtypes import SUPPORTED_DTYPES


def alltoall_by_allgather(engine: Any, buf: Any, counts: np.ndarray, name: str) -> Any:
    """All-gather every rank's buffer and keep the blocks addressed to this
    rank (moves ``size`` times the data). ``counts[i, j]``: rows i sends j."""
    sent = counts.sum(axis=1)
    gathered = engine.allgather(buf, [int(n) for n in sent], name)
    me = engine.rank
    firsts = np.cumsum(sent) - sent + counts[:, :me].sum(axis=1)  # each sender's first row for me
    index = np.concatenate([np.arange(firsts[s], firsts[s] + counts[s, me], dtype=np.int64)
                            for s in range(engine.size)])
    return gathered[as_torch(index)] if is_torch(gathered) else gathered[index]


def reducescatter_by_allreduce(engine: Any, buf: Any, op: Any, counts: list[int],
                               name: str) -> tuple[Handle, Any]:
    """The reduce-scatter, started: an all-reduce of a copy in flight (``op``
    one of the engine's native ops); the returned ``result()`` slices this
    rank's ``counts[rank]`` rows out of it."""
    torch_buf = is_torch(buf)
    flat: Any = buf.detach().reshape(-1).clone() if torch_buf else (
        np.array(as_numpy(buf).reshape(-1), copy=True))
    # Same shape everywhere: every rank skips an empty one alike.
    handle = engine.allreduce_async(flat, op, name) if flat.shape[0] else DoneHandle(
        engine.describe("reducescatter", name, 0), engine.job_rank, engine.config.timeout_s)
    row = int(np.prod(buf.shape[1:], dtype=np.int64))
    start = sum(counts[:engine.rank]) * row
    shape = (counts[engine.rank], *buf.shape[1:])

    def result() -> Any:
        mine = flat[start:start + counts[engine.rank] * row]
        # A copy, so the result does not keep the whole reduced buffer alive.
        mine = mine.clone() if torch_buf else mine.copy()
        return mine.reshape(shape)

    return handle, result


def average(buf: Any, size: int) -> Any:
    """``buf *= 1 / size`` in place (numpy or torch), as ``ArrayOps.scale_``
    multiplies: integers in double precision, truncated toward zero; float16
    in float32. The one engine Average, equal to ``ReducePolicy``'s post-scale
    of an Average (``postscale / size``). Returns ``buf``."""
    ops_for(buf).scale_(buf, 1.0 / size)
    return buf


def _movable(buf: Any) -> bool:
    dtype = buf.dtype
    name = getattr(dtype, "name", None) or str(dtype).removeprefix("torch.")
    return name in SUPPORTED_DTYPES


def flat_bytes(buf: Any) -> Any:
    """A 1-D, contiguous ``buf`` as is when its dtype is one the engines
    reduce, else its raw bytes (a uint8 view sharing its memory, so that an
    in-place broadcast writes ``buf``)."""
    if _movable(buf) or len(buf.shape) != 1:
        return buf
    if is_torch(buf):
        import torch

        return buf.view(torch.uint8)
    return as_numpy(buf).view(np.uint8)


def torch_byte_rows(tensor: Any) -> Any:
    """A torch ``tensor``'s rows as raw bytes: a ``(rows, row_bytes)`` uint8 view of
    its memory (of a contiguous copy when it is not contiguous).

    An empty tensor becomes a fresh empty one instead: it may carry strides that
    ``view(uint8)`` refuses (numpy 2 gives a copied empty array strides of 0,
    which neither ``torch.from_numpy`` nor ``contiguous()`` changes)."""
    import torch

    rows = int(tensor.shape[0])
    width = tensor.element_size() * int(np.prod(tuple(tensor.shape[1:]), dtype=np.int64))
    if tensor.numel() == 0:
        return torch.empty((rows, width), dtype=torch.uint8, device=tensor.device)
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).reshape(rows, width)


def as_bytes(buf: Any) -> tuple[Any, Callable[[Any], Any]]:
    """``buf`` as the engines move it, and the function that turns what comes
    back into ``buf``'s dtype: ``buf`` itself when its dtype is one the
    engines reduce (``dtypes.SUPPORTED_DTYPES``), else ``byte_rows(buf)``, so
    that all-gather moves every dtype (bool, uint16, complex ...) exactly."""
    return (buf, lambda out: out) if _movable(buf) or not buf.shape else byte_rows(buf)


def byte_rows(buf: Any) -> tuple[Any, Callable[[Any], Any]]:
    """``buf``'s rows as raw bytes (a ``(rows, row_bytes)`` uint8 buffer of
    its kind: exact for every dtype, and no library dtype support needed),
    and the function that turns rows of bytes back into ``buf``'s dtype and
    trailing shape."""
    dtype = buf.dtype
    trailing = tuple(int(d) for d in buf.shape[1:])
    if is_torch(buf):
        return torch_byte_rows(buf), lambda out: (
            out.reshape(-1).view(dtype).reshape(out.shape[0], *trailing))
    arr = np.ascontiguousarray(as_numpy(buf))
    width = arr.dtype.itemsize * int(np.prod(trailing, dtype=np.int64))
    raw = arr.reshape(-1).view(np.uint8).reshape(arr.shape[0], width)
    return raw, lambda out: np.asarray(out).reshape(-1).view(dtype).reshape(out.shape[0], *trailing)
