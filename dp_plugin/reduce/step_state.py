"""The state of one step of a ``Reducer``, replaced when the step ends.

A fresh ``StepState`` per step means nothing has to be reset by hand: which
tensors were marked (and how often), which buckets are ready, launched and
known finished, and the timings that become the step's ``StepStats``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dp_plugin.api.timeline import StepStats, union_length


@dataclass(eq=False)
class StepState:
    """Everything one step of the scheduler knows; a fresh one per step."""

    step: int
    n_specs: int
    n_buckets: int
    passes: list[int] = field(init=False)
    tensors: list[Any] = field(init=False)
    ready_count: list[int] = field(init=False)
    ready_order: list[int] = field(default_factory=list)
    next_launch: int = 0
    polled: int = 0
    """Buckets below this index are known to have finished (see ``Reducer._poll``)."""
    started_at: float | None = None
    syncing: bool = False
    sync_start: float = 0.0
    late_launch_s: float = 0.0
    """Time spent launching buckets inside ``synchronize()`` (not overlapped)."""
    bytes: int = 0
    launched: int = 0
    intervals: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.passes = [0] * self.n_specs
        self.tensors = [None] * self.n_specs
        self.ready_count = [0] * self.n_buckets

    def record(self, timeline: Any, end: float, exposed: float) -> StepStats:
        """The step's statistics, ended at ``end`` with ``exposed`` seconds of
        communication not overlapped; also written to ``timeline`` as a span."""
        step_start = self.sync_start if self.started_at is None else self.started_at
        stats = StepStats(
            step=self.step, buckets=self.launched, bytes_reduced=self.bytes,
            allreduce_s=union_length(self.intervals), exposed_s=exposed,
            step_s=end - step_start,
        )
        timeline.span(
            f"step {self.step}", "step", step_start, end, tid="step",
            args={"buckets": stats.buckets, "bytes": stats.bytes_reduced,
                  "exposed_s": exposed, "synchronize_s": end - self.sync_start},
        )
        timeline.flush()
        return stats
