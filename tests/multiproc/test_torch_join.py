"""``hvd.join()`` answers the others' tensor collectives: ``workers/torch_join.py``.

One launch per case: 3 ranks on gloo (the process set case needs 3), the
collectives case also on MPI and under horovodrun (Horovod's engine matches
collectives by name). Each rank prints ``rank R OK``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "torch_join.py"
ENV = {"DP_PLUGIN_TIMEOUT": "20"}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_join_gloo(case: str) -> None:
    n = 3 if case in ("collectives", "outside_set") else 2
    result = run_workers("env", n, WORKER, args=["--case", case],
                         env={**ENV, "DP_PLUGIN_ENGINE": "gloo"}, timeout=180)
    assert_ranks_ok(result, n)


@pytest.mark.multiproc
def test_join_collectives_mpi() -> None:
    result = run_workers("mpirun", 2, WORKER, args=["--case", "collectives"],
                         env={**ENV, "DP_PLUGIN_ENGINE": "mpi"}, timeout=180)
    assert_ranks_ok(result, 2)


@pytest.mark.multiproc
def test_join_collectives_horovodrun() -> None:
    result = run_workers("horovodrun", 2, WORKER, args=["--case", "collectives"],
                         env={**ENV, "DP_PLUGIN_ENGINE": "horovod"}, timeout=180)
    assert_ranks_ok(result, 2)
