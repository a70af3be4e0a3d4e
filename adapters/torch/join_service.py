"""What a joined rank does when the others run a tensor collective.

After ``hvd.join()`` a rank has no data left, but the ranks still training
may call ``allreduce``, ``allgather``, ``broadcast``, ``reducescatter`` or
``barrier`` (grouped forms too), as Horovod allows. The joined rank keeps
an agreement ``Listener`` posted on each of its engines; when the others'
agreement meets it, every rank learns that it has joined, and the joined
rank learns, from their descriptions, what they are about to run. It then
runs the same engine calls with nothing of its own in them:

- all-reduce: the op's identity (zeros for Sum and Average, as Horovod's
  joined ranks contribute; +inf/-inf/1 for Min/Max/Product), so the result
  is the training ranks' reduction — Average still divides by the full size;
- all-gather: zero rows;
- broadcast: a receive buffer, dropped (a joined root is an error on every rank);
- reduce-scatter: zeros; its block is dropped;
- barrier: the agreement alone.
"""

from __future__ import annotations

from typing import Any

import torch
from dp_plugin.agreement import Heard
from dp_plugin.engines.base import Engine, ReduceOp
from dp_plugin.hooks import ReducePolicy
from dp_plugin.request import joined_view
from dp_plugin.torch.collectives import (
    start_allgathers,
    start_fused_allreduce,
    start_reducescatters,
)


def answer(engine: Engine, heard: Heard) -> None:
    """Run, contributing nothing, the collective the other ranks agreed on (blocks)."""
    described, table = joined_view(engine, heard)
    kind, name = described[0]["kind"], described[0]["name"]
    if kind == "barrier":
        return
    if kind == "allreduce":
        op = ReduceOp.parse(described[0]["op"])
        pre, post = described[0]["scales"]
        outs = [_filled(d, _identity(op, _dtype(d))) for d in described]
        _, handles = start_fused_allreduce(engine, outs, name, op, pre, post)
        for h in handles:
            h.wait()
    elif kind == "allgather":
        zero_rows = [_filled(d, 0, rows=0) for d in described]
        for handle, _ in start_allgathers(engine, zero_rows, table, name):
            handle.wait()
    elif kind == "broadcast":
        d = described[0]
        buf = _filled(d, 0)
        if buf.numel():
            members = list(getattr(engine, "global_ranks", range(engine.size)))
            engine.broadcast(buf.view(-1), members.index(d["root"]), name=name or "broadcast")
    elif kind == "reducescatter":
        op = ReduceOp.parse(described[0]["op"])
        pre, post = described[0]["scales"]
        policy = ReducePolicy.for_collective(op, engine.size, prescale=pre, postscale=post)
        for handle, _ in start_reducescatters(engine, [_filled(d, 0) for d in described],
                                              policy, name):
            handle.wait()
    else:  # the agreement refuses the others first (agreement.JOINABLE)
        raise AssertionError(f"a joined rank cannot answer {kind}")


def _dtype(d: dict[str, Any]) -> torch.dtype:
    dtype = getattr(torch, d["dtype"])
    assert isinstance(dtype, torch.dtype)
    return dtype


def _filled(d: dict[str, Any], value: float, rows: int | None = None) -> torch.Tensor:
    """A tensor like the others' (shape, dtype, device kind), filled with ``value``;
    ``rows`` replaces the first dimension (an all-gather's '*')."""
    shape = list(d["shape"])
    if rows is not None:
        shape[0] = rows
    device = torch.device(d["device"])
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return torch.full(shape, value, dtype=_dtype(d), device=device)


def _identity(op: ReduceOp, dtype: torch.dtype) -> float:
    """The value that leaves ``op``'s reduction unchanged."""
    if op is ReduceOp.PRODUCT:
        return 1
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        big = float("inf") if dtype.is_floating_point else info.max
        return big if op is ReduceOp.MIN else (-big if dtype.is_floating_point else info.min)
    return 0
