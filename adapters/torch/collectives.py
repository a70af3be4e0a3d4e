"""Asynchronous tensor collectives, as horovod.torch 0.28.1's ``*_async`` functions.

Each returns an ``int`` handle for ``poll``/``synchronize`` (``handles.py``).
The distributed contract (agreement check at the call, what is asynchronous,
names, in-place variants) is docs/torch.md, "Tensor collectives".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from dp_plugin.agree.check import check
from dp_plugin.agree.edge import caller, public
from dp_plugin.agree.request import Request
from dp_plugin.api.process_sets import engine_of, global_process_set
from dp_plugin.engines.base import ReduceOp
from dp_plugin.reduce.arrays import TorchOps
from dp_plugin.reduce.collective import fused_collective
from dp_plugin.reduce.hooks import ReducePolicy
from dp_plugin.torch.handles import InFlight, Ready, new_handle
from dp_plugin.torch.ops import resolve_op
from dp_plugin.torch.submit import agree, check_factor, check_tensors, contiguous_copy

__all__ = [
    "allgather_async", "allreduce_async", "allreduce_async_", "alltoall_async", "barrier",
    "broadcast_async", "broadcast_async_", "grouped_allgather_async", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter_async", "reducescatter_async",
]


@public("allreduce_async")
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> int:
    """Start averaging (default) or reducing ``tensor`` over the process set;
    the input is not modified. ``synchronize(handle)`` returns a new tensor
    of the same shape and dtype. ``op``: Average, Sum, Min, Max, Product;
    ``average`` is deprecated (True: Average, False: Sum). Average of integer
    tensors truncates toward zero, as Horovod's."""
    return _start_allreduce(tensor, False, False, name, resolve_op(op, average),
                            prescale_factor, postscale_factor, process_set)


@public("allreduce_async_")
def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> int:
    """In-place ``allreduce_async``: ``synchronize`` writes the result into
    ``tensor`` and returns it."""
    return _start_allreduce(tensor, True, False, name, resolve_op(op, average),
                            prescale_factor, postscale_factor, process_set)


@public("grouped_allreduce_async")
def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = global_process_set) -> int:
    """``allreduce_async`` of a list of tensors, fused into one collective per
    dtype and device; ``synchronize`` returns a tuple of new tensors."""
    return _start_allreduce(tensors, False, True, name, resolve_op(op, average),
                            prescale_factor, postscale_factor, process_set)


@public("grouped_allreduce_async_")
def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> int:
    """In-place ``grouped_allreduce_async``: ``synchronize`` returns the tuple
    of input tensors, now holding the results."""
    return _start_allreduce(tensors, True, True, name, resolve_op(op, average),
                            prescale_factor, postscale_factor, process_set)


def _start_allreduce(inputs: Any, inplace: bool, grouped: bool,
                     name: str | None, op: ReduceOp, prescale: Any, postscale: Any,
                     process_set: Any) -> int:
    """One ``fused_collective`` per call (large tensors alone, the rest in
    8 MiB chunks, see ``dp_plugin.reduce.collective``), scaled by the one
    ``ReducePolicy``; ``synchronize`` unpacks the results."""
    tensors = check_tensors(inputs)
    pre = check_factor(prescale, "prescale_factor")
    post = check_factor(postscale, "postscale_factor")
    engine = engine_of(process_set)
    key, _ = agree(engine, "allreduce", tensors, name, process_set, op=op, scales=(pre, post))
    outs = [_output(t, inplace) for t in tensors]
    # Out of place (or a strided in-place tensor): the inputs are only read.
    sources = (None if inplace and all(t.is_contiguous() for t in tensors)
               else [t.detach() for t in tensors])
    fused = fused_collective(outs, engine=engine, name=name or "allreduce",
                             policy=ReducePolicy(op, engine.size, prescale=pre, postscale=post),
                             sources=sources)

    def finish() -> Any:
        fused.finish()
        results = ([_copy_back(t, out) for t, out in zip(tensors, outs, strict=True)]
                   if inplace else outs)
        return tuple(results) if grouped else results[0]

    return new_handle(InFlight(fused.handles, finish), key)


