"""Plumbing shared by the tensor collectives: names and checks.

Every collective of ``dp_plugin.torch`` starts the same way: find the engine
of its process set (``process_sets.engine_of``), resolve Horovod's
``op``/``average`` arguments (``ops.resolve_op``), refuse a name still in flight on this rank,
and run the core's one cross-rank check (``dp_plugin.agree.check``), which
finds every rank's own mistakes (an unsupported dtype, bad splits, ...) and
raises on every rank alike. Only then does data move.
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from dp_plugin.agree.check import check
from dp_plugin.agree.edge import caller
from dp_plugin.agree.request import Agreed, Request
from dp_plugin.engines.base import Engine
from dp_plugin.errors import DPPluginError
from dp_plugin.torch.handles import name_in_flight


class DuplicateNameError(DPPluginError, ValueError):
    """A collective was started with a name still in flight on this rank.

    Raised on that rank alone, before anything is sent (Horovod's rule): the
    other ranks are not involved and the job stays usable."""


def check_tensors(tensors: Any) -> list[torch.Tensor]:
    """The inputs as a list of dense tensors (TypeError/ValueError otherwise).

    Argument-type mistakes raise at once on the rank that made them: in an
    SPMD program every rank makes them alike."""
    what = caller()
    if tensors is None:
        raise TypeError(
            f"{what}: the input is None, not a torch.Tensor. A parameter's .grad is None "
            "until a backward pass reaches it, and stays None for a parameter with "
            "requires_grad=False; pass a tensor (e.g. torch.zeros_like(p) for a missing "
            "gradient) or skip the call on every rank alike: a rank that skips it alone "
            "leaves the others waiting until DP_PLUGIN_TIMEOUT"
        )
    items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: input {i} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise TypeError(
                f"{what}: input {i} is a {t.layout} tensor; dense collectives take strided "
                "tensors (use sparse_allreduce_async for sparse COO tensors, or .to_dense())"
            )
    if not items:
        raise ValueError(f"{what}: the list of tensors is empty; pass at least one tensor")
    return items


def agree(engine: Engine, kind: str, tensors: Sequence[torch.Tensor], name: str | None,
          process_set: Any, **fields: Any) -> tuple[Hashable | None, Agreed]:
    """Run the core's check (``dp_plugin.agree.check``) for one collective
    over ``tensors``; ``fields`` complete the ``Request`` (op, scales, root,
    splits, a problem the caller found).

    A name still in flight on this rank raises ``DuplicateNameError`` here
    alone, before anything is sent (Horovod's rule; the job stays usable).
    Returns the name key to register with the handle once the collective is
    started, and what the ranks agreed.
    """
    key = None
    if name is not None:  # names are per process set, as in Horovod
        set_id = getattr(process_set, "process_set_id", None)
        key = (id(process_set) if set_id is None else set_id, name)
    if key is not None and name_in_flight(key):
        raise DuplicateNameError(
            f"Duplicate name {name!r}: a {kind} was started with a name that is still in "
            "flight on this rank (an earlier *_async call with this name was not synchronized "
            "yet); Horovod: 'Requested to allreduce, allgather, or broadcast a tensor with the "
            "same name as another tensor that is currently being processed'. synchronize() "
            "the earlier handle first or use another name. Only this rank raises; nothing "
            "was sent"
        )
    return key, check(engine, Request.of(kind, tensors, name=name, **fields),
                      accept_joined=True)


def contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy of ``t``'s data, outside autograd."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def check_factor(value: Any, arg: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{caller()}: {arg}={value!r} must be a number (default 1.0)")
    return float(value)
