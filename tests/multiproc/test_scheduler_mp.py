"""GradientScheduler end to end: real processes, real engines, sizes 2 and 3.

The worker's ``reference`` case compares every step's reduced gradients with
a numpy reference; its ``mismatch`` case checks that a layout difference raises
LayoutMismatchError on every rank instead of hanging.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "scheduler_worker.py"
# Each worker case is one test below (with the launchers it needs).
assert worker_cases(WORKER) == ["reference", "mismatch", "prefused"]

CASES = [
    ("env", "gloo", 2),
    ("env", "gloo", 3),
    ("mpirun", "mpi", 2),
    ("mpirun", "mpi", 3),
    ("horovodrun", "horovod", 2),
]


@pytest.mark.parametrize(("launcher", "engine", "nprocs"), CASES)
def test_scheduler_matches_numpy_reference(launcher: str, engine: str, nprocs: int) -> None:
    result = run_workers(
        launcher, nprocs, WORKER, args=["--engine", engine, "--case", "reference"],
        env={"DP_PLUGIN_TIMEOUT": "60"}, timeout=180,
    )
    assert_ranks_ok(result, nprocs)


MISMATCH_CASES = [("env", "gloo", 3), ("mpirun", "mpi", 2)]


@pytest.mark.parametrize(("launcher", "engine", "nprocs"), MISMATCH_CASES)
def test_layout_mismatch_raises_on_every_rank(launcher: str, engine: str, nprocs: int) -> None:
    result = run_workers(
        launcher, nprocs, WORKER, args=["--engine", engine, "--case", "mismatch"],
        env={"DP_PLUGIN_TIMEOUT": "60"}, timeout=120,
    )
    assert_ranks_ok(result, nprocs, marker="MISMATCH-OK")


@pytest.mark.parametrize(("launcher", "engine"), [("env", "gloo"), ("horovodrun", "horovod")])
def test_prefused_buckets_are_not_fused_again_by_horovod(launcher: str, engine: str,
                                                        tmp_path: Path) -> None:
    """Under the horovod engine, Horovod's library gets a 1 MiB fusion threshold at
    init (engines/horovod_env.py): the timeline shows no copy of dp_plugin's 2 MiB
    buckets into Horovod's fusion buffer, and the user's environment is unchanged."""
    timeline = tmp_path / "horovod_timeline.json"  # Horovod's own (and dp_plugin's .rankN)
    env = {"DP_PLUGIN_TIMEOUT": "60"}
    if engine == "horovod":
        env["HOROVOD_TIMELINE"] = str(timeline)
    result = run_workers(launcher, 2, WORKER, args=["--engine", engine, "--case", "prefused"],
                         env=env, timeout=120)
    assert_ranks_ok(result, 2)
    if engine != "horovod":
        return
    text = timeline.read_text()  # Chrome trace events, written as they happen
    assert "allreduce.prefused.bucket3" in text and "GLOO_ALLREDUCE" in text, text[:2000]
    assert "MEMCPY_IN_FUSION_BUFFER" not in text, "Horovod fused dp_plugin's buckets again"
