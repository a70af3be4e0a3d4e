"""A mistake on one rank before a collective (workers/one_rank_errors.py)
raises on every rank at once, not after DP_PLUGIN_TIMEOUT on the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "one_rank_errors.py"
RUNS = [("env", "gloo", case) for case in worker_cases(WORKER)] + [
    ("mpirun", "mpi", "root_cannot_pickle"),
    ("mpirun", "mpi", "unfrozen_on_one_rank"),
]


@pytest.mark.parametrize(("launcher", "engine", "case"), RUNS)
def test_one_rank_error_reaches_every_rank(launcher: str, engine: str, case: str) -> None:
    result = run_workers(launcher, 2, WORKER, args=["--case", case],
                         env={"DP_PLUGIN_ENGINE": engine, "DP_PLUGIN_TIMEOUT": "60"}, timeout=120)
    assert_ranks_ok(result, 2)
