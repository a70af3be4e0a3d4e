"""Chrome-trace timeline of each rank, and per-step communication stats.

``DP_PLUGIN_TIMELINE=path`` (or ``HOROVOD_TIMELINE``) makes every rank write
its own file: ``path`` with ``{rank}`` replaced, else with ``.rankN`` inserted
before the extension (``t.json`` -> ``t.rank0.json``): a Chrome trace that
opens in Perfetto (ui.perfetto.dev) and chrome://tracing, even after a crash.
Load several ranks' files together to compare them: the process id of every
event is the rank.

Events are flushed at the end of each step (``flush()``); how the file is
written (one writer per file, whole lines, the closing ``]``, a size bound,
no symbolic links) is ``dp_plugin.api.trace_writer``'s.

Recording is local to a rank: nothing here communicates, and ranks may
record different events.
"""

from __future__ import annotations

import atexit
import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from dp_plugin.api import trace_writer
from dp_plugin.config import DEFAULT_TIMELINE_MAX_BYTES
from dp_plugin.validate import check_choice, check_int

Lane = str | int
"""A track in the trace: a name ('step', 'pack', 'allreduce', 'unpack') or a raw tid."""


def rank_path(path: str, rank: int) -> str:
    """The file of ``rank``: ``{rank}`` replaced, else ``.rankN`` before the extension."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


class Timeline:
    """A handle on one rank's Chrome trace; the handles on one file share
    its writer (``dp_plugin.api.trace_writer``, which says how and when the
    file closes). ``max_bytes`` bounds the events written (0: no limit; the
    first handle's value holds). Times are ``time.perf_counter()`` seconds,
    stored as microseconds since the file was opened. Thread-safe: engine
    completion callbacks may record from other threads. After ``close()``
    this handle records nothing, so a late callback cannot break a shutdown.
    """

    enabled = True

    def __init__(self, path: str, rank: int, max_bytes: int = DEFAULT_TIMELINE_MAX_BYTES) -> None:
        check_int("timeline rank", rank, minimum=0)
        check_int("timeline max_bytes", max_bytes, minimum=0,
                  fix="set DP_PLUGIN_TIMELINE_MAX_BYTES to a number of bytes, 0 for no limit")
        if not path:
            raise ValueError(
                "timeline path is empty; set DP_PLUGIN_TIMELINE to a file path such as "
                "'timeline.json', or leave it unset for no timeline"
            )
        self.rank = rank
        self.path = rank_path(path, rank)
        self._writer = trace_writer.acquire(self.path, rank, max_bytes)
        self._closed = False

    @property
    def dropped(self) -> int:
        """Events of this file not written because it reached its size limit."""
        return self._writer.dropped

    # -- recording -------------------------------------------------------

    def span(
        self, name: str, cat: str, start: float, end: float, tid: Lane = "main",
        args: Mapping[str, Any] | None = None,
    ) -> None:
        """A complete event (ph 'X') from ``start`` to ``end`` (perf_counter seconds)."""
        if end < start:
            raise ValueError(
                f"timeline span {name!r} ends before it starts (start={start}, end={end}); "
                "pass perf_counter() readings taken in order"
            )
        self._emit({"name": name, "cat": cat, "ph": "X", "ts": start,
                    "dur": round((end - start) * 1e6, 3)}, tid, args)

    def instant(
        self, name: str, cat: str, t: float, tid: Lane = "main",
        args: Mapping[str, Any] | None = None,
    ) -> None:
        """A point in time (ph 'i', thread scope) at ``t`` (perf_counter seconds)."""
        self._emit({"name": name, "cat": cat, "ph": "i", "s": "t", "ts": t}, tid, args)

    def counter(self, name: str, values: Mapping[str, float], t: float) -> None:
        """A counter sample (ph 'C'): one series per key of ``values``, at ``t``."""
        self._emit({"name": name, "ph": "C", "ts": t, "tid": 0, "args": dict(values)}, None, None)

    def flush(self) -> None:
        """Push buffered events to the file (the scheduler calls it after each step)."""
        writer = self._writer
        with writer.lock:
            if not self._closed:
                writer.flush()

    def close(self) -> None:
        """Release this handle; the last one writes the closing ``]``. Safe to call again."""
        with self._writer.lock:
            if self._closed:
                return
            self._closed = True
        trace_writer.release(self._writer)

    def __enter__(self) -> Timeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------

    def _emit(self, event: dict[str, Any], tid: Lane | None,
              args: Mapping[str, Any] | None) -> None:
        event["pid"] = self.rank
        if args:
            event["args"] = dict(args)
        writer = self._writer
        with writer.lock:
            if self._closed:
                return
            event["ts"] = writer.us(event["ts"])
            if tid is not None:
                event["tid"] = writer.tid(tid)
            writer.write(event)


class NullTimeline:
    """The timeline used when none is configured: every method does nothing."""

    enabled = False
    path: str | None = None

    def _nothing(self, _a: Any = None, _b: Any = None, _c: Any = None, _d: Any = None,
                 tid: Lane | None = None, args: Any = None) -> None:
        """Any call of ``Timeline``'s methods, ignored (fixed parameters, not
        ``*args``: a call costs what a call of an empty ``span`` would)."""

    span = instant = counter = flush = close = __exit__ = _nothing

    def __enter__(self) -> NullTimeline:
        return self


def open_timeline(
    path: str | None, rank: int, max_bytes: int = DEFAULT_TIMELINE_MAX_BYTES,
) -> Timeline | NullTimeline:
    """A ``Timeline`` writing ``path`` for ``rank``, or a ``NullTimeline`` if no path."""
    return Timeline(path, rank, max_bytes) if path else NullTimeline()


class SharedTimeline:
    """The process's current timeline, shared by every reducer of the adapters.

    Reducers hold ``shared_timeline`` (below), which forwards to whatever
    timeline is current, so Horovod's ``start_timeline``/``stop_timeline``
    (``dp_plugin.api.horovod_api``) take effect for optimizers created before
    them. ``close()`` does nothing: the file belongs to ``start_timeline`` /
    ``stop_timeline`` (or to ``shutdown()``), not to any one reducer.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: Timeline | NullTimeline = NullTimeline()
        self.mark_cycles = False

    def open_from_config(self, path: str | None, rank: int, max_bytes: int) -> None:
        """Record from ``init()`` on into ``path`` (``Config.timeline``), as Horovod
        does with ``HOROVOD_TIMELINE``; ``DYNAMIC`` means "only via start_timeline()"."""
        with self._lock:
            if not path or path.upper() == "DYNAMIC" or self.current.enabled:
                return
        self.start(path, rank, False, max_bytes)

    def start(self, path: str, rank: int, mark_cycles: bool, max_bytes: int) -> None:
        # A file already open (e.g. by a core scheduler) is shared, not truncated.
        new = open_timeline(path, rank, max_bytes)
        with self._lock:
            old, self.current = self.current, new
            self.mark_cycles = bool(mark_cycles)
        old.close()

    def stop(self) -> None:
        with self._lock:
            old, self.current = self.current, NullTimeline()
            self.mark_cycles = False
        old.close()

    # -- what a reducer calls -----------------------------------------------------

    def span(self, name: str, cat: str, start: float, end: float, tid: Any = "main",
             args: Mapping[str, Any] | None = None) -> None:
        self.current.span(name, cat, start, end, tid=tid, args=args)

    def instant(self, name: str, cat: str, t: float, tid: Any = "main",
                args: Mapping[str, Any] | None = None) -> None:
        self.current.instant(name, cat, t, tid=tid, args=args)

    def counter(self, name: str, values: Mapping[str, float], t: float) -> None:
        self.current.counter(name, values, t)

    def flush(self) -> None:
        # Reducers flush once per step: that is where a cycle ends.
        current = self.current
        if self.mark_cycles:
            current.instant("CYCLE_START", "cycle", time.perf_counter(), tid="step")
        current.flush()

    def close(self) -> None:
        pass


