"""Synchronous tensor collectives with autograd, as horovod.torch 0.28.1's.

Each function runs its ``*_async`` counterpart (``collectives.py``) and
waits; where Horovod defines a gradient, a ``torch.autograd.Function``
makes the collective differentiable. The backward passes are Horovod's, and
are themselves collectives: every rank must run backward through the same
collectives in the same order (autograd does, for the same graph).

- allreduce / grouped_allreduce: the gradient is all-reduced with the same
  op and scale factors;
- allgather / grouped_allgather: the gradient is *averaged* over the ranks
  (Horovod's ``average=True``) and each rank keeps the rows it contributed;
- broadcast: the gradient is averaged over the ranks; the root keeps it,
  the other ranks get zeros;
- alltoall: the gradient travels back by an alltoall with the received splits;
- reducescatter / grouped_reducescatter: the gradient, multiplied by the
  size for Sum and by both scale factors, is all-gathered.

``compression`` (Compression.fp16 / bf16, or a Horovod-style compressor
class with ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor,
ctx)``) casts outside the autograd function, so gradients flow through the
casts as in Horovod.
"""

from __future__ import annotations

from typing import Any

import torch
from dp_plugin.agree.edge import public
from dp_plugin.agree.roots import root_of
from dp_plugin.api.process_sets import engine_of, global_process_set
from dp_plugin.engines.base import ReduceOp
from dp_plugin.torch.collectives import (
    allreduce_async,
    allreduce_async_,
    broadcast_async,
    broadcast_async_,
    exchange,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    start_gather,
    start_reduce_scatter,
)
from dp_plugin.torch.handles import synchronize
from dp_plugin.torch.ops import Compression, resolve_op
from dp_plugin.torch.submit import check_tensors

__all__ = [
    "allgather", "allreduce", "allreduce_", "alltoall", "broadcast", "broadcast_",
    "grouped_allgather", "grouped_allreduce", "grouped_allreduce_", "grouped_reducescatter",
    "reducescatter",
]

_NONE = Compression.none


def _compressed(compression: Any, tensors: list[torch.Tensor],
                run: Any) -> list[torch.Tensor]:
    """``run(*wires)`` on ``tensors`` compressed for the wire, its outputs
    decompressed (both differentiable)."""
    if compression is None or compression is _NONE:
        return list(run(*tensors))
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise TypeError(
            f"compression={compression!r} is not a compressor; pass hvd.Compression.none, "
            "hvd.Compression.fp16, hvd.Compression.bf16, or a class with compress(tensor) -> "
            "(tensor, ctx) and decompress(tensor, ctx)"
        )
    wires = [compression.compress(t) for t in tensors]
    outs = run(*(w for w, _ in wires))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, wires, strict=True)]


class _Allreduce(torch.autograd.Function):
    """allreduce (``grouped``: grouped_allreduce) of one or more tensors; the
    gradient is all-reduced alike."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, prescale: float, postscale: float,
                process_set: Any, grouped: bool,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, prescale, postscale, process_set, grouped)
        start: Any = grouped_allreduce_async if grouped else allreduce_async
        out = synchronize(start(list(tensors) if grouped else tensors[0], name=name, op=op,
                                prescale_factor=prescale, postscale_factor=postscale,
                                process_set=process_set))
        return tuple(out) if grouped else (out,)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, process_set, grouped = ctx.args
        reduced = _allreduce(list(grads), grouped, None, _NONE, op, pre, post, process_set)
        return (None, None, None, None, None, None, *reduced)


def _allreduce(tensors: list[torch.Tensor], grouped: bool, name: str | None, compression: Any,
               op: ReduceOp, prescale: float, postscale: float,
               process_set: Any) -> list[torch.Tensor]:
    return _compressed(compression, tensors, lambda *wires: _Allreduce.apply(
        name, op, prescale, postscale, process_set, grouped, *wires))


@public("allreduce")
def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = _NONE, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Average (default) or reduce ``tensor`` over the process set; returns a
    new tensor, the input is not modified. Differentiable. ``compression``
    casts the tensor for the wire and back. See ``allreduce_async``."""
    op = resolve_op(op, average)
    check_tensors(tensor)
    return _allreduce([tensor], False, name, compression, op, prescale_factor,
                      postscale_factor, process_set)[0]


@public("allreduce_")
def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    """In-place ``allreduce`` (not differentiable); returns ``tensor``."""
    op = resolve_op(op, average)
    return synchronize(allreduce_async_(
        tensor, name=name, op=op, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, process_set=process_set))


