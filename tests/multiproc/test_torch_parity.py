"""horovod.torch parity across real processes: ``workers/torch_parity.py``.

One launch per case, 2 ranks on gloo; the asynchronous gather case also on
MPI (its ``Iallgatherv`` / ``Ireduce_scatter`` path), and the shutdown and
re-init case also on Horovod's ring. Each rank prints ``rank R OK``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "torch_parity.py"


@pytest.mark.multiproc
@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_torch_parity_gloo(case: str) -> None:
    result = run_workers("env", 2, WORKER, args=["--case", case],
                         env={"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "20"},
                         timeout=180)
    assert_ranks_ok(result, 2)


@pytest.mark.multiproc
def test_async_gather_mpi() -> None:
    result = run_workers("mpirun", 2, WORKER, args=["--case", "async_gather"],
                         env={"DP_PLUGIN_ENGINE": "mpi", "DP_PLUGIN_TIMEOUT": "20"},
                         timeout=180)
    assert_ranks_ok(result, 2)


@pytest.mark.multiproc
def test_shutdown_after_failure_horovod() -> None:
    """The re-init on Horovod's ring: it crashed (segmentation fault inside
    hvd.init()) while the engine set both HOROVOD_CYCLE_TIME and
    HOROVOD_FUSION_THRESHOLD (see ``dp_plugin/engines/horovod_env.py``)."""
    result = run_workers("horovodrun", 2, WORKER, args=["--case", "shutdown_after_failure"],
                         env={"DP_PLUGIN_ENGINE": "horovod", "DP_PLUGIN_TIMEOUT": "20"},
                         timeout=180)
    assert_ranks_ok(result, 2)
