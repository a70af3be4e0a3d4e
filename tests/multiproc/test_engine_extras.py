"""alltoall, reducescatter and subgroups on the real engines.

One launch per (engine, world size, case of tests/multiproc/workers/engine_extras.py):
even, uneven and zero-row all-to-alls (numpy and torch, several dtypes),
reduce-scatters with Horovod's split of uneven first dimensions, two
disjoint subgroups running collectives at the same time followed by a
job-wide collective, and input mistakes on one rank raising on every rank.
World size 3 gives a subgroup of two ranks and an uneven split of the rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "engine_extras.py"
# Generous but finite: a broken collective fails the run instead of hanging it.
ENV = {"DP_PLUGIN_TIMEOUT": "60"}


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("launcher", "engine", "nprocs", "extra"),
    [
        ("env", "gloo", 2, []),
        ("env", "gloo", 3, []),
        ("mpirun", "mpi", 2, ["--nested"]),
        ("mpirun", "mpi", 3, ["--nested"]),
        # Three ranks pass too, but each horovodrun start costs ~10 s here.
        ("horovodrun", "horovod", 2, []),
    ],
    ids=["gloo-2", "gloo-3", "mpi-2", "mpi-3", "horovod-2"],
)
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_engine_extras(case: str, launcher: str, engine: str, nprocs: int,
                       extra: list[str]) -> None:
    result = run_workers(launcher, nprocs, WORKER, ["--engine", engine, "--case", case, *extra],
                         env=ENV, timeout=120)
    assert_ranks_ok(result, nprocs)