shared_timeline = SharedTimeline()
atexit.register(shared_timeline.stop)


# -- per-step stats ----------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class StepStats:
    """What one training step's gradient communication cost on this rank."""

    step: int
    """Step index, counted from 0 by the scheduler."""
    buckets: int
    """Fusion buckets all-reduced in this step."""
    bytes_reduced: int
    """Payload bytes handed to the engine (after compression)."""
    allreduce_s: float
    """Wall time with at least one all-reduce in flight: the union of the
    buckets' [launch, completion] intervals."""
    exposed_s: float
    """Time blocked in ``synchronize()`` waiting for communication, i.e. not
    hidden behind backward."""
    step_s: float
    """From the first ready gradient to the end of ``synchronize()``."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value >= 0:
                raise ValueError(f"StepStats.{f.name} must be >= 0, got {value!r}")


_NUMERIC_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StepStats) if f.name != "step")


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals, overlaps counted once."""
    total = 0.0
    covered_to = -math.inf
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"interval ({start}, {end}) ends before it starts")
        if end > covered_to:  # what lies past the intervals before it is new
            total += end - max(start, covered_to)
            covered_to = end
    return total


class StatsHistory:
    """The last ``maxlen`` steps' ``StepStats`` with simple summaries."""

    def __init__(self, maxlen: int = 1000) -> None:
        check_int("StatsHistory maxlen", maxlen, minimum=1)
        self._steps: deque[StepStats] = deque(maxlen=maxlen)
        self._dropped = 0

    def append(self, stats: StepStats) -> None:
        if len(self._steps) == self._steps.maxlen:
            self._dropped += 1
        self._steps.append(stats)

    @property
    def last(self) -> StepStats | None:
        """The most recent step, or None before the first."""
        return self._steps[-1] if self._steps else None

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[StepStats]:
        return iter(self._steps)

    def mean(self, field: str, skip_first: int = 1) -> float:
        """Mean of ``field`` over the kept steps, leaving out the first
        ``skip_first`` steps ever recorded (warm-up: buffers, plan rebuild).
        NaN when no step is left."""
        check_choice("StepStats numeric field", field, _NUMERIC_FIELDS, kind="fields")
        check_int("skip_first", skip_first, minimum=0)
        kept = list(self._steps)[max(0, skip_first - self._dropped):]
        return sum(float(getattr(s, field)) for s in kept) / len(kept) if kept else math.nan

    def summary(self, skip_first: int = 1) -> dict[str, float]:
        """``mean`` of every numeric field."""
        return {name: self.mean(name, skip_first) for name in _NUMERIC_FIELDS}