@public("grouped_allreduce")
def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = _NONE, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    """``allreduce`` of a list of tensors as one fused collective; returns a
    list of new tensors. Differentiable."""
    op = resolve_op(op, average)
    tensors = check_tensors(tensors)
    return _allreduce(tensors, True, name, compression, op, prescale_factor, postscale_factor,
                      process_set)


@public("grouped_allreduce_")
def grouped_allreduce_(tensors: list[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> tuple[torch.Tensor, ...]:
    """In-place ``grouped_allreduce`` (not differentiable); returns the tuple
    of input tensors, as Horovod's."""
    op = resolve_op(op, average)
    return synchronize(grouped_allreduce_async_(
        tensors, name=name, op=op, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, process_set=process_set))


class _GroupedAllgather(torch.autograd.Function):
    """allgather of one or more tensors; the gradient keeps this rank's rows."""

    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: Any,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pending, rows, _ = start_gather(list(tensors), name, process_set)
        engine = engine_of(process_set)
        ctx.process_set = process_set
        # (offset, count) of this rank's rows in each output.
        ctx.slices = [(sum(r[:engine.rank]), r[engine.rank]) for r in rows]
        return pending.result()

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        averaged = grouped_allreduce(list(grads), op=ReduceOp.AVERAGE,
                                     process_set=ctx.process_set)
        mine = [g.narrow(0, offset, count) for g, (offset, count) in
                zip(averaged, ctx.slices, strict=True)]
        return (None, None, *mine)


@public("allgather")
def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Concatenate ``tensor`` from every rank along the first dimension (its
    size may differ between ranks). Differentiable."""
    check_tensors(tensor)
    return _GroupedAllgather.apply(name, process_set, tensor)[0]


@public("grouped_allgather")
def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    """``allgather`` of each tensor of a list; returns a list. Differentiable."""
    tensors = check_tensors(tensors)
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: Any) -> torch.Tensor:
        out: torch.Tensor = synchronize(broadcast_async(tensor, root_rank, name, process_set))
        engine = engine_of(process_set)
        ctx.is_root = engine.rank == root_of(engine, root_rank)  # valid: it ran
        ctx.process_set = process_set
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        averaged = allreduce(grad, op=ReduceOp.AVERAGE, process_set=ctx.process_set)
        return (averaged if ctx.is_root else torch.zeros_like(averaged)), None, None, None


@public("broadcast")
def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Return a new tensor holding ``root_rank``'s ``tensor`` (a job-wide rank
    of the process set). Differentiable."""
    check_tensors(tensor)
    return _Broadcast.apply(tensor, root_rank, name, process_set)


@public("broadcast_")
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    """In-place ``broadcast`` (not differentiable); returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: Any) -> Any:
        out, received, _ = exchange(tensor, splits, name, process_set)
        ctx.process_set = process_set
        ctx.received = received
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        back, _ = alltoall(grad, splits=ctx.received, process_set=ctx.process_set)
        return back, None, None, None


@public("alltoall")
def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = global_process_set) -> Any:
    """Scatter row blocks of ``tensor`` to the ranks and gather theirs (see
    ``alltoall_async``). Returns the output alone when ``splits`` is None,
    else ``(output, received_splits)``, as Horovod's. Differentiable."""
    check_tensors(tensor)
    return _Alltoall.apply(tensor, splits, name, process_set)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, prescale: float, postscale: float,
                process_set: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pending, _ = start_reduce_scatter(list(tensors), name, op, prescale, postscale,
                                          process_set)
        size = engine_of(process_set).size
        ctx.factor = (size if op is ReduceOp.SUM else 1) * float(prescale) * float(postscale)
        ctx.process_set = process_set
        return pending.result()

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        scaled = [g * ctx.factor if ctx.factor != 1 else g for g in grads]
        gathered = grouped_allgather(scaled, process_set=ctx.process_set)
        return (None, None, None, None, None, *gathered)


@public("reducescatter")
def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = _NONE,
                  op: Any = ReduceOp.AVERAGE, process_set: Any = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks and return this rank's block of rows
    (see ``reducescatter_async``). Differentiable."""
    check_tensors(tensor)
    op = resolve_op(op, None)
    return _compressed(compression, [tensor], lambda wire: _GroupedReducescatter.apply(
        name, op, prescale_factor, postscale_factor, process_set, wire))[0]


@public("grouped_reducescatter")
def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None,
                          compression: Any = _NONE, op: Any = ReduceOp.AVERAGE,
                          process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """``reducescatter`` of each tensor of a list; returns a list. Differentiable."""
    tensors = check_tensors(tensors)
    op = resolve_op(op, None)
    return _compressed(compression, tensors, lambda *wires: _GroupedReducescatter.apply(
        name, op, prescale_factor, postscale_factor, process_set, *wires))
