"""``sparse_allreduce_async``: sum or average sparse COO tensors, as Horovod does.

Horovod has no sparse reduction kernel: it all-gathers every rank's indices
and values and builds one sparse tensor from the concatenation, whose
duplicate indices then add up. Same here, with two differences: the input is
coalesced first (duplicate indices summed locally, so fewer rows travel),
and the result is coalesced (a canonical sparse tensor, the same sum).
"""

from __future__ import annotations

from typing import Any

import torch
from dp_plugin.arrays import TorchOps
from dp_plugin.engines.base import ReduceOp
from dp_plugin.torch.collectives import allgather_async
from dp_plugin.torch.handles import TABLE
from dp_plugin.torch.process_sets import engine_of, global_process_set
from dp_plugin.torch.submit import resolve_op


class SparseAllreduceHandle:
    """What ``sparse_allreduce_async`` returns. Call it (Horovod's way) or
    pass it to ``synchronize`` to get the reduced sparse tensor; ``poll``
    accepts it too."""

    def __init__(self, like: torch.Tensor, indices: int, values: int, divisor: int) -> None:
        self._like = like
        self._handles = (indices, values)
        self._divisor = divisor
        self._result: torch.Tensor | None = None

    def done(self) -> bool:
        return self._result is not None or all(TABLE.poll(h) for h in self._handles)

    def __call__(self) -> torch.Tensor:
        if self._result is None:
            indices, values = (TABLE.synchronize(h) for h in self._handles)
            if self._divisor != 1:
                if values.is_floating_point():
                    values = values / self._divisor
                else:
                    TorchOps().scale_(values, 1.0 / self._divisor)
            self._result = torch.sparse_coo_tensor(
                indices.t(), values, self._like.size(), dtype=self._like.dtype,
                device=self._like.device, check_invariants=False,  # built from valid parts
            ).coalesce()
        return self._result


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: Any,
                           process_set: Any = global_process_set) -> SparseAllreduceHandle:
    """Start summing (``op=Sum``) or averaging (``op=Average``) a sparse COO
    ``tensor`` over the process set, by all-gathering its indices and values
    (under the names ``<name>.indices`` and ``<name>.values``). Every rank
    passes a tensor of the same dense size and dtype; the number of non-zeros
    may differ. Returns a callable handle (Horovod's): calling it waits and
    returns the reduced, coalesced sparse tensor."""
    what = "sparse_allreduce_async"
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        layout = getattr(tensor, "layout", type(tensor).__name__)
        raise TypeError(
            f"{what}: expected a sparse COO tensor, got {layout}; use allreduce_async for "
            "dense tensors (or tensor.to_sparse())"
        )
    op = resolve_op(op, None, what)
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError(
            f"{what}: op={op.name.capitalize()} is not supported for sparse tensors; pass "
            "op=hvd.Average or op=hvd.Sum"
        )
    t = tensor.detach().coalesce()
    # Rows are non-zeros: indices travel as (nnz, sparse_dim) so that the
    # all-gather's first dimension is the one that differs between ranks.
    indices = t.indices().t().contiguous()
    values = t.values().contiguous()
    prefix = None if name is None else str(name)
    h_indices = allgather_async(indices, None if prefix is None else f"{prefix}.indices",
                                process_set)
    h_values = allgather_async(values, None if prefix is None else f"{prefix}.values",
                               process_set)
    size = engine_of(process_set, what).size
    return SparseAllreduceHandle(t, h_indices, h_values,
                                 size if op is ReduceOp.AVERAGE else 1)
