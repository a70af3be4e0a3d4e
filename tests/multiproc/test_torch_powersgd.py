"""PowerSGD (``dp_plugin.torch.powersgd.PowerSGDHook``) across real processes.

``workers/torch_powersgd.py``, one launch per case: after every step the
ranks' parameters are bitwise equal and equal a single-process reference
of the algorithm (bitwise at 2 ranks; within 1e-5 at 4, where the engine
sums in an order of its own); the elements sent equal the wire formula;
accumulation; ``hvd.join()``; the refusals. On Gloo (with its shared-memory
transport) with the default buckets and with 512-byte ones (several
buckets in flight: the ``Q`` all-reduces start in bucket order on their
own communicator), MPI, Horovod's ring, and the hierarchical path (two
fake hosts of two ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKERS = Path(__file__).parent / "workers"
WORKER = WORKERS / "torch_powersgd.py"
CASES = worker_cases(WORKER)
ENV = {"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "30"}
SMALL_BUCKETS = {"DP_PLUGIN_FUSION_THRESHOLD": "512"}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES)
def test_powersgd_gloo_small_buckets(case: str) -> None:
    result = run_workers("env", 2, WORKER, args=["--case", case], env={**ENV, **SMALL_BUCKETS},
                         timeout=240)
    assert_ranks_ok(result, 2)


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["reference", "join"])
def test_powersgd_gloo_default_buckets(case: str) -> None:
    result = run_workers("env", 2, WORKER, args=["--case", case], env=ENV, timeout=240)
    assert_ranks_ok(result, 2)


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["reference", "join"])
def test_powersgd_mpi(case: str) -> None:
    result = run_workers("mpirun", 2, WORKER, args=["--case", case],
                         env={**ENV, "DP_PLUGIN_ENGINE": "mpi", **SMALL_BUCKETS}, timeout=240)
    assert_ranks_ok(result, 2)


@pytest.mark.multiproc
def test_powersgd_horovod() -> None:
    result = run_workers("horovodrun", 2, WORKER, args=["--case", "reference"],
                         env={**ENV, "DP_PLUGIN_ENGINE": "horovod", **SMALL_BUCKETS}, timeout=240)
    assert_ranks_ok(result, 2)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_powersgd_hierarchical() -> None:
    result = run_workers("env", 4, WORKERS / "fake_hosts.py",
                         [str(WORKER), "--case", "reference"],
                         env={**ENV, **SMALL_BUCKETS, "DP_TEST_RANKS_PER_HOST": "2",
                              "DP_PLUGIN_HIERARCHICAL_ALLREDUCE": "1", "EXACT": "0"},
                         timeout=240)
    assert_ranks_ok(result, 4)