@public("allgather_async")
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: Any = global_process_set) -> int:
    """Concatenate ``tensor`` from every rank along the first dimension (which
    may differ between ranks). The rows move in the background (gloo, nccl,
    mpi): ``poll`` says when; ``synchronize`` returns the result."""
    pending, _, key = start_gather(check_tensors(tensor), name, process_set, grouped=False)
    return new_handle(pending, key)


@public("grouped_allgather_async")
def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None,
                            process_set: Any = global_process_set) -> int:
    """``allgather_async`` of each tensor of a list; ``synchronize`` returns a tuple."""
    pending, _, key = start_gather(check_tensors(tensors), name, process_set)
    return new_handle(pending, key)


def start_gather(tensors: list[torch.Tensor], name: str | None, process_set: Any,
                 grouped: bool = True) -> tuple[InFlight, list[list[int]], Any]:
    """Start the agreed all-gathers (a joined rank runs them too, with no
    rows): (the pending outputs, a tuple if ``grouped``, every rank's first
    dimension per tensor (for the gradient), name key)."""
    engine = engine_of(process_set)
    key, agreed = agree(engine, "allgather", tensors, name, process_set)
    started = [engine.allgather_async(t.detach().contiguous(), agreed.rows(i),
                                      name or "allgather") for i, t in enumerate(tensors)]
    pending = _pending(started, grouped, lambda out: out)
    return pending, [agreed.rows(i) for i in range(len(tensors))], key


def _pending(started: list[Any], grouped: bool,
             finish: Callable[[torch.Tensor], torch.Tensor]) -> InFlight:
    """The engine's ``(handle, result)`` pairs as one collective whose result
    is ``finish`` of each output: a tuple (``grouped``) or the one output."""
    def results() -> Any:
        outs = tuple(finish(result()) for _, result in started)
        return outs if grouped else outs[0]

    return InFlight([h for h, _ in started], results)


@public("broadcast_async")
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set) -> int:
    """Broadcast ``tensor`` from ``root_rank`` (a job-wide rank, as in Horovod,
    that belongs to the process set); the input is not modified. Runs at the
    call; ``synchronize`` returns a new tensor."""
    return _start_broadcast(tensor, root_rank, name, process_set, False)


@public("broadcast_async_")
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> int:
    """In-place ``broadcast_async``: ``tensor`` receives the root's values."""
    return _start_broadcast(tensor, root_rank, name, process_set, True)


def _start_broadcast(tensor: torch.Tensor, root_rank: int, name: str | None, process_set: Any,
                     inplace: bool) -> int:
    (t,) = check_tensors(tensor)
    engine = engine_of(process_set)
    # Horovod's root rule (roots.root_of: an int raises at once; a root outside
    # the set is a problem of the agreement, so that every rank raises).
    key, agreed = agree(engine, "broadcast", [t], name, process_set, root=root_rank)
    # In place when it is one dense block, else into a copy: the input is never modified.
    out = t.detach() if inplace and t.is_contiguous() else contiguous_copy(t)
    if out.numel():
        engine.broadcast(out.view(-1), agreed.root, name=name or "broadcast")
    return new_handle(Ready(_copy_back(t, out) if inplace else out), key)


