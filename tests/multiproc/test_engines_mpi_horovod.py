"""The engine battery on the mpi engine (mpirun) and the horovod engine
(horovodrun), plus each engine's timeout behaviour.

Run as a script under mpirun, this module is also the worker of
``test_mpi_emulated_halves``: the battery on an ``MPIEngine`` that ignores
MPICH's native float16 type, so the user-defined float16/bfloat16 ops that
an MPI without those types (e.g. Open MPI) relies on are tested here too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BATTERY = HERE / "workers" / "engine_battery.py"
TIMEOUT_ENV = {"DP_PLUGIN_TIMEOUT": "2"}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_mpi_battery(nprocs: int) -> None:
    result = run_workers("mpirun", nprocs, BATTERY, ["--engine", "mpi"], timeout=120)
    assert_ranks_ok(result, nprocs)


@pytest.mark.timeout(150)
def test_mpi_emulated_halves() -> None:
    result = run_workers("mpirun", 3, __file__, ["--emulated-halves"],
                         env={"PYTHONPATH": str(REPO)}, timeout=120)
    assert_ranks_ok(result, 3)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_mpi_timeout(nprocs: int) -> None:
    result = run_workers("mpirun", nprocs, BATTERY, ["--engine", "mpi", "--timeout-case"],
                         env=TIMEOUT_ENV, timeout=60)
    assert_ranks_ok(result, nprocs, marker="TIMEOUT-OK")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_horovod_battery(nprocs: int) -> None:
    result = run_workers("horovodrun", nprocs, BATTERY, ["--engine", "horovod"], timeout=120)
    assert_ranks_ok(result, nprocs)


@pytest.mark.timeout(90)
def test_horovod_timeout() -> None:
    # Two ranks only: with three, the first waiting rank to time out shuts
    # Horovod down, which fails the other waiting rank's pending all-reduce
    # with a (clear) "Horovod has been shut down" error instead of a timeout,
    # and the battery demands a timeout on every waiting rank.
    result = run_workers("horovodrun", 2, BATTERY, ["--engine", "horovod", "--timeout-case"],
                         env=TIMEOUT_ENV, timeout=60)
    assert_ranks_ok(result, 2, marker="TIMEOUT-OK")


def _emulated_halves_worker() -> None:
    from dp_plugin.config import Config
    from dp_plugin.engines.mpi import MPIEngine
    from dp_plugin.launch import detect

    # The battery and its fail-fast helper are scripts' siblings, not a package.
    sys.path.insert(0, str(HERE / "workers"))
    import engine_battery
    from _fail_fast import fail_fast

    class EmulatedHalvesEngine(MPIEngine):
        _use_native_halves = False

    rank = "?"
    try:
        topology = detect()
        rank = str(topology.rank)
        engine = EmulatedHalvesEngine(topology, Config.from_env())
        if sorted(engine._half_types) != ["bfloat16", "float16"]:
            raise AssertionError(f"halves not emulated: {sorted(engine._half_types)}")
        engine_battery.run_battery(engine)
        engine.shutdown()
    except BaseException:
        fail_fast(rank)
    print(f"rank {rank} OK", flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--emulated-halves"]:
    _emulated_halves_worker()
