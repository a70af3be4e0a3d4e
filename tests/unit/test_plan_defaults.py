"""``dp-plugin plan``'s suggested defaults follow the link: on a
slow link shared by several ranks per host it picks the hierarchical
all-reduce and suggests fp16, saying why; on a fast one it changes neither."""

from __future__ import annotations

import json
import math

import pytest

from dp_plugin.cli import main
from dp_plugin.cli.alphabeta import (
    Link,
    allreduce_time,
    buckets,
    hierarchical_allreduce_time,
    ring_allreduce_time,
)
from dp_plugin.config import Config


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


# -- the default plan, the assumed host and the per-row bucket suggestions ----------


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", "--model", "resnet50", "--compute-ms", "250", "--alpha-us", "10",
                 "--bandwidth-gbit", "25", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_the_default_bucket_plan_is_dp_plugins_own(capsys: pytest.CaptureFixture[str]) -> None:
    """A 1 MiB first bucket, then 25 MiB or a quarter of the gradient, as
    Config.bucket_caps plans it for the gradient scheduler."""
    from dp_plugin.cli.shapes import model_shapes

    total = sum(4 * math.prod(shape) for _, shape in model_shapes("resnet50"))
    out = plan_json(capsys, "--workers", "8")
    assert out["plan"] == {"threshold_bytes": Config().bucket_caps(total_bytes=total)[0],
                           "first_threshold_bytes": 1 << 20}
    assert out["plan"]["threshold_bytes"] == min(25 << 20, -(-total // 4))
    # One size for every bucket when asked, as DP_PLUGIN_FUSION_THRESHOLD does.
    out = plan_json(capsys, "--workers", "8", "--threshold-mib", "64")
    assert out["plan"] == {"threshold_bytes": 64 << 20, "first_threshold_bytes": None}


def test_the_model_buckets_as_the_planner_does() -> None:
    sizes = [3 << 19, 1 << 19, 1 << 19, 5 << 20, 1 << 20]  # 1.5, .5, .5, 5, 1 MiB
    assert buckets(sizes, 4 << 20, first_threshold=1 << 20) == \
        [(0, 3 << 19), (2, 1 << 20), (3, 5 << 20), (4, 1 << 20)]
    assert buckets(sizes, 4 << 20) == [(2, 5 << 19), (3, 5 << 20), (4, 1 << 20)]


def test_ranks_per_host_defaults_to_a_typical_node_and_says_so(
        capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(capsys, "--workers", "8,64")
    assert out["ranks_per_host"] == 8 and "assumed 8 ranks per host" in out["assumed"]
    out = plan_json(capsys, "--workers", "4,12")
    assert out["ranks_per_host"] == 4 and "divides every worker count" in out["assumed"]
    out = plan_json(capsys, "--workers", "8", "--ranks-per-host", "1")
    assert out["ranks_per_host"] == 1 and out["assumed"] == ""
    assert main(["plan", "--model", "resnet50", "--compute-ms", "250", "--alpha-us", "10",
                 "--bandwidth-gbit", "25", "--workers", "16"]) == 0
    assert "assumed 8 ranks per host (a typical 8-GPU node); give --ranks-per-host" in \
        capsys.readouterr().out


def test_a_better_bucket_size_is_named_at_every_worker_count_it_helps(
        capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(capsys, "--workers", "8,16,1024")
    better = {b["workers"]: b for b in out["better_buckets"]}
    rows = {r["workers"]: r for r in out["rows"]}
    assert 8 in better and 16 in better, better  # not only at the largest count
    for n, b in better.items():
        assert b["step_ms"] <= rows[n]["step_ms"] * 0.99
        assert b["fusion_threshold"] == int(b["threshold_mib"] * 2**20)
    assert main(["plan", "--model", "resnet50", "--compute-ms", "250", "--alpha-us", "10",
                 "--bandwidth-gbit", "25", "--workers", "8"]) == 0
    text = capsys.readouterr().out
    assert "at 8 workers: DP_PLUGIN_FUSION_THRESHOLD=" in text, text
