"""A mistake on one rank before a collective (workers/one_rank_errors.py)
raises on every rank at once, not after DP_PLUGIN_TIMEOUT on the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_cases_ok, assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "one_rank_errors.py"
RUNS = [("env", "gloo", case) for case in worker_cases(WORKER)]
MPI_CASES = ["root_cannot_pickle", "unfrozen_on_one_rank"]


@pytest.mark.parametrize(("launcher", "engine", "case"), RUNS)
def test_one_rank_error_reaches_every_rank(launcher: str, engine: str, case: str) -> None:
    result = run_workers(launcher, 2, WORKER, args=["--case", case],
                         env={"DP_PLUGIN_ENGINE": engine, "DP_PLUGIN_TIMEOUT": "60"}, timeout=120)
    assert_ranks_ok(result, 2)


def test_one_rank_errors_reach_every_rank_under_mpirun() -> None:
    """Two of the cases on the MPI engine, one after the other in one launch
    (mpirun's ranks start fresh): the error of each reaches every rank, which
    are then still in step for the next."""
    result = run_workers("mpirun", 2, WORKER, args=["--case", *MPI_CASES],
                         env={"DP_PLUGIN_ENGINE": "mpi", "DP_PLUGIN_TIMEOUT": "60"}, timeout=120)
    assert_cases_ok(result, 2, MPI_CASES)
