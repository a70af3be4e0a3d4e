"""``hvd.join()`` with Horovod's semantics: ``workers/torch_join.py``.

One launch per case on gloo, at the sizes in ``SIZES`` (the process set
cases need 3; who joined last at 2 and 3), the collectives case also on MPI
and under horovodrun (Horovod's engine matches collectives by name). Each
rank prints ``rank R OK``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "torch_join.py"
ENV = {"DP_PLUGIN_TIMEOUT": "20"}


SIZES = {"collectives": (3,), "outside_set": (3,), "last_joiner": (2, 3), "blamed_ranks": (3,),
         "before_the_first_step": (2, 3)}
"""World sizes per case (default: 2)."""

SHORT = {"slow_steps": "5"}
"""Cases that step for longer than DP_PLUGIN_TIMEOUT: a short one."""


@pytest.mark.multiproc
@pytest.mark.parametrize(("case", "n"), [(case, n) for case in worker_cases(WORKER)
                                         for n in SIZES.get(case, (2,))])
def test_join_gloo(case: str, n: int) -> None:
    env = {**ENV, "DP_PLUGIN_ENGINE": "gloo"}
    if case in SHORT:
        env["DP_PLUGIN_TIMEOUT"] = SHORT[case]
    result = run_workers("env", n, WORKER, args=["--case", case], env=env, timeout=180)
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
