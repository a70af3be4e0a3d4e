"""``DP_PLUGIN_CHECK_FINITE``: every rank decides alike about inf/nan gradients.

The decision is taken after the gradient all-reduce, from values every rank
holds identically, so the ranks can never disagree about a step:

- a per-rank *finite flag* travels in the optimizer scheduler's control slot
  (after the ``hvd.join()`` flags, one element per rank of the process set,
  written with the same codes as the join flags): before a gradient is handed
  to the scheduler its rank marks its own element if the gradient holds a
  non-finite value, so after the reduction every rank knows *which ranks*
  produced one;
- the reduced gradients themselves say *which parameters* are non-finite (an
  inf or nan on any rank stays non-finite in the sum), and also catch an
  overflow in the reduction itself (e.g. fp16 compression).

``skip``: ``step()`` does not update the parameters on any rank, and the
process set's first rank logs one warning per skipped step. ``raise``:
``NonFiniteGradientError`` on every rank, naming the parameters and ranks.
Marking is done on the device (no host synchronization per gradient); the
decision reads one small tensor per step on the host.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from dp_plugin.engines.base import ReduceOp
from dp_plugin.errors import NonFiniteGradientError
from dp_plugin.torch.rank_marks import RankMarks

log = logging.getLogger("dp_plugin")

MODES = ("skip", "raise")
SHOWN = 5
"""At most this many parameter names in a message."""


class SkippedStep(Exception):
    """Raised by a synchronized closure to abort ``step()`` on every rank alike
    (``DistributedOptimizer.step`` catches it and returns ``loss``)."""

    def __init__(self, loss: Any) -> None:
        super().__init__("step skipped: non-finite gradients")
        self.loss = loss


class FiniteFlags(RankMarks):
    """The finite-check elements of one optimizer's control slot (``RankMarks``
    at ``offset``): a rank marks its own element when its gradient is not finite."""

    def __init__(self, scheduler: Any, *, mode: str, op: ReduceOp, ranks: Sequence[int],
                 slot: int, offset: int, like: torch.Tensor) -> None:
        if mode not in MODES:
            raise ValueError(f"check_finite mode {mode!r} is not known; valid modes: "
                             f"{', '.join(MODES)}")
        super().__init__(scheduler, op=op, ranks=ranks, slot=slot, offset=offset, like=like)
        self.mode = mode
        self.step = 0

    def note(self, grad: torch.Tensor) -> None:
        """Before ``grad`` goes to the scheduler: mark this rank if it is not finite."""
        values = grad._values() if grad.is_sparse else grad
        self.mark(~torch.isfinite(values).all())

    def decide(self, named: Sequence[tuple[str, torch.Tensor | None]]) -> bool:
        """After the reduction, on every rank alike: True to skip this step.

        ``named`` are the parameters' names and reduced gradients. Raises
        ``NonFiniteGradientError`` in ``raise`` mode. Resets the flags.
        """
        step, self.step = self.step, self.step + 1
        ranks = self.marked()  # the ranks whose own gradients were not finite
        self.reset()
        grads = [(n, g._values() if g.is_sparse else g) for n, g in named if g is not None]
        finite = _all_finite([g for _, g in grads])
        names = [n for (n, _), ok in zip(grads, finite, strict=True) if not ok]
        if not ranks and not names:
            return False
        text = describe(step, names, ranks)
        if self.mode == "raise":
            raise NonFiniteGradientError(
                f"{text}. Every rank raises this. Fix: lower the learning rate, clip the "
                "gradients or scale the loss (AMP), or set DP_PLUGIN_CHECK_FINITE=skip to "
                "skip such steps"
            )
        if self.slot == 0:
            log.warning("%s; the optimizer step is skipped on every rank "
                        "(DP_PLUGIN_CHECK_FINITE=skip)", text)
        return True


def describe(step: int, names: Sequence[str], ranks: Sequence[int]) -> str:
    """One sentence: which parameters and which ranks."""
    shown = ", ".join(repr(n) for n in names[:SHOWN])
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    params = f"parameter {shown}{more}" if names else "no parameter"
    if ranks:
        where = f"it first appeared on rank {', '.join(map(str, ranks))} before the all-reduce"
    else:
        where = ("no rank's own gradient had one: the all-reduce itself overflowed (e.g. "
                 "fp16 compression or a sum beyond the dtype's range)")
    return (f"non-finite gradient (inf or nan) in optimizer step {step}: {params} after "
            f"the all-reduce; {where}")


def _all_finite(grads: Sequence[torch.Tensor]) -> list[bool]:
    """Per tensor: all finite? One host transfer per device, not per tensor."""
    flags = [torch.isfinite(g).all() for g in grads]
    by_device: dict[torch.device, list[int]] = {}
    for i, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(i)
    result = [True] * len(flags)
    for indices in by_device.values():
        for i, ok in zip(indices, torch.stack([flags[i] for i in indices]).tolist(),
                         strict=True):
            result[i] = bool(ok)
    return result
