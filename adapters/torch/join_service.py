"""What a joined rank runs when the others run an all-reduce or a barrier.

After ``hvd.join()`` a rank has no data left, but the ranks still training
may call ``allreduce`` or ``barrier`` (grouped forms too), as Horovod
allows (``dp_plugin.join`` says what is answered and what is refused).
When the others' agreement meets the joined rank's ``Listener``, it learns
from their descriptions what they are about to run, and runs the same
engine calls with nothing of its own in them:

- all-reduce: the op's identity (zeros for Sum and Average, as Horovod's
  joined ranks contribute; +inf/-inf/1 for Min/Max/Product), so the result
  is the training ranks' reduction — Average still divides by the full size;
- barrier: the agreement alone.
"""

from __future__ import annotations

from typing import Any

import torch
from dp_plugin.engines.base import Engine, ReduceOp
from dp_plugin.request import Agreed
from dp_plugin.torch.collectives import start_fused_allreduce


def answer(engine: Engine, described: list[dict[str, Any]], agreed: Agreed) -> None:
    """Run, contributing nothing, the collective the other ranks agreed on
    (one description per tensor; blocks)."""
    kind, name = described[0]["kind"], described[0]["name"]
    if kind == "barrier":
        return
    if kind != "allreduce":  # dp_plugin.join.answerable said no first
        raise AssertionError(f"a joined rank cannot answer {kind}")
    op = ReduceOp.parse(described[0]["op"])
    pre, post = described[0]["scales"]
    outs = [_filled(d, _identity(op, _dtype(d))) for d in described]
    _, handles = start_fused_allreduce(engine, outs, name, op, pre, post)
    for h in handles:
        h.wait()


def _dtype(d: dict[str, Any]) -> torch.dtype:
    dtype = getattr(torch, d["dtype"])
    assert isinstance(dtype, torch.dtype)
    return dtype


def _filled(d: dict[str, Any], value: float) -> torch.Tensor:
    """A tensor like the others' (shape, dtype, device kind), filled with ``value``."""
    device = torch.device(d["device"])
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return torch.full(list(d["shape"]), value, dtype=_dtype(d), device=device)


def _identity(op: ReduceOp, dtype: torch.dtype) -> float:
    """The value that leaves ``op``'s reduction unchanged."""
    if op is ReduceOp.PRODUCT:
        return 1
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        big = float("inf") if dtype.is_floating_point else info.max
        return big if op is ReduceOp.MIN else (-big if dtype.is_floating_point else info.min)
    return 0
