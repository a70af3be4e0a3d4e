"""Checks that turn a misuse of ``DistributedOptimizer`` into a clear error
(or warning) instead of replicas that silently diverge.

- ``unfrozen`` / ``check_requires_grad``: a parameter unfrozen after
  wrapping has no hook and no bucket, so its gradient would stay local. Each
  rank marks itself in the optimizer's control slot (``RankMarks``) when it
  finds one, so a change on some ranks only still raises on every rank.
  Frozen after wrapping is fine: it stays in its bucket and contributes
  zeros, alike on every rank.
- ``check_open``: a wrapper kept across ``hvd.shutdown()``/``hvd.init()``
  holds a closed communicator.
- ``warn_if_ddp``: the parameters of a model wrapped in torch's
  ``DistributedDataParallel`` would be averaged twice.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from dp_plugin.errors import DPPluginError
from dp_plugin.torch.optimizer_args import default_name


def check_open(st: Any, what: str) -> None:
    """Raise if the engine the optimizer ``st`` was wrapped under was shut down."""
    if st.closed:
        raise DPPluginError(
            f"optimizer.{what}: this DistributedOptimizer was created before "
            "hvd.shutdown(), and its communicator closed with that engine; a new "
            "hvd.init() does not reopen it. Fix: after hvd.init(), wrap again on every "
            "rank: optimizer = hvd.DistributedOptimizer(optimizer, ...) (the old wrapper "
            "may be passed; its state and param_groups are kept), then "
            "hvd.broadcast_parameters and hvd.broadcast_optimizer_state"
        )


def unfrozen(st: Any, param_groups: list[dict[str, Any]]) -> list[str]:
    """Descriptions of the parameters without a hook (``st.frozen``) that now
    require a gradient: unfrozen after wrapping. Runs once per step: it looks
    only at the parameters that were frozen when the hooks were made."""
    found = []
    for gi, pj in st.frozen:
        group = param_groups[gi]
        p = group["params"][pj]
        if p.requires_grad:
            name = st.names.get(p, default_name(group, gi, pj))
            found.append(f"{name!r} (param_groups[{gi}]['params'][{pj}], shape "
                         f"{tuple(p.shape)})")
    return found


def check_requires_grad(mine: list[str], ranks: list[int] | None = None) -> None:
    """Raise if a parameter was unfrozen after wrapping: here (``mine``, from
    ``unfrozen``) or on any of ``ranks`` (every rank learns these from the
    control slot, so every rank raises at the same ``synchronize()``)."""
    if not mine and not ranks:
        return
    where = f" on rank {', '.join(map(str, ranks))}" if ranks else ""
    what = (f"parameter {', '.join(mine)}" if mine
            else "a parameter (named in that rank's error)")
    raise DPPluginError(
        f"{what}{where} requires a gradient now but did not when the "
        "DistributedOptimizer was wrapped, so its gradient would not be averaged "
        "across ranks and the replicas would silently diverge; this step is dropped on "
        "every rank. Fix: set requires_grad alike on every rank, then call "
        "optimizer.refresh_parameters() on every rank (between steps), or set "
        "requires_grad before wrapping (freezing later needs nothing: a frozen "
        "parameter contributes zeros)"
    )


_DDP_PREFIX = "module."


def warn_if_ddp(named: Iterable[tuple[str, torch.Tensor]] | None) -> None:
    """Warn when ``named_parameters`` look like a ``DistributedDataParallel``'s.

    torch's DDP leaves no mark on the parameters it reduces (its reducer
    hooks the gradient accumulators in C++), so the signal is the names:
    ``DDP.named_parameters()`` prefixes every one with ``module.``.
    """
    if named is None:
        return
    names = [name for name, _ in named]
    if names and all(name.startswith(_DDP_PREFIX) for name in names):
        warnings.warn(
            "every name in named_parameters starts with 'module.', as those of a model "
            "wrapped in torch.nn.parallel.DistributedDataParallel: if it is, DDP already "
            "averages the gradients and DistributedOptimizer would reduce them a second "
            "time. Fix: use one of the two, e.g. pass the plain model "
            "(model.module.named_parameters()) and do not wrap it in DDP",
            stacklevel=3,
        )