def _output(t: torch.Tensor, inplace: bool) -> torch.Tensor:
    """Where an all-reduce's result is written: the caller's tensor in place
    when it is one dense block, else a fresh contiguous tensor, uninitialized:
    the reduction reads ``t`` and copies it in bucket by bucket, while earlier
    buckets are on the wire (``fused_collective``), where a copy made here would
    delay the first byte by a pass over the whole list."""
    if inplace and t.is_contiguous():
        return t.detach()
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _copy_back(t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``t``, holding the result written into ``out`` (an in-place op)."""
    if out.data_ptr() != t.data_ptr():
        t.detach().copy_(out)
    return t


@public("alltoall_async")
def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = global_process_set) -> int:
    """Send ``splits[j]`` rows of ``tensor`` (first dimension, in order) to
    rank j of the process set; receive the rows every rank sends here,
    concatenated in rank order. ``splits=None`` divides the first dimension
    evenly. Runs at the call; ``synchronize`` returns ``(output,
    received_splits)`` (int32, or ``splits``' dtype when it is a tensor)."""
    out, received, key = exchange(tensor, splits, name, process_set)
    return new_handle(Ready((out, received)), key)


def exchange(tensor: torch.Tensor, splits: Any, name: str | None,
             process_set: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Run the alltoall; return the output, the received splits and the name key."""
    (t,) = check_tensors(tensor)
    engine = engine_of(process_set)
    key, agreed = agree(engine, "alltoall", [t], name, process_set, splits=splits)
    out, received = engine.alltoall(t.detach().contiguous(), agreed.counts(),
                                    name or "alltoall")
    like = splits if isinstance(splits, torch.Tensor) else torch.empty(0, dtype=torch.int32)
    return out, torch.tensor(received, dtype=like.dtype, device=like.device), key


@public("reducescatter_async")
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = ReduceOp.AVERAGE,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Reduce ``tensor`` (same shape on every rank) and give each rank a block
    of rows: ``rows // size`` each, the first ``rows % size`` ranks one more
    (Horovod's rule). ``op``: Average (default) or Sum. The reduction runs in
    the background (gloo, nccl, mpi, horovod); ``synchronize`` returns the block."""
    return new_handle(*start_reduce_scatter(check_tensors(tensor), name, op, prescale_factor,
                                            postscale_factor, process_set, grouped=False))


@public("grouped_reducescatter_async")
def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None,
                                op: Any = ReduceOp.AVERAGE,
                                process_set: Any = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """``reducescatter_async`` of each tensor of a list; ``synchronize``
    returns a tuple."""
    return new_handle(*start_reduce_scatter(check_tensors(tensors), name, op, prescale_factor,
                                            postscale_factor, process_set))


def start_reduce_scatter(tensors: list[torch.Tensor], name: str | None, op: Any,
                         prescale: Any, postscale: Any, process_set: Any,
                         grouped: bool = True) -> tuple[InFlight, Any]:
    """Start the agreed reduce-scatters of pre-scaled copies of ``tensors`` (a
    joined rank runs them too, on zeros): (the pending post-scaled outputs, a
    tuple if ``grouped``, name key)."""
    op = resolve_op(op, None)
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(
            f"{caller()}: op={op.name.capitalize()} is not supported; reducescatter supports "
            "op=hvd.Average and op=hvd.Sum (as Horovod's)"
        )
    pre = check_factor(prescale, "prescale_factor")
    post = check_factor(postscale, "postscale_factor")
    engine = engine_of(process_set)
    key, _ = agree(engine, "reducescatter", tensors, name, process_set, op=op,
                   scales=(pre, post))
    policy = ReducePolicy(op, engine.size, prescale=pre, postscale=post)
    ops = TorchOps()
    started = []
    for t in tensors:
        buf = contiguous_copy(t)
        ops.scale_(buf, policy.prescale)
        started.append(engine.reducescatter_async(buf, policy.engine_op,
                                                  name or "reducescatter"))

    def scaled(out: torch.Tensor) -> torch.Tensor:
        ops.scale_(out, policy.postscale)
        return out

    return _pending(started, grouped, scaled), key


@public("barrier")
def barrier(process_set: Any = global_process_set) -> None:
    """Block until every rank of the process set has called ``barrier``.

    It is the agreement check alone (an all-gather completes on no rank
    before every rank has entered it), so a rank that calls another
    collective here instead makes every rank raise."""
    check(engine_of(process_set), Request(kind="barrier"), accept_joined=True)
