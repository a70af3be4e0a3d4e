"""Autotune of the fusion threshold (``DP_PLUGIN_AUTOTUNE=1``).

During the first steps the gradient scheduler tries each candidate bucket
size in turn: after the first step (and its bucket rebuild) it switches to
the first candidate, drops ``warmup_steps`` steps (new buffers, first
touches), then times ``steps`` steps as the wall time between the ends of
successive ``synchronize()`` calls, i.e. one whole training step. After the
last candidate the medians are compared and the fastest threshold is kept.

Distributed contract: every rank builds its ``Autotuner`` with the same
candidates and step counts (they come from the ``Config``, which the first
step's agreement compares) and calls ``step_ended`` once per step, at the end of
``synchronize()``, so every rank switches at the same step, outside any
backward pass. The decision is never taken by a rank alone: rank 0's
medians are broadcast (``share``, one small collective) and every rank
picks from those same numbers with the same rule (``choose``), so the
bucket plans stay identical. Candidates that give the same
bucket plan (e.g. every threshold larger than the model) are measured once.

No framework and no engine: the scheduler passes ``plan_key`` (the bucket
plan a threshold gives) and ``share`` (rank 0's values on every rank), then
re-plans and records the threshold ``step_ended`` returns.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

clock: Callable[[], float] = time.perf_counter
"""The clock steps are timed with (tests replace it to give each rank other timings)."""


@dataclass(frozen=True)
class Decision:
    """What autotune measured and chose."""

    candidates: tuple[int, ...]
    """The distinct thresholds measured, in bytes, in the order they were tried."""
    medians: tuple[float, ...]
    """Rank 0's median step time per candidate (seconds): these decide."""
    local_medians: tuple[float, ...]
    """This rank's own medians (for the timeline; they decide nothing)."""
    chosen: int
    configured: int

    def describe(self) -> str:
        timings = ", ".join(f"{mib(t)}: {m * 1e3:.2f} ms"
                            for t, m in zip(self.candidates, self.medians, strict=True))
        return (f"autotune chose fusion threshold {mib(self.chosen)} ({self.chosen} bytes; "
                f"configured {mib(self.configured)}); median step time per threshold on "
                f"rank 0: {timings}")

    def as_args(self) -> dict[str, object]:
        """The measurements as timeline event arguments."""
        return {"chosen": self.chosen, "configured": self.configured,
                "candidates": list(self.candidates), "rank0_median_s": list(self.medians),
                "local_median_s": list(self.local_medians)}


def mib(nbytes: float, spec: str = "g") -> str:
    """``nbytes`` for a person: "25 MiB", "4 KiB", "40 B"; ``spec`` formats the
    number of GiB, MiB or KiB (``".4g"``: at most 4 significant digits)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):{spec}} {unit}"
    return f"{nbytes:g} B"


def choose(candidates: Sequence[int], medians: Sequence[float], configured: int) -> int:
    """The threshold with the lowest median step time.

    Ties (equal medians) keep ``configured`` if it is among them (no change
    for nothing), else the largest tied threshold (fewer collectives). A
    pure function of its arguments: ranks given the same numbers choose alike.
    """
    if not candidates or len(candidates) != len(medians):
        raise ValueError(f"autotune needs one median per candidate, got {len(candidates)} "
                         f"candidates and {len(medians)} medians")
    best = min(medians)
    tied = [t for t, m in zip(candidates, medians, strict=True) if m == best]
    return configured if configured in tied else max(tied)


def distinct(candidates: Sequence[int], configured: int,
             plan_key: Callable[[int], Hashable]) -> tuple[int, ...]:
    """``candidates`` plus ``configured``, ascending, one per distinct bucket plan
    (``configured`` represents its plan, else the smallest threshold giving it)."""
    out: dict[Hashable, int] = {}
    for threshold in sorted({*candidates, configured}):
        key = plan_key(threshold)
        if key not in out or threshold == configured:
            out[key] = threshold
    return tuple(sorted(out.values()))


class Autotuner:
    """The measuring state machine of one scheduler (see the module docstring):
    ``step_ended`` returns the threshold to use from the next step on when
    that changes (a new candidate, or the final choice), else None;
    ``decision`` is set once the choice is made."""

    def __init__(self, candidates: Sequence[int], configured: int, *,
                 warmup_steps: int, steps: int) -> None:
        self.requested = tuple(candidates)
        self.configured = configured
        self.warmup_steps = warmup_steps
        self.steps = steps
        self.candidates: tuple[int, ...] | None = None
        self.times: list[list[float]] = []
        self.index = 0
        self.seen = 0
        self.last = 0.0
        self.decision: Decision | None = None

    @property
    def setting(self) -> str:
        """What the ranks must agree on (they switch plans in lockstep): compared
        by the first step's agreement with the scheduler's other settings."""
        return (f"candidates {list(self.requested)}, warm-up {self.warmup_steps}, "
                f"steps {self.steps}")

    def step_ended(self, plan_key: Callable[[int], Hashable],
                   share: Callable[[np.ndarray], np.ndarray]) -> int | None:
        now = clock()
        if self.decision is not None:
            return None
        if self.candidates is None:  # the first step ended: plans are final now
            self.candidates = distinct(self.requested, self.configured, plan_key)
            self.last = now
            if len(self.candidates) == 1:
                return self._decide((0.0,), (0.0,))  # nothing to compare (alike on every rank)
            self.times = [[] for _ in self.candidates]
            return self.candidates[0]
        self.seen += 1
        if self.seen > self.warmup_steps:
            self.times[self.index].append(now - self.last)
        self.last = now
        if self.seen < self.warmup_steps + self.steps:
            return None
        self.index += 1
        self.seen = 0
        if self.index < len(self.candidates):
            return self.candidates[self.index]
        local = tuple(statistics.median(t) for t in self.times)
        shared = tuple(float(m) for m in share(np.array(local, dtype=np.float64)))
        return self._decide(shared, local)

    def _decide(self, medians: tuple[float, ...], local: tuple[float, ...]) -> int:
        """Record the decision from rank 0's ``medians``; returns the threshold chosen."""
        assert self.candidates is not None
        chosen = choose(self.candidates, medians, self.configured)
        self.decision = Decision(self.candidates, medians, local, chosen, self.configured)
        return chosen
