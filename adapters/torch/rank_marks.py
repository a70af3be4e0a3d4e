"""Per-rank marks in an optimizer's control slot: which ranks saw something.

One element per rank of the optimizer's process set, at ``offset`` in the
scheduler's control slot (reduced, unscaled, with the last fusion bucket).
Each rank may mark only its own element, with the op's "marked" code
(``code_for``), so after the reduction every rank reads the same
values and draws the same conclusion: the list of marked ranks. Used for
``hvd.join()`` (``joining.JoinFlags``: a rank that has joined), for
``DP_PLUGIN_CHECK_FINITE`` (``finite.FiniteFlags``: a rank's own gradient
held inf/nan) and for a parameter unfrozen after wrapping on some ranks only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from dp_plugin.engines.base import ReduceOp


@dataclass(frozen=True)
class FlagCode:
    """What ranks write into an element, and so what its reduction holds (the
    control slot is not scaled, and one element has at most one "joined"
    writer: its own rank)."""

    idle: float
    joined: float


def code_for(op: ReduceOp) -> FlagCode:
    if op is ReduceOp.MIN:
        return FlagCode(0.0, -1.0)
    if op is ReduceOp.PRODUCT:
        return FlagCode(1.0, 2.0)
    return FlagCode(0.0, 1.0)  # sum (average is a sum here), max


class RankMarks:
    """``ranks`` maps element index -> global rank; ``slot`` is this process's
    element; ``like`` is a tensor on the control slot's device and dtype."""

    def __init__(self, scheduler: Any, *, op: ReduceOp, ranks: Sequence[int], slot: int,
                 offset: int, like: torch.Tensor) -> None:
        self.scheduler = scheduler
        self.ranks = list(ranks)
        self.slot = slot
        self.offset = offset
        self._code = code_for(op)
        self._like = like
        self.reset()

    def _elements(self) -> torch.Tensor:
        # Asked each time: the control slot moves when the bucket plan is rebuilt.
        control: torch.Tensor = self.scheduler.control(self._like)
        return control[self.offset:self.offset + len(self.ranks)]

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
