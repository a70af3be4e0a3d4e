"""``sparse_allreduce_async``: sum or average sparse COO tensors, as Horovod does.

Horovod has no sparse reduction kernel: it all-gathers every rank's indices
and values and builds one sparse tensor from the concatenation, whose
duplicate indices then add up. Same here, with two differences: the input is
coalesced first (duplicate indices summed locally, so fewer rows travel),
and the result is coalesced (a canonical sparse tensor, the same sum).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import torch
from dp_plugin import request
from dp_plugin.agreement import to_device, to_host
from dp_plugin.arrays import TorchOps
from dp_plugin.edge import calling, public
from dp_plugin.engines.base import ReduceOp
from dp_plugin.horovod_names import require_sum_or_average
from dp_plugin.process_sets import engine_of, global_process_set
from dp_plugin.torch.collectives import allgather_async
from dp_plugin.torch.handles import TABLE
from dp_plugin.torch.submit import resolve_op


class SparseAllreduceHandle:
    """What ``sparse_allreduce_async`` returns. Call it (Horovod's way) or
    pass it to ``synchronize`` to get the reduced sparse tensor; ``poll``
    accepts it too."""

    def __init__(self, like: torch.Tensor, handles: list[int], divisor: int) -> None:
        self._like = like
        self._handles = handles  # the all-gathers of the indices, then of the values
        self._divisor = divisor
        self._result: torch.Tensor | None = None

    def done(self) -> bool:
        return self._result is not None or all(TABLE.poll(h) for h in self._handles)

    def __call__(self) -> torch.Tensor:
        if self._result is None:
            indices, values = (TABLE.synchronize(h) for h in self._handles)
            self._result = _assemble(self._like, indices, values, self._divisor)
        return self._result


def _assemble(like: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
              divisor: int) -> torch.Tensor:
    """The coalesced sum (or, with ``divisor``, average) of every rank's
    gathered non-zeros: duplicate indices add up."""
    if divisor != 1:
        if values.is_floating_point():
            values = values / divisor
        else:
            TorchOps().scale_(values, 1.0 / divisor)
    return torch.sparse_coo_tensor(
        indices.t(), values, like.size(), dtype=like.dtype, device=like.device,
        check_invariants=False,  # built from valid parts
    ).coalesce()


@public("sparse_allreduce_async")
def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: Any,
                           process_set: Any = global_process_set) -> SparseAllreduceHandle:
    """Start summing (``op=Sum``) or averaging (``op=Average``) a sparse COO
    ``tensor`` over the process set, by all-gathering its indices and values
    (under the names ``<name>.indices`` and ``<name>.values``). Every rank
    passes a tensor of the same dense size and dtype; the number of non-zeros
    may differ. Returns a callable handle (Horovod's): calling it waits and
    returns the reduced, coalesced sparse tensor."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        layout = getattr(tensor, "layout", type(tensor).__name__)
        raise TypeError(
            f"sparse_allreduce_async: expected a sparse COO tensor, got {layout}; use "
            "allreduce_async for dense tensors (or tensor.to_sparse())"
        )
    op = resolve_op(op, None)
    require_sum_or_average(op, "is not supported for sparse tensors", prefix="hvd.")
    t, rows = _rows(tensor)
    handles = [allgather_async(part, None if name is None else f"{name}.{part_name}", process_set)
               for part_name, part in rows.items()]
    size = engine_of(process_set).size
    return SparseAllreduceHandle(t, handles, size if op is ReduceOp.AVERAGE else 1)


def _rows(tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``tensor`` coalesced, and its parts to all-gather: rows are non-zeros (indices
    as (nnz, sparse_dim)), so the first dimension is the one that differs between ranks."""
    t = tensor.detach().coalesce()
    return t, {"indices": t.indices().t().contiguous(), "values": t.values().contiguous()}


class SparseGradients:
    """The sparse gradients of one ``DistributedOptimizer`` with ``sparse_as_dense=False``.

    Horovod's way: each sparse gradient is reduced on its own by an
    all-gather of indices and values on the optimizer's channel, outside the
    dense fusion buffers. A parameter is known as sparse from the first step
    in which its gradient is sparse; from then on its slot in the dense
    buckets is an empty placeholder (``dense_stand_in``), so the table never
    travels densely again (in that first step it still travels as zeros).

    Distributed contract: every rank sees the same parameters' gradients turn
    sparse in the same step (true for an ``nn.Embedding(sparse=True)`` that
    every rank uses). The reductions start at ``reduce()``, i.e. at
    ``synchronize()``, in registration order, so no rank can order them
    differently. A rank without a gradient for a known sparse parameter in a
    step contributes an empty one.
    """

    def __init__(self) -> None:
        self.known: dict[torch.Tensor, tuple[int, int]] = {}
        """Parameter -> (sparse_dim, dense_dim) of its sparse gradients."""
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        """This step's sparse gradient per parameter."""
        self.changed = False
        """A parameter turned sparse this step: the dense buckets must be re-planned."""

    def add(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Take ``grad`` (the parameter's accumulated sparse ``.grad``) for this step."""
        if param not in self.known:
            self.known[param] = (grad.sparse_dim(), grad.dense_dim())
            self.changed = True
        self.grads[param] = grad

    def owns(self, param: torch.Tensor) -> bool:
        return param in self.known

    def dense_stand_in(self, param: torch.Tensor) -> torch.Tensor:
        """What the dense scheduler registers for ``param``: an empty tensor once
        it is known to be sparse (nothing travels in the buckets), else itself."""
        return param.detach().new_empty(0) if param in self.known else param

    def reduce(self, params: list[torch.Tensor], names: dict[torch.Tensor, str], op: Any,
               engine: Any, news: Any, contribute: bool = True) -> None:
        """Reduce every known sparse gradient over ``engine`` (the optimizer's
        channel; registration order) and store the result as the parameter's
        ``.grad``. With ``contribute=False`` (a joined rank) this rank sends
        empty gradients and keeps nothing.

        ``news`` (``RankMarks`` in the control slot, reduced with this
        step's buckets) says whether a rank saw a gradient turn sparse this
        step; the ranks then first tell each other which (``_learn``): a
        rank that called ``hvd.join()`` before its first step has seen
        none, and must run the same all-gathers as the others.

        The optimizer's layout agreement covers these parameters, so the
        all-gathers go straight to the channel, not through the tensor
        collectives' agreement on the process set's engine (which a joined
        rank keeps listening to)."""
        if news.marked():
            self._learn(params, engine)
        news.reset()
        if self.known:
            with calling("DistributedOptimizer"):
                require_sum_or_average(op, "cannot reduce sparse gradients", prefix="hvd.",
                                       otherwise=", or sparse_as_dense=True")
        started = []
        for p in params:
            dims = self.known.get(p)
            if dims is None:
                continue
            grad = self.grads.get(p) if contribute else None
            if grad is None:
                grad = _empty_sparse(p, *dims)
            t, rows = _rows(grad)
            name = f"DistributedOptimizer.sparse.{names[p]}"
            parts = [request.allgather_async(engine, part, f"{name}.{what}")
                     for what, part in rows.items()]
            started.append((p, t, parts))
        divisor = engine.size if op is ReduceOp.AVERAGE else 1
        for p, t, parts in started:
            for handle, _ in parts:
                handle.wait()
            indices, values = (result() for _, result in parts)
            if contribute:
                p.grad = _assemble(t, indices, values, divisor)
        self.grads.clear()


    def _learn(self, params: list[torch.Tensor], engine: Any) -> None:
        """Every rank learns every parameter some rank knows as sparse, with its
        ``sparse_dim`` (one all-reduce of two numbers per parameter; collective
        over the channel); a parameter new here re-plans the buckets after the
        step (``changed``), as on the ranks that saw its gradient."""
        mine = np.zeros((2, len(params)), dtype=np.int64)
        for i, p in enumerate(params):
            if p in self.known:
                mine[:, i] = (self.known[p][0], 1)
        buf = to_device(mine.reshape(-1), engine.buffer_device)
        engine.allreduce_async(buf, "sum", name="DistributedOptimizer.sparse.known").wait()
        dims, ranks = to_host(buf).reshape(2, len(params))
        for i, p in enumerate(params):
            if ranks[i] and p not in self.known:
                sparse_dim = int(dims[i] // ranks[i])
                self.known[p] = (sparse_dim, p.dim() - sparse_dim)
                self.changed = True


def _empty_sparse(param: torch.Tensor, sparse_dim: int, dense_dim: int) -> torch.Tensor:
    """A sparse gradient of ``param`` with no non-zeros (a rank that did not use it)."""
    shape = tuple(param.shape)
    indices = torch.empty((sparse_dim, 0), dtype=torch.long, device=param.device)
    values = torch.empty((0, *shape[sparse_dim:sparse_dim + dense_dim]), dtype=param.dtype,
                         device=param.device)
    return torch.sparse_coo_tensor(indices, values, shape)
