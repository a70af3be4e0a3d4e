"""Sparse gradients through DistributedOptimizer across real processes.

``workers/sparse_optimizer.py``: ``sparse_as_dense=False`` (Horovod's
all-gather of indices and values) and ``sparse_as_dense=True`` give the same
parameters within 1e-5, and both equal one process on the global batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "sparse_optimizer.py"


@pytest.mark.multiproc
@pytest.mark.parametrize("case", worker_cases(WORKER))
@pytest.mark.parametrize(("launcher", "nprocs"), [("env", 2), ("env", 3)])
def test_sparse_and_dense_reduction_match_one_process(launcher: str, nprocs: int,
                                                      case: str) -> None:
    result = run_workers(launcher, nprocs, WORKER, args=["--case", case],
                         env={"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "60"},
                         timeout=120)
    assert_ranks_ok(result, nprocs)
