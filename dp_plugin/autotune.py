"""Autotune of the fusion threshold, and of the engine under ``auto``
(``DP_PLUGIN_AUTOTUNE=1``).

During the first steps the gradient scheduler tries each candidate bucket
size in turn: after the first step (and its bucket rebuild) it switches to
the first candidate, drops ``warmup_steps`` steps (new buffers, first
touches), then times ``steps`` steps as the wall time between the ends of
successive ``synchronize()`` calls, i.e. one whole training step. After the
last candidate the medians are compared and the fastest threshold is kept.
Under ``DP_PLUGIN_ENGINE=auto`` the runtime also started the other engines
that can run here (``runtime.alternates``: gloo beside Horovod's ring under
horovodrun, beside MPI under mpirun); each is then timed the same way with
the chosen threshold, the gradients' fusion buffers moving to it in place,
and the fastest engine (ties: the one ``auto`` picked) carries the
gradients for the rest of the run. Other collectives stay on the engine
``auto`` picked.

Distributed contract: every rank builds its ``Autotuner`` with the same
candidates, engines and step counts (they come from the ``Config``, which
the first step's agreement compares, and from the engine lists the ranks
compared at ``init``) and calls ``step_ended`` once per step, at the end of
``synchronize()``, so every rank switches at the same step, outside any
backward pass. The decision is never taken by a rank alone: rank 0's
medians are broadcast (``share``, one small collective per phase) and every
rank picks from those same numbers with the same rule (``choose``), so the
bucket plans and engines stay identical. Candidates that give the same
bucket plan (e.g. every threshold larger than the model) are measured once.

No framework and no engine: the scheduler passes its ``FusedCollective``
(re-planned through ``retune``, moved through ``use_engine``), its timeline,
the engines by name and ``share`` (rank 0's values on every rank).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from dp_plugin.fusion import plan_buckets

log = logging.getLogger("dp_plugin")

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
    engines: tuple[str, ...] = ("",)
    """The engines timed at ``chosen`` (the one ``auto`` picked first); one
    name when only the bucket size was tuned."""
    engine_medians: tuple[float, ...] = ()
    """Rank 0's median step time per engine (empty when only one)."""
    engine: str = ""
    """The engine chosen (``engines[0]`` when only one)."""
    engine_local_medians: tuple[float, ...] = ()

    def describe(self) -> str:
        timings = ", ".join(f"{mib(t)}: {m * 1e3:.2f} ms"
                            for t, m in zip(self.candidates, self.medians, strict=True))
        text = (f"autotune chose fusion threshold {mib(self.chosen)} ({self.chosen} bytes; "
                f"configured {mib(self.configured)}); median step time per threshold on "
                f"rank 0: {timings}")
        if self.engine_medians:
            per_engine = ", ".join(f"{e}: {m * 1e3:.2f} ms"
                                   for e, m in zip(self.engines, self.engine_medians, strict=True))
            text += (f"; engine {self.engine} (auto picked {self.engines[0]}); median step "
                     f"time per engine at {mib(self.chosen)} on rank 0: {per_engine}")
        return text

    def as_args(self) -> dict[str, object]:
        """The measurements as timeline event arguments."""
        args: dict[str, object] = {
            "chosen": self.chosen, "configured": self.configured,
            "candidates": list(self.candidates), "rank0_median_s": list(self.medians),
            "local_median_s": list(self.local_medians)}
        if self.engine_medians:
            args.update(engine=self.engine, engines=list(self.engines),
                        engine_rank0_median_s=list(self.engine_medians),
                        engine_local_median_s=list(self.engine_local_medians))
        return args


def mib(nbytes: float, spec: str = "g") -> str:
    """``nbytes`` for a person: "25 MiB", "4 KiB", "40 B"; ``spec`` formats the
    number of GiB, MiB or KiB (``".4g"``: at most 4 significant digits)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):{spec}} {unit}"
    return f"{nbytes:g} B"


def agreement_setting(config: Any, enabled: bool) -> str:
    """What the ranks must agree on (they switch plans in lockstep): compared
    by the first step's agreement with the scheduler's other settings."""
    if not enabled:
        return "off"
    return (f"candidates {list(config.autotune_candidates)}, warm-up "
            f"{config.autotune_warmup_steps}, steps {config.autotune_steps}")


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


class Setting(NamedTuple):
    """What one step runs with: a bucket size and the engine's name."""

    threshold: int
    engine: str


