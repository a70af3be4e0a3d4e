"""Per-rank marks in an optimizer's control slot: which ranks saw something.

Every ``DistributedOptimizer``'s ``Reducer`` has named groups of per-rank
flags (``Reducer.flags_of``): elements reduced, unscaled, with its last
fusion bucket, so what they carry costs no collective of its own. One
element per rank of the optimizer's process set each: the ``hvd.join()``
flags (``optimizer_state.JoinFlags``), the marks of a parameter unfrozen after
wrapping, a sparse gradient for a parameter wrapped as dense, and
(``DP_PLUGIN_CHECK_FINITE``) the finite flags.
Each rank may mark only its own element, with the op's "marked" code
(``CODES``), so after the reduction every rank reads the same values and
draws the same conclusion: the list of marked ranks.

``DP_PLUGIN_CHECK_FINITE`` (``FiniteFlags``) decides from values every rank
holds identically, so the ranks never disagree about a step: a rank marks
its own element before handing a non-finite gradient to the scheduler
(*which ranks* produced one), and the reduced gradients say *which
parameters* are non-finite (also catching an overflow in the reduction
itself, e.g. fp16 compression). ``skip``: no rank updates the parameters,
and the set's first rank logs one warning; ``raise``:
``NonFiniteGradientError`` on every rank. Marking stays on the device (no
host synchronization per gradient); the decision reads one small tensor per
step on the host.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from dp_plugin.engines.base import ReduceOp
from dp_plugin.errors import NonFiniteGradientError

log = logging.getLogger("dp_plugin")

SHOWN = 5
"""At most this many parameter names in a non-finite message."""


@dataclass(frozen=True)
class FlagCode:
    """What ranks write into an element, and so what its reduction holds (the
    control slot is not scaled, and one element has at most one "joined"
    writer: its own rank)."""

    idle: float
    joined: float


CODES = {ReduceOp.MIN: FlagCode(0.0, -1.0), ReduceOp.PRODUCT: FlagCode(1.0, 2.0)}
"""Per op; any other (sum, average: a sum here, max) uses ``FlagCode(0.0, 1.0)``."""


class RankMarks:
    """The reducer's flag group ``name``: one mark per rank of its engine
    (``ranks`` maps element index -> global rank; ``slot`` is this
    process's element); ``like`` is a tensor on the gradients' device and
    dtype."""

    def __init__(self, reducer: Any, name: str, *, op: ReduceOp, like: torch.Tensor) -> None:
        self.reducer = reducer
        self.name = name
        self.ranks = list(reducer.engine.global_ranks)
        self.slot = reducer.engine.rank
        self._code = CODES.get(op, FlagCode(0.0, 1.0))
        self._like = like
        self.reset()

    def _elements(self) -> torch.Tensor:
        # Asked each time: the elements move when the bucket plan is rebuilt.
        return self.reducer.flags_of(self.name, self._like)

    def reset(self) -> None:
        """Every element unmarked (before the next step's reduction)."""
        self._elements().fill_(self._code.idle)

    def mark(self, when: bool | torch.Tensor = True) -> None:
        """Mark this rank's element if ``when`` (a bool, or a 0-d bool tensor
        on any device: marking it needs no host synchronization)."""
        mine = self._elements()[self.slot]
        if isinstance(when, bool):
            if when:
                mine.fill_(self._code.joined)
            return
        marked = torch.full_like(mine, self._code.joined)
        mine.copy_(torch.where(when.to(mine.device), marked, mine))

    def marked(self) -> list[int]:
        """After the reduction: the global ranks that marked their element."""
        marked = self.flags(self._elements())
        return [rank for rank, m in zip(self.ranks, marked, strict=True) if m]

    def flags(self, reduced: torch.Tensor) -> list[bool]:
        """Per element of ``reduced`` (these elements, reduced): is it marked?"""
        code = self._code
        values = reduced.detach().double().cpu().tolist()
        return [abs(v - code.joined) < abs(v - code.idle) for v in values]


class FiniteFlags(RankMarks):
    """The ``DP_PLUGIN_CHECK_FINITE`` marks: a rank marks its own element
    when its gradient is not finite; ``decide`` after the reduction."""

    def __init__(self, reducer: Any, *, mode: str, op: ReduceOp, like: torch.Tensor) -> None:
        super().__init__(reducer, "finite", op=op, like=like)
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
    """Per tensor: all finite? One host transfer, not one per tensor (the
    flags are stacked on the first one's device)."""
    if not grads:
        return []
    flags = [torch.isfinite(g).all() for g in grads]
    return [bool(ok) for ok in torch.stack([f.to(flags[0].device) for f in flags]).tolist()]
