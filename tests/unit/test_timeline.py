"""Timeline files, per-step stats and the interval union (no processes)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from dp_plugin.api.timeline import (
    NullTimeline,
    StatsHistory,
    StepStats,
    Timeline,
    open_timeline,
    rank_path,
    union_length,
)


def read_trace(path: Path) -> list[dict[str, Any]]:
    """Parse a trace the way viewers do: the closing ']' may be missing."""
    text = path.read_text(encoding="utf-8").rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    events = json.loads(text)
    assert isinstance(events, list)
    return events


def by_phase(events: list[dict[str, Any]], ph: str) -> list[dict[str, Any]]:
    return [e for e in events if e["ph"] == ph]


# -- file naming -----------------------------------------------------------------

def test_rank_path() -> None:
    assert rank_path("t.json", 0) == "t.rank0.json"
    assert rank_path("/x/y.d/trace.json", 12) == "/x/y.d/trace.rank12.json"
    assert rank_path("trace", 3) == "trace.rank3"
    assert rank_path("out/{rank}/t.json", 2) == "out/2/t.json"
    assert rank_path("t-{rank}.json", 1) == "t-1.json"
    # Braces other than {rank} are kept as they are.
    assert rank_path("t{x}-{rank}.json", 1) == "t{x}-1.json"


def test_each_rank_writes_its_own_file(tmp_path: Path) -> None:
    path = str(tmp_path / "sub" / "t.json")  # missing directories are created
    for rank in (0, 1):
        with Timeline(path, rank) as tl:
            assert tl.path == str(tmp_path / "sub" / f"t.rank{rank}.json")
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["t.rank0.json",
                                                                     "t.rank1.json"]


# -- content -------------------------------------------------------------------

def test_valid_json_after_close_with_spans_in_microseconds(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t.json"), 3)
    t0 = time.perf_counter()
    tl.span("bucket 0", "allreduce", t0 + 0.5, t0 + 0.75, tid="allreduce",
            args={"bytes": 1024, "bucket": 0})
    tl.span("step 0", "step", t0 + 0.25, t0 + 1.0, tid="step")
    tl.instant("plan rebuilt", "plan", t0 + 1.0, tid="step", args={"buckets": 2})
    tl.counter("bytes", {"sent": 1024.0}, t0 + 1.0)
    tl.span("raw tid", "misc", t0, t0, tid=7)
    tl.close()
    tl.close()  # idempotent
    events = json.loads((tmp_path / "t.rank3.json").read_text(encoding="utf-8"))

    assert all(e["pid"] == 3 for e in events)
    meta = by_phase(events, "M")
    assert {"name": "process_name", "ph": "M", "pid": 3, "tid": 0,
            "args": {"name": "rank 3"}} in meta
    lanes = {e["args"]["name"]: e["tid"] for e in meta if e["name"] == "thread_name"}
    assert set(lanes) == {"allreduce", "step"}
    assert len(set(lanes.values())) == 2

    spans = {e["name"]: e for e in by_phase(events, "X")}
    bucket, step = spans["bucket 0"], spans["step 0"]
    assert bucket["cat"] == "allreduce" and bucket["tid"] == lanes["allreduce"]
    assert bucket["args"] == {"bytes": 1024, "bucket": 0}
    assert bucket["dur"] == pytest.approx(250_000, abs=1)
    assert step["dur"] == pytest.approx(750_000, abs=1)
    # Relative to the timeline's creation, which came shortly before t0.
    assert bucket["ts"] - step["ts"] == pytest.approx(250_000, abs=1)
    assert 250_000 <= step["ts"] < 250_000 + 60e6
    assert spans["raw tid"]["tid"] == 7 and spans["raw tid"]["dur"] == 0
    assert "args" not in step

    (instant,) = by_phase(events, "i")
    assert instant["s"] == "t" and instant["args"] == {"buckets": 2}
    assert instant["ts"] == pytest.approx(step["ts"] + step["dur"], abs=1)
    (counter,) = by_phase(events, "C")
    assert counter["name"] == "bytes" and counter["args"] == {"sent": 1024.0}


def test_lanes_keep_their_id_and_avoid_raw_tids(tmp_path: Path) -> None:
    with Timeline(str(tmp_path / "t.json"), 0) as tl:
        t = time.perf_counter()
        tl.span("a", "c", t, t, tid=1)
        for lane in ("pack", "allreduce", "pack", "unpack"):
            tl.span(lane, "c", t, t, tid=lane)
    events = read_trace(tmp_path / "t.rank0.json")
    tids = {e["name"]: e["tid"] for e in by_phase(events, "X")}
    assert tids["a"] == 1
    assert len({tids["pack"], tids["allreduce"], tids["unpack"], 1}) == 4
    names = [e for e in events if e["name"] == "thread_name"]
    assert len(names) == 3  # one per named lane, once


def test_readable_after_flush_without_close(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t.json"), 0)
    t = time.perf_counter()
    for i in range(3):
        tl.span(f"step {i}", "step", t + i, t + i + 0.5, tid="step")
    tl.flush()  # what the scheduler does at the end of a step; then the run "crashes"
    text = (tmp_path / "t.rank0.json").read_text(encoding="utf-8")
    assert text.startswith("[")
    assert not text.rstrip().endswith("]")
    names = [e["name"] for e in by_phase(read_trace(tmp_path / "t.rank0.json"), "X")]
    assert names == ["step 0", "step 1", "step 2"]
    tl.close()
    assert len(by_phase(json.loads((tmp_path / "t.rank0.json").read_text()), "X")) == 3


def test_metadata_is_on_disk_right_after_opening(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t.json"), 1)
    events = read_trace(tmp_path / "t.rank1.json")
    assert [e["name"] for e in events] == ["process_name", "process_sort_index"]
    tl.close()


def test_recording_after_close_does_nothing(tmp_path: Path) -> None:
    tl = Timeline(str(tmp_path / "t.json"), 0)
    tl.close()
    t = time.perf_counter()
    tl.span("late", "c", t, t)
    tl.instant("late", "c", t)
    tl.counter("late", {"x": 1.0}, t)
    tl.flush()
    assert not [e for e in read_trace(tmp_path / "t.rank0.json") if e["name"] == "late"]


def test_bad_input_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ends before it starts"), \
            Timeline(str(tmp_path / "t.json"), 0) as tl:
        tl.span("backwards", "c", 2.0, 1.0)
    with pytest.raises(ValueError, match="rank must be an int >= 0, got -1"):
        Timeline(str(tmp_path / "t.json"), -1)
    with pytest.raises(ValueError, match="DP_PLUGIN_TIMELINE"):
        Timeline("", 0)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match=r"cannot write the timeline file .*DP_PLUGIN_TIMELINE"):
        Timeline(str(blocker / "t.json"), 0)


def test_null_timeline_and_open_timeline(tmp_path: Path) -> None:
    null = open_timeline(None, 0)
    assert isinstance(null, NullTimeline) and not null.enabled
    assert isinstance(open_timeline("", 0), NullTimeline)
    t = time.perf_counter()
    with null:
        null.span("s", "c", t, t + 1, tid="step", args={"a": 1})
        null.instant("i", "c", t)
        null.counter("n", {"v": 1.0}, t)
        null.flush()
    null.close()
    assert list(tmp_path.iterdir()) == []

    real = open_timeline(str(tmp_path / "t.json"), 2)
    assert isinstance(real, Timeline) and real.enabled
    real.close()
    assert (tmp_path / "t.rank2.json").exists()


# -- stats -------------------------------------------------------------------------

def test_union_length() -> None:
    assert union_length([]) == 0.0
    assert union_length([(1.0, 3.0)]) == 2.0
    assert union_length([(0.0, 1.0), (2.0, 4.0)]) == 3.0  # disjoint
    assert union_length([(0.0, 2.0), (1.0, 3.0)]) == 3.0  # overlapping
    assert union_length([(0.0, 10.0), (2.0, 3.0), (4.0, 5.0)]) == 10.0  # nested
    assert union_length([(0.0, 1.0), (1.0, 2.0)]) == 2.0  # touching
    assert union_length([(5.0, 6.0), (0.0, 1.0), (0.5, 2.0)]) == 3.0  # unsorted
    assert union_length([(1.0, 1.0), (1.0, 1.0)]) == 0.0  # empty intervals
    assert union_length(iter([(0.0, 1.0), (3.0, 3.5)])) == 1.5  # any iterable
    with pytest.raises(ValueError, match=r"\(2.0, 1.0\) ends before it starts"):
        union_length([(0.0, 1.0), (2.0, 1.0)])


def stats(step: int, **over: float) -> StepStats:
    values: dict[str, Any] = dict(buckets=2, bytes_reduced=1000, allreduce_s=0.5,
                                  exposed_s=0.1, step_s=1.0)
    values.update(over)
    return StepStats(step=step, **values)


def test_step_stats_is_frozen_and_checked() -> None:
    s = stats(0)
    with pytest.raises(AttributeError):
        s.exposed_s = 0.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        StepStats(0, 1, 2, 0.1, 0.1, 0.1)  # type: ignore[call-arg]  # keyword-only
    with pytest.raises(ValueError, match=r"exposed_s must be >= 0, got -0\.1"):
        stats(0, exposed_s=-0.1)
    with pytest.raises(ValueError, match="allreduce_s"):
        stats(0, allreduce_s=math.nan)


def test_stats_history() -> None:
    history = StatsHistory(maxlen=3)
    assert history.last is None and len(history) == 0
    assert math.isnan(history.mean("step_s"))
    history.append(stats(0, step_s=10.0))  # warm-up step
    assert math.isnan(history.mean("step_s"))  # only the skipped first step
    assert history.mean("step_s", skip_first=0) == 10.0
    history.append(stats(1, step_s=1.0))
    history.append(stats(2, step_s=3.0))
    assert history.mean("step_s") == 2.0
    assert history.last == stats(2, step_s=3.0)
    # Once the warm-up step has been dropped, no kept step is skipped.
    history.append(stats(3, step_s=5.0))
    assert [s.step for s in history] == [1, 2, 3]
    assert history.mean("step_s") == 3.0
    assert history.mean("step_s", skip_first=2) == 4.0
    summary = history.summary()
    assert summary["step_s"] == 3.0 and summary["bytes_reduced"] == 1000.0
    assert set(summary) == {"buckets", "bytes_reduced", "allreduce_s", "exposed_s", "step_s"}
    with pytest.raises(ValueError, match=r"'latency'.*valid fields: buckets, bytes_reduced"):
        history.mean("latency")
    with pytest.raises(ValueError, match="maxlen"):
        StatsHistory(maxlen=0)


# -- one writer per file, bounded size, crash safety, no symlinks ------------------

def test_handles_on_one_file_share_one_writer(tmp_path: Path) -> None:
    """Two timelines on one path (two schedulers, or a scheduler and the torch
    adapter's timeline) used to truncate and overwrite each other's bytes."""
    first = open_timeline(str(tmp_path / "t.json"), 0)
    second = Timeline(str(tmp_path / "t.json"), 0)
    t = time.perf_counter()
    for i in range(50):
        first.span(f"a{i}", "c", t, t + 1e-3, tid="step")
        second.span(f"b{i}", "c", t, t + 1e-3, tid="allreduce")
        first.flush()
    first.close()
    first.close()  # again: must not release the other handle's reference
    second.instant("after", "c", t)
    second.close()
    events = json.loads((tmp_path / "t.rank0.json").read_text(encoding="utf-8"))  # strict
    names = [e["name"] for e in events if e["ph"] in ("X", "i")]
    assert names[:-1] == [n for i in range(50) for n in (f"a{i}", f"b{i}")]
    assert names[-1] == "after"
    assert len(by_phase(events, "M")) == 2 + 3 * 2  # process name/sort; step, allreduce, main
    with pytest.raises(ValueError, match="already written by this process for rank 11"), \
            open_timeline(str(tmp_path / "x{rank}.json"), 11):  # x11.json
        Timeline(str(tmp_path / "x1{rank}.json"), 1)  # x11.json too


def test_size_is_bounded_with_one_note(tmp_path: Path) -> None:
    path = tmp_path / "t.rank0.json"
    t = time.perf_counter()
    with Timeline(str(tmp_path / "t.json"), 0, max_bytes=4000) as tl:
        with pytest.warns(RuntimeWarning, match="DP_PLUGIN_TIMELINE_MAX_BYTES=4000") as caught:
            for i in range(500):
                tl.span(f"s{i}", "c", t, t + 1e-3, args={"i": i})
        assert len(caught) == 1  # once, not per dropped event
        assert tl.dropped > 400
    events = json.loads(path.read_text(encoding="utf-8"))
    notes = [e for e in events if e["name"] == "timeline truncated"]
    assert len(notes) == 1 and "dropped" in notes[0]["args"]["message"]
    assert events[-1] is notes[0] or events[-1] == notes[0]
    assert path.stat().st_size <= 4000 + 500  # the note's own line
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0, got -1"):
        Timeline(str(tmp_path / "u.json"), 0, max_bytes=-1)


_CRASHING_WRITER = """
import os, sys, time
from dp_plugin.api.timeline import Timeline
optimizer, batchnorm = Timeline(sys.argv[1], 0), Timeline(sys.argv[1], 0)
t = time.perf_counter()
for i in range(int(sys.argv[2])):
    rec = optimizer if i % 2 else batchnorm
    rec.span(f"step{i}", "cat", t, t + 1e-3, args={"pad": "x" * 97})
    if i % 1000 == 999:
        optimizer.flush()
os._exit(3)  # a crash: no close(), no atexit, no buffer flush
"""


def test_trace_is_valid_after_a_crash(tmp_path: Path) -> None:
    """Two recorders on one file (an optimizer and SyncBatchNorm), killed
    mid-run (no close, events recorded since the last flush): the file holds
    only whole events, in order, and parses with Chrome's rule for an
    unterminated array (strip a trailing comma, add ']'). Two writers used to
    overwrite each other's bytes."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _CRASHING_WRITER, str(tmp_path / "t.json"), "20500"],
        timeout=120, capture_output=True, text=True,
    )
    assert proc.returncode == 3, proc.stderr
    text = (tmp_path / "t.rank0.json").read_text(encoding="utf-8")
    assert not text.rstrip().endswith("]")  # really unterminated
    spans = [e["name"] for e in read_trace(tmp_path / "t.rank0.json") if e["ph"] == "X"]
    assert spans == [f"step{i}" for i in range(len(spans))]  # a prefix, nothing torn
    assert len(spans) >= 20000


def test_a_symlink_at_the_path_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me", encoding="utf-8")
    (tmp_path / "t.rank0.json").symlink_to(victim)
    with pytest.raises(OSError, match=r"refusing to write the timeline file .*t\.rank0\.json.*"
                                      r"symbolic link"):
        Timeline(str(tmp_path / "t.json"), 0)
    assert victim.read_text(encoding="utf-8") == "keep me"
    (tmp_path / "dangling.rank0.json").symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(OSError, match="symbolic link"):
        open_timeline(str(tmp_path / "dangling.json"), 0)
    assert not (tmp_path / "nowhere.json").exists()