class Autotuner:
    """The measuring state machine of one scheduler (see the module docstring).

    ``engines`` names the engines to time, the one in use first (more than
    one only under ``auto``: ``runtime.alternates``). ``step_ended(plan_key,
    share)`` is called at the end of every step; it returns the ``Setting``
    to use from the next step on when that changes (a new candidate, or the
    final choice), else None. ``decision`` is set once the choice is made.
    """

    def __init__(self, candidates: Sequence[int], configured: int, *,
                 warmup_steps: int, steps: int, engines: Sequence[str] = ("",)) -> None:
        self.requested = tuple(candidates)
        self.configured = configured
        self.warmup_steps = warmup_steps
        self.steps = steps
        self.engines = tuple(engines) or ("",)
        self.candidates: tuple[int, ...] | None = None
        self.trials: list[Setting] = []
        """The settings of the phase being measured (thresholds, then engines)."""
        self.times: list[list[float]] = []
        self.index = 0
        self.seen = 0
        self.last = 0.0
        self.thresholds: tuple[tuple[float, ...], tuple[float, ...], int] | None = None
        """Rank 0's and this rank's medians per threshold, and the chosen one."""
        self.decision: Decision | None = None

    @classmethod
    def of(cls, config: Any, configured: int, engines: Sequence[str] = ("",)) -> Autotuner:
        """The tuner ``config`` (a ``dp_plugin.Config``) asks for."""
        return cls(config.autotune_candidates, configured, engines=engines,
                   warmup_steps=config.autotune_warmup_steps, steps=config.autotune_steps)

    @property
    def done(self) -> bool:
        return self.decision is not None

    def step_ended(self, plan_key: Callable[[int], Hashable],
                   share: Callable[[np.ndarray], np.ndarray]) -> Setting | None:
        now = clock()
        if self.decision is not None:
            return None
        if self.candidates is None:  # the first step ended: plans are final now
            self.candidates = distinct(self.requested, self.configured, plan_key)
            self.last = now
            if len(self.candidates) == 1 and len(self.engines) == 1:
                return self._decide((0.0,), (0.0,))  # nothing to compare (alike on every rank)
            return self._measure([Setting(t, self.engines[0]) for t in self.candidates])
        self.seen += 1
        if self.seen > self.warmup_steps:
            self.times[self.index].append(now - self.last)
        self.last = now
        if self.seen < self.warmup_steps + self.steps:
            return None
        self.index += 1
        self.seen = 0
        if self.index < len(self.trials):
            return self.trials[self.index]
        local = tuple(statistics.median(t) for t in self.times)
        shared = tuple(float(m) for m in share(np.array(local, dtype=np.float64)))
        return self._decide(shared, local)

    def _measure(self, trials: list[Setting]) -> Setting:
        self.trials, self.times, self.index, self.seen = trials, [[] for _ in trials], 0, 0
        return trials[0]

    def after_step(self, fused: Any, order: Sequence[int], timeline: Any,
                   share: Callable[[np.ndarray], np.ndarray], *, log_here: bool,
                   engines: Mapping[str, Any] | None = None) -> int:
        """One step of tuning for a scheduler: re-plans ``fused`` (a
        ``FusedCollective``, buckets in ``order``) when the threshold
        changes and moves it to another of ``engines`` (by name) when the
        engine does, records it in ``timeline``, logs the decision if
        ``log_here``. Returns the threshold in use from now on."""

        def plan_key(threshold: int) -> Hashable:
            plan = plan_buckets(fused.specs, threshold, order=order,
                                first_threshold=fused.first_threshold)
            return tuple(b.members for b in plan)

        setting = self.step_ended(plan_key, share)
        if setting is None:
            return int(fused.threshold)
        fused.retune(setting.threshold, order)
        if engines and engines[setting.engine] is not fused.engine:
            fused.use_engine(engines[setting.engine])
        now = time.perf_counter()
        if self.decision is None:
            timeline.instant(f"autotune: try {mib(setting.threshold)}"
                             + (f" on {setting.engine}" if len(self.engines) > 1 else ""),
                             "autotune", now, tid="step", args=setting._asdict())
            return setting.threshold
        timeline.instant("autotune: decision", "autotune", now, tid="step",
                         args=self.decision.as_args())
        if log_here:
            log.info("dp_plugin: %s [%s]", self.decision.describe(), fused.name)
        return setting.threshold

    def _decide(self, medians: tuple[float, ...], local: tuple[float, ...]) -> Setting:
        """The end of a phase: choose the threshold (then time the other
        engines with it), or the engine; returns the setting to use next."""
        assert self.candidates is not None
        if self.thresholds is None:  # the thresholds phase ended
            chosen = choose(self.candidates, medians, self.configured)
            self.thresholds = (medians, local, chosen)
            if len(self.engines) > 1:
                return self._measure([Setting(chosen, e) for e in self.engines[1:]])
            return self._conclude((), ())
        thresholds, thresholds_local, chosen = self.thresholds
        at = self.candidates.index(chosen)  # the engine in use was timed there already
        return self._conclude((thresholds[at], *medians), (thresholds_local[at], *local))

    def _conclude(self, engine_medians: tuple[float, ...],
                  engine_local: tuple[float, ...]) -> Setting:
        """Record the decision; ``engine_medians`` per engine (empty: one engine)."""
        assert self.candidates is not None and self.thresholds is not None
        thresholds, thresholds_local, chosen = self.thresholds
        best = engine_medians.index(min(engine_medians)) if engine_medians else 0  # ties: first
        engine = self.engines[best]
        self.decision = Decision(self.candidates, thresholds, thresholds_local, chosen,
                                 self.configured, self.engines, engine_medians, engine,
                                 engine_local)
        return Setting(chosen, engine)
