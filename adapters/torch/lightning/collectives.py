"""Lightning's collective calls on dp_plugin, for the Trainer's and Fabric's strategies.

Both strategies' ``reduce``/``all_reduce`` and ``all_gather`` are these
functions: every rank takes part, ``group`` must be None or torch's
``WORLD`` (a subset of ranks is a dp_plugin process set, not a torch group), and
the reductions take Lightning's names (``"mean"``, ``"sum"``, ...) or a
``torch.distributed.ReduceOp``.
"""

from __future__ import annotations

from typing import Any

import dp_plugin.torch as hvd
import torch

_REDUCE_OPS = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "min": hvd.Min,
               "max": hvd.Max, "product": hvd.Product}


def reduce(tensor: Any, group: Any, reduce_op: Any, who: str) -> Any:
    """All-reduce ``tensor`` over every rank; any other value is returned
    unchanged, as Lightning's strategies do."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    _check_group(group, who)
    return hvd.allreduce(tensor, op=_reduce_op(reduce_op, who))


def all_gather(tensor: torch.Tensor, group: Any, sync_grads: bool, who: str) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along a new first dimension, as DDP's;
    with ``sync_grads`` the result is differentiable."""
    _check_group(group, who)
    if sync_grads:
        return hvd.allgather(tensor.unsqueeze(0))
    with torch.no_grad():
        return hvd.allgather(tensor.detach().unsqueeze(0))


def _check_group(group: Any, who: str) -> None:
    """None or torch's WORLD (Fabric's default) are every rank; refuse others."""
    world = torch.distributed.group.WORLD if torch.distributed.is_available() else None
    if group is not None and group is not world:
        raise ValueError(
            f"{who}: group={group!r} is not supported; it runs over every "
            "rank. Leave group=None, or call dp_plugin.torch's collectives with a "
            "process_set= for a subset of ranks")


def _reduce_op(reduce_op: Any, who: str) -> Any:
    if reduce_op is None:
        return hvd.Average
    name = getattr(reduce_op, "name", reduce_op)  # torch.distributed.ReduceOp.SUM -> "SUM"
    op = _REDUCE_OPS.get(str(name).lower())
    if op is None:
        raise ValueError(
            f"{who}: reduce_op={reduce_op!r} is not supported; use one of "
            f"{sorted(_REDUCE_OPS)} or a torch.distributed.ReduceOp of the same names")
    return op
