"""Sharded optimizer state (``shard_optimizer_state=True``) across real processes.

``workers/torch_sharded.py``, one launch per case: every case trains a
sharded and an unsharded ``DistributedOptimizer`` side by side and requires
bitwise equal parameters after every step (SGD with momentum, Adam, AdamW;
accumulation, fp16 compression, predivide, groups, a closure, a new param
group; checkpoints both ways, elastic commit/restore, broadcast of the
state; join; process sets; refusals). Gloo at 3 ranks with 512-byte
buckets (several per model, so shard ranges cross parameter boundaries) and
at 2 with the default buckets; MPI at 3 ranks (its native
``Ireduce_scatter``: only the rank's range comes back) and Horovod's ring
at 2 (``hvd.reducescatter_async``). The MPI and Horovod runs are one
launch each, their cases one after the other (``--case A B ...``): their
ranks start fresh (mpirun) or under horovodrun, a launch costs more than a
case.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_cases_ok, assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "torch_sharded.py"
CASES = [c for c in worker_cases(WORKER) if c not in ("from_env", "check_finite")]
SMALL_BUCKETS = {"DP_PLUGIN_FUSION_THRESHOLD": "512"}


TRAINING = ["optimizers", "options", "checkpoint", "join"]


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES)
def test_sharded_matches_unsharded_gloo_3_ranks(case: str) -> None:
    result = run_workers("env", 3, WORKER, args=["--case", case],
                         env={"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "30",
                              **SMALL_BUCKETS}, timeout=240)
    assert_ranks_ok(result, 3)


@pytest.mark.multiproc
@pytest.mark.parametrize("case", TRAINING)
def test_sharded_matches_unsharded_gloo_2_ranks(case: str) -> None:
    """The default buckets (one for this model): each rank's range cuts it in two."""
    result = run_workers("env", 2, WORKER, args=["--case", case],
                         env={"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "30"},
                         timeout=240)
    assert_ranks_ok(result, 2)


@pytest.mark.multiproc
def test_sharded_matches_unsharded_mpi() -> None:
    result = run_workers("mpirun", 3, WORKER, args=["--case", *TRAINING],
                         env={"DP_PLUGIN_ENGINE": "mpi", "DP_PLUGIN_TIMEOUT": "30",
                              **SMALL_BUCKETS}, timeout=300)
    assert_cases_ok(result, 3, TRAINING)


@pytest.mark.multiproc
def test_sharded_matches_unsharded_horovod() -> None:
    cases = ["optimizers", "checkpoint"]
    result = run_workers("horovodrun", 2, WORKER, args=["--case", *cases],
                         env={"DP_PLUGIN_ENGINE": "horovod", "DP_PLUGIN_TIMEOUT": "30",
                              **SMALL_BUCKETS}, timeout=300)
    assert_cases_ok(result, 2, cases)


@pytest.mark.multiproc
def test_environment_variable_turns_sharding_on() -> None:
    """DP_PLUGIN_SHARD_OPTIMIZER_STATE=1 shards where the argument is not given."""
    result = run_workers("env", 2, WORKER, args=["--case", "from_env"],
                         env={"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "30",
                              "DP_PLUGIN_SHARD_OPTIMIZER_STATE": "1"}, timeout=240)
    assert_ranks_ok(result, 2)


@pytest.mark.multiproc
@pytest.mark.parametrize(("launcher", "engine"), [("env", "gloo"), ("mpirun", "mpi")])
def test_check_finite_skips_the_sharded_step_on_every_rank(launcher: str, engine: str) -> None:
    """The finite flags ride in the control slot, all-reduced beside MPI's
    reduce-scatter: every rank reads them and skips alike."""
    result = run_workers(launcher, 3, WORKER, args=["--case", "check_finite"],
                         env={"DP_PLUGIN_ENGINE": engine, "DP_PLUGIN_TIMEOUT": "30",
                              "DP_PLUGIN_CHECK_FINITE": "skip", **SMALL_BUCKETS}, timeout=240)
    assert_ranks_ok(result, 3)
