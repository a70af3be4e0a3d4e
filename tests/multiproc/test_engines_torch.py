"""gloo and nccl engines in real processes, under every launcher.

The cases of the battery (tests/multiproc/workers/engine_battery.py):
``collectives`` (every op x dtype against a numpy reference, empty and > 8
MiB buffers, several all-reduces in flight, broadcasts, uneven
all-gathers), ``errors`` (messages, barrier), ``timeout``. Each is a launch
of its own, except under torchrun and mpirun, whose ranks start fresh: one
launch there runs ``collectives`` then ``errors`` (``--case A B``; the
errors case leaves the engine usable by design). World size 3 catches
pairing bugs that 2 hides.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_cases_ok, assert_ranks_ok, run_workers, worker_cases

BATTERY = Path(__file__).parent / "workers" / "engine_battery.py"
CASES = [c for c in worker_cases(BATTERY) if c != "timeout"]
# Generous but finite: a broken collective fails the run instead of hanging it.
ENV = {"DP_PLUGIN_TIMEOUT": "60"}
SECRET = "a" * 32


@pytest.mark.parametrize(
    ("launcher", "nprocs", "rendezvous", "shm"),
    [
        ("env", 2, "rendezvous: env://", "1"),
        ("env", 3, "rendezvous: env://", "1"),
        ("env", 3, "rendezvous: env://", "0"),
        ("horovodrun", 2, "announced through Horovod's rendezvous server", "1"),
    ],
    ids=["env-2", "env-3", "env-3-tcp", "horovodrun-2"],
)
@pytest.mark.parametrize("case", CASES)
def test_gloo_battery(case: str, launcher: str, nprocs: int, rendezvous: str, shm: str) -> None:
    """One host: all-reduces go through shared memory unless
    DP_PLUGIN_SHARED_MEMORY=0 keeps them on Gloo's TCP (the path across hosts).

    Under horovodrun the ``errors`` case runs with DP_PLUGIN_JOB_SECRET on
    every rank (``collectives`` without): rank 0 signs the store address it
    publishes in Horovod's rendezvous server and the others verify it, or
    they would not meet.

    The ``collectives`` case under env-2 and horovodrun-2 is a fresh launch
    (the harness forks the others from its warm server): the canaries of
    interpreter start-up and exit for the gloo engine under both launchers."""
    env = {**ENV, "DP_PLUGIN_SHARED_MEMORY": shm}
    if (launcher, case) == ("horovodrun", "errors"):
        env["DP_PLUGIN_JOB_SECRET"] = SECRET
    fresh = case == "collectives" and (launcher, nprocs) in (("env", 2), ("horovodrun", 2))
    result = run_workers(launcher, nprocs, BATTERY, ["--engine", "gloo", "--case", case],
                         env=env, timeout=180, fresh=fresh)
    assert_ranks_ok(result, nprocs)
    assert result.output.count(rendezvous) == nprocs, result.output
    used = "shared memory: True" if shm == "1" else "shared memory: False"
    assert result.output.count(used) == nprocs, result.output


@pytest.mark.parametrize(
    ("launcher", "rendezvous"),
    [("torchrun", "rendezvous: env://"), ("mpirun", "announced through an MPI broadcast")],
    ids=["torchrun-2", "mpirun-2"],
)
def test_gloo_battery_in_one_launch(launcher: str, rendezvous: str) -> None:
    """Every case of the battery at 2 ranks over shared memory, one after the
    other in one launch (its ranks start fresh)."""
    result = run_workers(launcher, 2, BATTERY, ["--engine", "gloo", "--case", *CASES],
                         env={**ENV, "DP_PLUGIN_SHARED_MEMORY": "1"}, timeout=180)
    assert_cases_ok(result, 2, CASES)
    assert result.output.count(rendezvous) == 2, result.output
    assert result.output.count("shared memory: True") == 2, result.output


def test_gloo_timeout_names_collective_and_rank_and_exits() -> None:
    """The last rank skips an all-reduce: the others raise
    CollectiveTimeoutError (checked in the worker) and every process exits 0."""
    result = run_workers(
        "env", 3, BATTERY, ["--engine", "gloo", "--case", "timeout"],
        env={"DP_PLUGIN_TIMEOUT": "2"}, timeout=90,
    )
    assert_ranks_ok(result, 3, marker="TIMEOUT-OK")
    for rank in (0, 1):
        assert f"rank {rank}: gloo allreduce of 'bucket-7'" in result.output, result.output


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_nccl_battery(case: str) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the nccl engine needs one GPU per rank")
    nprocs = min(2, torch.cuda.device_count())
    result = run_workers(
        "env", nprocs, BATTERY, ["--engine", "nccl", "--device", "cuda", "--case", case], env=ENV,
        timeout=300,
    )
    assert_ranks_ok(result, nprocs)


def test_gloo_joins_a_user_group_and_leaves_it_alone() -> None:
    """In-process, one rank: a default group the user made is reused and
    survives the engine's shutdown; one the engine made is destroyed."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from dp_plugin.config import Config
    from dp_plugin.engines import create_engine
    from dp_plugin.launch.launchers import Topology

    engine = create_engine("gloo", Topology.single(), Config(timeout_s=30))
    assert dist.is_initialized()
    assert engine.buffer_device == "cpu"
    engine.shutdown()
    assert not dist.is_initialized()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        engine = create_engine("gloo", Topology.single(), Config(timeout_s=30))
        assert "already-initialized" in engine.rendezvous_description  # type: ignore[attr-defined]
        buf = torch.arange(4, dtype=torch.float32)
        engine.allreduce_async(buf, "average").wait()
        assert buf.tolist() == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(ValueError, match="not contiguous"):
            engine.allreduce_async(torch.zeros(8)[::2])
        engine.shutdown()
        assert dist.is_initialized(), "the engine destroyed a group it did not create"
    finally:
        dist.destroy_process_group()
