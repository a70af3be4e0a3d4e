"""``hvd.join()``: a rank that ran out of data keeps answering the others' steps.

Horovod semantics: a rank calls ``join()`` when it has no more batches; until
every rank has joined it takes part in the ``DistributedOptimizer``
reductions of the ranks still training, contributing zero gradients; then
``join()`` returns on every rank, with the rank that joined last.

Design (no extra collective per step): every optimizer's scheduler has a
*control slot* (``GradientScheduler.control``), a few elements reduced,
unscaled, with its last fusion bucket. It has one element per rank of the
optimizer's process set. A training rank leaves the op's "idle" value
everywhere; a joined rank writes the "joined" value into its own element.
After the reduction every rank reads the same values, so every rank knows
which ranks have joined, and all agree on when everyone has. A joined rank
loops over "zero steps" (``synchronize()`` with no gradient marked ready,
so every gradient contributes zeros) until its flags say everyone has joined.

Limits (documented in ``join``'s docstring): only ``DistributedOptimizer``
steps are answered while joined.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from dp_plugin.engines.base import ReduceOp
from dp_plugin.torch.basics import engine


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


class JoinFlags:
    """The join elements of one optimizer's scheduler control slot.

    ``ranks`` maps element index -> global rank (the optimizer's process
    set); ``slot`` is this process's element. Every rank reads the same
    reduced values, so every rank draws the same conclusions from them.

    A training step only keeps a device-side copy of the reduced elements
    (``keep``: no host synchronization, nothing for a GPU to wait on); a
    join step reads them on the host (``decide``).
    """

    def __init__(self, scheduler: Any, *, op: ReduceOp, ranks: Sequence[int], slot: int,
                 like: torch.Tensor) -> None:
        self.scheduler = scheduler
        self.ranks = list(ranks)
        self.slot = slot
        self._code = code_for(op)
        self._like = like
        self._previous = torch.empty_like(self._slot())
        self._has_previous = False
        self.fill(joined=False)

    def _slot(self) -> torch.Tensor:
        # Asked each time: the slot moves when the bucket plan is rebuilt.
        # Its first len(ranks) elements are ours (the finite flags follow).
        slot: torch.Tensor = self.scheduler.control(self._like)
        return slot[:len(self.ranks)]

    def fill(self, joined: bool) -> None:
        """Write this rank's flags for the next step."""
        slot = self._slot()
        slot.fill_(self._code.idle)
        if joined:
            slot[self.slot] = self._code.joined

    def keep(self) -> None:
        """After a training step: remember its reduced flags (for a later
        ``decide``), then reset them to idle for the next step."""
        self._previous.copy_(self._slot())
        self._has_previous = True
        self.fill(joined=False)

    def decide(self) -> tuple[bool, int]:
        """After a join step: (has every rank joined?, global rank that joined last).

        The last joiners are the ranks that joined in this step; of several,
        the highest rank is returned (they joined in the same step).
        """
        joined = self._joined(self._slot())
        before = self._joined(self._previous) if self._has_previous else [False] * len(joined)
        self.keep()
        if not all(joined):
            return False, -1
        self._has_previous = False  # the next join() round starts afresh
        newest = [i for i, (now, was) in enumerate(zip(joined, before, strict=True))
                  if now and not was]
        return True, self.ranks[max(newest) if newest else len(joined) - 1]

    def _joined(self, reduced: torch.Tensor) -> list[bool]:
        code = self._code
        values = reduced.detach().double().cpu().tolist()
        return [abs(v - code.joined) < abs(v - code.idle) for v in values]


class Joinable(Protocol):
    """What ``join`` needs from a ``DistributedOptimizer``."""

    def _dp_join_ready(self) -> bool:
        """True if it reduces on this rank; raises if a step is half done."""

    def _dp_join_step(self) -> tuple[bool, int]:
        """One zero step: (has every rank joined?, the rank that joined last)."""


_optimizers: list[weakref.ref[Any]] = []


def register(optimizer: Joinable) -> None:
    """Let ``join`` drive ``optimizer`` (held weakly, in creation order)."""
    _optimizers[:] = [r for r in _optimizers if r() is not None]
    _optimizers.append(weakref.ref(optimizer))


def join(device: int = -1) -> int:
    """Wait, answering the other ranks' optimizer steps, until every rank has joined.

    Call it on a rank that has run out of data. Until every rank has called
    ``join()``, this rank takes part in every ``DistributedOptimizer`` step
    of the others with zero gradients (averages still divide by the full
    size, as in Horovod); its own parameters are not updated meanwhile, so
    broadcast parameters from a rank that trained to the end if you keep
    training afterwards. Returns, on every rank, the rank that joined last.

    Collective. Limits: while a rank is joined, only ``DistributedOptimizer``
    steps are answered. Any other collective the training ranks issue in the
    meantime (``hvd.allreduce``, ``broadcast``, ``SyncBatchNorm`` in training
    mode, ...) is not matched and fails on those ranks with a mismatch error
    or after ``DP_PLUGIN_TIMEOUT`` (a clear error, not a silent hang). With
    several optimizers, every rank must call ``join()`` at the same point
    of its step (after all optimizers have stepped). Without any
    ``DistributedOptimizer`` it is a barrier that returns the rank whose
    call arrived last by wall-clock time.

    ``device`` is accepted for compatibility: zero gradients are made on
    each parameter's own device.
    """
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"join(device=...) must be an int device index (-1 for CPU), got "
                        f"{device!r}")
    eng = engine("hvd.join()")
    if eng.size == 1:
        return 0
    live: list[Joinable] = [opt for opt in (r() for r in _optimizers) if opt is not None]
    pending = [opt for opt in live if opt._dp_join_ready()]
    if not pending:
        return _join_without_optimizer(eng)
    last = -1
    while pending:
        still = []
        for opt in pending:
            done, last_joined = opt._dp_join_step()
            if not done:
                still.append(opt)
            elif last < 0:
                last = last_joined  # the first (oldest) optimizer's answer
        pending = still
    return last


def _join_without_optimizer(eng: Any) -> int:
    arrival = torch.zeros(eng.size, dtype=torch.float64)
    arrival[eng.rank] = time.time()
    eng.allreduce_async(arrival, ReduceOp.SUM, name="dp_plugin.join").wait()
    return int(torch.argmax(arrival).item())
