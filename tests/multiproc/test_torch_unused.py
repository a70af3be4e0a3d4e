"""Per-rank unused parameters with collectives inside backward (the ordering case).

``workers/torch_unused.py``: a parameter used on only some ranks in a step,
SyncBatchNorm's backward all-reduce in between, one tensor per bucket; one
and two DistributedOptimizers. Every rank must match one process on the
global batch after every step — no hang, no error, no data swapped — on
gloo (2 and 3 ranks), MPI, and Horovod's engine under horovodrun.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "torch_unused.py"
ENV = {"DP_PLUGIN_TIMEOUT": "60", "HOROVOD_FUSION_THRESHOLD": "0"}


# Both cases on gloo at 2 ranks; the harder one (two optimizers) elsewhere.
RUNS = [("env", "gloo", 2, case) for case in worker_cases(WORKER)] + [
    ("env", "gloo", 3, "two_optimizers"), ("mpirun", "mpi", 2, "two_optimizers"),
    ("horovodrun", "horovod", 2, "two_optimizers"),
]


@pytest.mark.multiproc
@pytest.mark.parametrize(("launcher", "engine", "nprocs", "case"), RUNS)
def test_unused_parameters_with_collectives_in_backward(launcher: str, engine: str,
                                                        nprocs: int, case: str) -> None:
    result = run_workers(launcher, nprocs, WORKER, args=["--case", case],
                         env={**ENV, "DP_PLUGIN_ENGINE": engine}, timeout=150)
    assert_ranks_ok(result, nprocs)
