"""dp_plugin.torch tensor collectives in real processes, on real engines.

Every case of ``workers/torch_collectives.py`` on every (launcher, engine,
size): every collective against a local reference
from deterministic per-rank inputs, autograd through each, process sets, and
rank-dependent mistakes that must raise the same error on every rank (then a
last all-reduce shows the ranks are still in step). Each rank prints
``rank R OK``. One launch per case where the ranks are forked warm (env,
horovodrun); under mpirun, whose ranks start fresh, one launch runs the
cases that initialise alike one after the other (``--case A B ...``):
``collectives`` asks for dynamic process sets, the others for none.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_cases_ok, assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "torch_collectives.py"

WARM_RUNS = [
    ("env", "gloo", 2),
    ("env", "gloo", 3),
    ("horovodrun", "horovod", 2),
]
FRESH_RUNS = [("mpirun", "mpi", 2), ("mpirun", "mpi", 3)]
LAUNCHES = [["collectives"], [c for c in worker_cases(WORKER) if c != "collectives"]]
"""The cases of one fresh launch: the worker's ``start`` initialises dynamic
process sets for its first case's sake (``collectives``) or none."""


@pytest.mark.parametrize(("launcher", "engine", "nprocs"), WARM_RUNS)
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_torch_collectives_match_reference(case: str, launcher: str, engine: str,
                                           nprocs: int) -> None:
    result = run_workers(
        launcher, nprocs, WORKER, args=["--engine", engine, "--case", case],
        env={"DP_PLUGIN_TIMEOUT": "60"}, timeout=240,
    )
    assert_ranks_ok(result, nprocs)


@pytest.mark.parametrize(("launcher", "engine", "nprocs"), FRESH_RUNS)
@pytest.mark.parametrize("cases", LAUNCHES, ids=lambda cases: "-".join(cases))
def test_torch_collectives_match_reference_in_one_launch(cases: list[str], launcher: str,
                                                         engine: str, nprocs: int) -> None:
    result = run_workers(
        launcher, nprocs, WORKER, args=["--engine", engine, "--case", *cases],
        env={"DP_PLUGIN_TIMEOUT": "60"}, timeout=240,
    )
    assert_cases_ok(result, nprocs, cases)
