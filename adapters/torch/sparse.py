"""``sparse_allreduce_async``: sum or average sparse COO tensors, as Horovod does.

Horovod has no sparse reduction kernel: it all-gathers every rank's indices
and values and builds one sparse tensor from the concatenation, whose
duplicate indices then add up. Same here, with two differences: the input is
coalesced first (duplicate indices summed locally, so fewer rows travel),
and the result is coalesced (a canonical sparse tensor, the same sum).

``SparseGradients`` reduces a ``DistributedOptimizer``'s sparse gradients
the same way, on the optimizer's channel.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from dp_plugin.agree import checked
from dp_plugin.agree.edge import public
from dp_plugin.api.horovod_names import require_sum_or_average
from dp_plugin.api.process_sets import engine_of, global_process_set
from dp_plugin.engines.base import ReduceOp
from dp_plugin.reduce.arrays import TorchOps
from dp_plugin.torch.collectives import allgather_async
from dp_plugin.torch.handles import poll, synchronize
from dp_plugin.torch.ops import resolve_op
from torch import nn


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
        return self._result is not None or all(poll(h) for h in self._handles)

    def __call__(self) -> torch.Tensor:
        if self._result is None:
            indices, values = (synchronize(h) for h in self._handles)
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


EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
"""The modules whose parameters have sparse gradients when ``sparse=True`` (DDP's rule)."""


def sparse_embedding_weights(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Those of ``params`` owned by an ``nn.Embedding`` or ``nn.EmbeddingBag``
    with ``sparse=True``: the parameters whose gradients are sparse, decided
    as DDP decides them at construction (``_build_params_for_reducer``).

    A parameter does not know its module, and the wrapper is given parameters
    only (Horovod's signature), so the modules are found among the objects
    the garbage collector tracks, which every live module is: one pass per
    (re)wrap, tens of milliseconds. Objects are told apart by ``type()``, so
    no other object's attributes run; one still in its ``__init__`` (in
    another thread) has no ``sparse`` yet and is not among ``params``."""
    owned = {id(getattr(obj, "weight", None)) for obj in gc.get_objects()
             if issubclass(type(obj), EMBEDDINGS) and getattr(obj, "sparse", False)}
    return [p for p in params if id(p) in owned]


class SparseGradients:
    """The sparse parameters of one ``DistributedOptimizer`` and their
    gradients in the step in progress.

    Horovod's way: each sparse gradient is reduced on its own by an
    all-gather of indices and values on the optimizer's channel, outside the
    dense fusion buckets. Which parameters are sparse is fixed when the
    optimizer's reducer is built (``sparse_embedding_weights``; none with
    ``sparse_as_dense=True``): their slots in the dense buckets are empty
    placeholders (``dense_stand_in``), so the layout agreement covers the set
    and ranks that differ get its error on every rank.

    Distributed contract: the reductions start at ``reduce()``, i.e. at
    ``synchronize()``, in registration order, for every sparse parameter on
    every rank, so no rank can order them differently and a rank that joined
    before its first step runs the same ones. A rank without a gradient for
    a sparse parameter in a step contributes an empty one; a dense gradient
    (e.g. of a table tied to a dense layer) travels as its non-zero rows and
    comes back dense, as Horovod's dense all-reduce would return it.
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = dict.fromkeys(params)
        """The sparse parameters, in registration order (keys)."""
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        """This step's gradient per sparse parameter."""

    def dense_stand_in(self, param: torch.Tensor) -> torch.Tensor:
        """What the dense reducer registers for ``param``: an empty tensor for a
        sparse parameter (nothing travels in the buckets), else itself."""
        return param.detach().new_empty(0) if param in self.params else param

    def reduce(self, names: dict[torch.Tensor, str], op: Any, engine: Any,
               contribute: bool = True) -> None:
        """Reduce every sparse parameter's gradient over ``engine`` (the
        optimizer's channel) and store the result as its ``.grad``. With
        ``contribute=False`` (a joined rank) this rank sends empty gradients
        and keeps nothing.

        The optimizer's layout agreement covers these parameters, so the
        all-gathers go straight to the channel, not through the tensor
        collectives' agreement on the process set's engine (which a joined
        rank keeps listening to)."""
        started = []
        for p in self.params:
            grad = self.grads.get(p) if contribute else None
            t, rows = _rows(_as_rows(p, grad))
            name = f"DistributedOptimizer.sparse.{names[p]}"
            parts = [checked.allgather_async(engine, part, f"{name}.{what}")
                     for what, part in rows.items()]
            started.append((p, t, parts, grad is not None and not grad.is_sparse))
        divisor = engine.size if op is ReduceOp.AVERAGE else 1
        for p, t, parts, dense in started:
            for handle, _ in parts:
                handle.wait()
            indices, values = (result() for _, result in parts)
            if contribute:
                reduced = _assemble(t, indices, values, divisor)
                p.grad = reduced.to_dense() if dense else reduced
        self.grads.clear()


def _as_rows(param: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
    """``grad`` as an embedding's sparse gradient (``sparse_dim`` 1: whole
    rows), whatever its layout; no gradient: one without rows."""
    if grad is None:
        indices = torch.empty((1, 0), dtype=torch.long, device=param.device)
        values = param.detach().new_empty((0, *param.shape[1:]))
        return torch.sparse_coo_tensor(indices, values, param.shape)
    if grad.is_sparse and grad.sparse_dim() == 1:
        return grad
    return grad.to_dense().to_sparse(1)
