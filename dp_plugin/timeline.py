"""Chrome-trace timeline of each rank, and per-step communication stats.

``DP_PLUGIN_TIMELINE=path`` (or ``HOROVOD_TIMELINE``) makes every rank write
its own file: ``path`` with ``{rank}`` replaced, else with ``.rankN`` inserted
before the extension (``t.json`` -> ``t.rank0.json``). Each file is a Chrome
trace in the "JSON Array Format": ``[`` then one event per line. The closing
``]`` is written by ``close()``; the format makes it optional, so the file of
a run that crashed still opens in Perfetto (ui.perfetto.dev) and
chrome://tracing. Load several ranks' files together to compare them: the
process id of every event is the rank.

Events are streamed through a buffered file and flushed at the end of each
step (``flush()``), so a long run costs no memory and no rewrites.

Recording is local to a rank: nothing here communicates, and ranks may
record different events.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import IO, Any

from dp_plugin.validate import check_choice, check_int

Lane = str | int
"""A track in the trace: a name ('step', 'pack', 'allreduce', 'unpack') or a raw tid."""

_FILE_BUFFER = 1 << 20  # bytes; flush() at each step boundary empties it


def rank_path(path: str, rank: int) -> str:
    """The file of ``rank``: ``{rank}`` replaced, else ``.rankN`` before the extension."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


class Timeline:
    """Writes one rank's Chrome trace.

    Times are ``time.perf_counter()`` seconds; they are stored as
    microseconds since this timeline was created. Thread-safe: engine
    completion callbacks may record from other threads. After ``close()``
    recording does nothing, so a late callback cannot break a shutdown.
    """

    enabled = True

    def __init__(self, path: str, rank: int) -> None:
        check_int("timeline rank", rank, minimum=0)
        if not path:
            raise ValueError(
                "timeline path is empty; set DP_PLUGIN_TIMELINE to a file path such as "
                "'timeline.json', or leave it unset for no timeline"
            )
        self.rank = rank
        self.path = rank_path(path, rank)
        self._origin = time.perf_counter()
        self._lock = threading.Lock()
        self._lanes: dict[str, int] = {}
        self._used_tids: set[int] = set()
        self._first = True
        self._closed = False
        try:
            parent = os.path.dirname(self.path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            self._file: IO[str] = open(  # noqa: SIM115 - held open until close()
                self.path, "w", encoding="utf-8", buffering=_FILE_BUFFER
            )
        except OSError as exc:
            raise OSError(
                f"cannot write the timeline file {self.path!r} ({exc.strerror or exc}); set "
                "DP_PLUGIN_TIMELINE (or HOROVOD_TIMELINE) to a writable path, or unset it"
            ) from exc
        self._file.write("[\n")
        self._metadata("process_name", 0, {"name": f"rank {rank}"})
        self._metadata("process_sort_index", 0, {"sort_index": rank})
        self._file.flush()

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
        event: dict[str, Any] = {
            "name": name, "cat": cat, "ph": "X", "ts": self._us(start),
            "dur": round((end - start) * 1e6, 3), "pid": self.rank,
        }
        self._emit(event, tid, args)

    def instant(
        self, name: str, cat: str, t: float, tid: Lane = "main",
        args: Mapping[str, Any] | None = None,
    ) -> None:
        """A point in time (ph 'i', thread scope) at ``t`` (perf_counter seconds)."""
        event: dict[str, Any] = {
            "name": name, "cat": cat, "ph": "i", "s": "t", "ts": self._us(t), "pid": self.rank,
        }
        self._emit(event, tid, args)

    def counter(self, name: str, values: Mapping[str, float], t: float) -> None:
        """A counter sample (ph 'C'): one series per key of ``values``, at ``t``."""
        event: dict[str, Any] = {
            "name": name, "ph": "C", "ts": self._us(t), "pid": self.rank, "tid": 0,
            "args": dict(values),
        }
        with self._lock:
            self._write(event)

    def flush(self) -> None:
        """Push buffered events to the file (the scheduler calls it after each step)."""
        with self._lock:
            if not self._closed:
                self._file.flush()

    def close(self) -> None:
        """Write the closing ``]`` and close the file. Safe to call again."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._file.write("\n]\n")
            finally:
                self._file.close()

    def __enter__(self) -> Timeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------

    def _us(self, t: float) -> float:
        return round((t - self._origin) * 1e6, 3)

    def _emit(self, event: dict[str, Any], tid: Lane, args: Mapping[str, Any] | None) -> None:
        if args:
            event["args"] = dict(args)
        with self._lock:
            if self._closed:
                return
            event["tid"] = self._tid(tid)
            self._write(event)

    def _tid(self, lane: Lane) -> int:
        """Named lanes get small ids in first-use order, and a name in the viewer."""
        if isinstance(lane, int) and not isinstance(lane, bool):
            self._used_tids.add(lane)
            return lane
        name = str(lane)
        tid = self._lanes.get(name)
        if tid is None:
            tid = len(self._lanes) + 1
            while tid in self._used_tids:
                tid += 1
            self._lanes[name] = tid
            self._used_tids.add(tid)
            self._metadata("thread_name", tid, {"name": name})
            self._metadata("thread_sort_index", tid, {"sort_index": tid})
        return tid

    def _metadata(self, kind: str, tid: int, args: dict[str, Any]) -> None:
        self._write({"name": kind, "ph": "M", "pid": self.rank, "tid": tid, "args": args})

    def _write(self, event: dict[str, Any]) -> None:
        # The separator goes before each event, never after the last one, so
        # a file cut short is valid JSON once ']' is appended.
        if self._closed:
            return
        if not self._first:
            self._file.write(",\n")
        self._first = False
        self._file.write(json.dumps(event, separators=(",", ":")))


class NullTimeline:
    """The timeline used when none is configured: every method does nothing."""

    enabled = False
    path: str | None = None

    def span(
        self, name: str, cat: str, start: float, end: float, tid: Lane = "main",
        args: Mapping[str, Any] | None = None,
    ) -> None:
        pass

    def instant(
        self, name: str, cat: str, t: float, tid: Lane = "main",
        args: Mapping[str, Any] | None = None,
    ) -> None:
        pass

    def counter(self, name: str, values: Mapping[str, float], t: float) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NullTimeline:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def open_timeline(path: str | None, rank: int) -> Timeline | NullTimeline:
    """A ``Timeline`` writing ``path`` for ``rank``, or a ``NullTimeline`` if no path."""
    return Timeline(path, rank) if path else NullTimeline()


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
    ordered = sorted(intervals)
    total = 0.0
    cur_start = cur_end = -math.inf
    for start, end in ordered:
        if end < start:
            raise ValueError(f"interval ({start}, {end}) ends before it starts")
        if start > cur_end:
            if cur_end > cur_start:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    if cur_end > cur_start:
        total += cur_end - cur_start
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
        if not kept:
            return math.nan
        return sum(float(getattr(s, field)) for s in kept) / len(kept)

    def summary(self, skip_first: int = 1) -> dict[str, float]:
        """``mean`` of every numeric field."""
        return {name: self.mean(name, skip_first) for name in _NUMERIC_FIELDS}
