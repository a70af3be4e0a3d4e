"""dp_plugin.torch tensor collectives in real processes, on real engines.

One launch per (launcher, engine, size, case of ``workers/torch_collectives.py``):
every collective against a local reference
from deterministic per-rank inputs, autograd through each, process sets, and
rank-dependent mistakes that must raise the same error on every rank (then a
last all-reduce shows the ranks are still in step). Each rank prints
``rank R OK``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "torch_collectives.py"

RUNS = [
    ("env", "gloo", 2),
    ("env", "gloo", 3),
    ("mpirun", "mpi", 2),
    ("mpirun", "mpi", 3),
    ("horovodrun", "horovod", 2),
]


@pytest.mark.parametrize(("launcher", "engine", "nprocs"), RUNS)
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_torch_collectives_match_reference(case: str, launcher: str, engine: str,
                                           nprocs: int) -> None:
    result = run_workers(
        launcher, nprocs, WORKER, args=["--engine", engine, "--case", case],
        env={"DP_PLUGIN_TIMEOUT": "60"}, timeout=240,
    )
    assert_ranks_ok(result, nprocs)
