"""``dp-plugin plan``'s suggested defaults follow the link (issue 25): on a
slow link shared by several ranks per host it picks the hierarchical
all-reduce and suggests fp16, saying why; on a fast one it changes neither."""

from __future__ import annotations

import json

import pytest

from dp_plugin.cli import main
from dp_plugin.cli.alphabeta import (
    Link,
    allreduce_time,
    hierarchical_allreduce_time,
    ring_allreduce_time,
)


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", "--model", "bert-base", "--compute-ms", "900", "--alpha-us", "50",
                 "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)["suggested"]  # type: ignore[no-any-return]


def test_a_slow_shared_link_gets_hierarchy_and_fp16(capsys: pytest.CaptureFixture[str]) -> None:
    got = plan(capsys, "--bandwidth-gbit", "1", "--ranks-per-host", "2", "--workers", "4")
    assert got["hierarchical"] is True and got["compression"] == "fp16"
    assert any("hierarchical all-reduce" in w for w in got["why"])
    assert any(w.startswith("compression fp16") and "nobody hides" in w for w in got["why"])


def test_a_fast_link_keeps_flat_and_uncompressed(capsys: pytest.CaptureFixture[str]) -> None:
    got = plan(capsys, "--bandwidth-gbit", "400", "--ranks-per-host", "2", "--workers", "8")
    assert got["compression"] == "none"
    assert any(w.startswith("no compression") for w in got["why"])


def test_hierarchy_moves_fewer_bytes_over_the_host_link() -> None:
    link, local = Link(alpha=0.0, beta=1e8), Link(alpha=0.0, beta=1e12)
    flat = ring_allreduce_time(1e9, 4, link)  # 1.5 S over the link
    hier = allreduce_time(1e9, 4, link, per_host=2, local=local)  # 1.0 S, plus ~0 inside
    assert flat == pytest.approx(15.0) and hier == pytest.approx(10.0, rel=1e-3)


def test_the_pipelined_hierarchy_overlaps_its_shared_memory_steps_with_the_link() -> None:
    """The engine pipelines the hierarchical all-reduce in pieces: the host's
    shared-memory steps hide behind the link but for one piece (fill and
    drain); unpipelined they add up."""
    link, local = Link(alpha=0.0, beta=1e8), Link(alpha=0.0, beta=4e8)
    inside = ring_allreduce_time(4e8, 2, local)  # 1 s of shared memory
    cross = 4.0  # 1.0 S over the link
    piped = hierarchical_allreduce_time(4e8, 2, 2, link, local, piece=4e6)  # 100 pieces
    assert piped == pytest.approx(cross + inside / 100)
    assert hierarchical_allreduce_time(4e8, 2, 2, link, local, piece=None) == \
        pytest.approx(cross + inside)
    fast = Link(alpha=0.0, beta=1e10)  # the shared memory is the slower stage now
    assert hierarchical_allreduce_time(4e8, 2, 2, fast, local, piece=4e6) == \
        pytest.approx(inside + 0.04 / 100)


def test_ranks_per_host_must_divide_the_workers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="--ranks-per-host 3: must be >= 1 and divide"):
        main(["plan", "--model", "bert-base", "--compute-ms", "900", "--alpha-us", "50",
              "--bandwidth-gbit", "1", "--ranks-per-host", "3", "--workers", "4"])
