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
assert worker_cases(WORKER) == ["reference", "mismatch"]

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
