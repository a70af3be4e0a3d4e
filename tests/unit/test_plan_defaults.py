"""``dp-plugin plan``'s suggested defaults follow the link (issue 25): on a
slow link shared by several ranks per host it picks the hierarchical
all-reduce and suggests fp16, saying why; on a fast one it changes neither."""

from __future__ import annotations

import json

import pytest

from dp_plugin.cli import main
from dp_plugin.cli.alphabeta import Link, allreduce_time, ring_allreduce_time


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


def test_ranks_per_host_must_divide_the_workers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="--ranks-per-host 3: must be >= 1 and divide"):
        main(["plan", "--model", "bert-base", "--compute-ms", "900", "--alpha-us", "50",
              "--bandwidth-gbit", "1", "--ranks-per-host", "3", "--workers", "4"])
