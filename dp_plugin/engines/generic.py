"""Collectives derived from all-gather and all-reduce, for engines whose
library has no native path (``Engine``'s defaults call these).

Both run after the agreement, so their inputs are valid and agreed by
every rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dp_plugin.arrays import as_numpy, as_torch, is_torch
from dp_plugin.engines.handle import Handle


def alltoall_by_allgather(engine: Any, buf: Any, counts: np.ndarray, name: str) -> Any:
    """All-gather every rank's buffer and keep the blocks addressed to this
    rank (moves ``size`` times the data). ``counts[i, j]``: rows i sends j."""
    gathered = engine.allgather(buf, name=name, rows=[int(n) for n in counts.sum(axis=1)])
    me = engine.rank
    starts = np.concatenate([[0], np.cumsum(counts.sum(axis=1))])
    rows = [
        np.arange(first, first + int(counts[src, me]), dtype=np.int64)
        for src, first in enumerate(int(starts[s] + counts[s, :me].sum())
                                    for s in range(engine.size))
    ]
    index = np.concatenate(rows)
    return gathered[as_torch(index)] if is_torch(gathered) else gathered[index]


def reducescatter_by_allreduce(engine: Any, buf: Any, op: Any, counts: list[int],
                               name: str) -> tuple[Handle, Any]:
    """The reduce-scatter, started: an all-reduce of a copy in flight; the
    returned ``result()`` slices this rank's ``counts[rank]`` rows out of it."""
    torch_buf = is_torch(buf)
    flat: Any = buf.detach().reshape(-1).clone() if torch_buf else (
        np.array(as_numpy(buf).reshape(-1), copy=True))
    handle: Handle
    if flat.shape[0]:  # same shape everywhere: every rank skips alike
        handle = engine._allreduce_async(flat, op, name)
    else:
        handle = engine._done(engine.describe("reducescatter", name, 0))
    row = int(np.prod(buf.shape[1:], dtype=np.int64))
    start = sum(counts[:engine.rank]) * row
    shape = (counts[engine.rank], *buf.shape[1:])

    def result() -> Any:
        mine = flat[start:start + counts[engine.rank] * row]
        # A copy, so the result does not keep the whole reduced buffer alive.
        mine = mine.clone() if torch_buf else mine.copy()
        return mine.reshape(shape)

    return handle, result


def divide(buf: Any, size: int) -> Any:
    """``buf /= size`` in place (numpy or torch); returns ``buf``."""
    if hasattr(buf, "div_"):
        buf.div_(size)
    else:
        arr = as_numpy(buf)
        arr /= arr.dtype.type(size)
    return buf
