"""PowerSGD (``dp_plugin.torch.powersgd.PowerSGDHook``) across real processes.

``workers/torch_powersgd.py``, one launch per case: after every step the
ranks' parameters are bitwise equal and equal a single-process reference
of the algorithm within 1e-5; the elements sent equal the wire formula;
accumulation; ``hvd.join()``; with ``shard_optimizer_state=True`` (bitwise
the unsharded PowerSGD run, at 3 ranks); the refusals. On Gloo (with its shared-memory
transport) with the default buckets and with 512-byte ones (several
buckets in flight: the ``Q`` all-reduces start in bucket order on their
own communicator), MPI, Horovod's ring, and the hierarchical path (two
fake hosts of two ranks). Under torchrun a killed rank's restart begins
the hook's state afresh, as docs/torch.md says.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_cases_ok, assert_ranks_ok, run_workers, worker_cases

WORKERS = Path(__file__).parent / "workers"
WORKER = WORKERS / "torch_powersgd.py"
CASES = [c for c in worker_cases(WORKER) if not c.startswith("elastic") and c != "sharded"]
ENV = {"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "30"}
SMALL_BUCKETS = {"DP_PLUGIN_FUSION_THRESHOLD": "512"}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES)
def test_powersgd_gloo_small_buckets(case: str) -> None:
    result = run_workers("env", 2, WORKER, args=["--case", case], env={**ENV, **SMALL_BUCKETS},
                         timeout=240)
    assert_ranks_ok(result, 2)


@pytest.mark.multiproc
def test_powersgd_with_sharded_optimizer_state() -> None:
    """At 3 ranks, with buckets small enough that shard ranges cross
    parameters: bitwise the unsharded PowerSGD run, state sharded."""
    result = run_workers("env", 3, WORKER, args=["--case", "sharded"],
                         env={**ENV, **SMALL_BUCKETS}, timeout=240)
    assert_ranks_ok(result, 3)


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["reference", "join"])
def test_powersgd_gloo_default_buckets(case: str) -> None:
    result = run_workers("env", 2, WORKER, args=["--case", case], env=ENV, timeout=240)
    assert_ranks_ok(result, 2)


@pytest.mark.multiproc
def test_powersgd_mpi() -> None:
    """Both cases in one launch, one after the other: mpirun's ranks start
    fresh, and a launch costs more than a case."""
    cases = ["reference", "join"]
    result = run_workers("mpirun", 2, WORKER, args=["--case", *cases],
                         env={**ENV, "DP_PLUGIN_ENGINE": "mpi", **SMALL_BUCKETS}, timeout=240)
    assert_cases_ok(result, 2, cases)


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
                              "DP_PLUGIN_HIERARCHICAL_ALLREDUCE": "1"},
                         timeout=240)
    assert_ranks_ok(result, 4)


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_powersgd_state_restarts_after_an_elastic_restart(tmp_path: Path) -> None:
    """The error feedback, Q and step counter are not committed: a restarted
    run begins again with plain steps, zero errors and the seeded Q, and
    ends bitwise where a run that made a new hook at the commit ends."""
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir()
    killed.mkdir()
    ok = run_workers("env", 2, WORKER, args=["--case", "elastic_reference", "--out",
                                              str(reference)], env=ENV, timeout=150)
    assert_ranks_ok(ok, 2)
    result = run_workers("torchrun", 2, WORKER, args=["--case", "elastic_killed", "--out",
                                                      str(killed)],
                         env=ENV, timeout=300, launcher_args=["--max-restarts", "1"])
    for rank in range(2):
        assert f"rank {rank} attempt 1 starts at step 5 (hook at step 0)" in result.output, \
            result.output
    assert "attempt 2" not in result.output, result.output
    assert_ranks_ok(result, 2)
    assert (killed / "weights.bin").read_bytes() == (reference / "weights.bin").read_bytes()
