"""The engine battery on the mpi engine (mpirun) and the horovod engine
(horovodrun), plus each engine's timeout behaviour. Under mpirun, whose
ranks start fresh, one launch runs the battery's cases one after the other
(``--case collectives errors``: the errors case leaves the engine usable by
design); under horovodrun (forked warm) one launch per case.

Run as a script under mpirun, this module is also the worker of
``test_mpi_emulated_halves``: the battery's cases on an ``MPIEngine`` that ignores
MPICH's native float16 type, so the user-defined float16/bfloat16 ops that
an MPI without those types (e.g. Open MPI) relies on are tested here too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from dp_plugin.engines.base import Engine
from tests.multiproc.harness import assert_cases_ok, assert_ranks_ok, run_workers, worker_cases

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BATTERY = HERE / "workers" / "engine_battery.py"
CASES = [c for c in worker_cases(BATTERY) if c != "timeout"]
TIMEOUT_ENV = {"DP_PLUGIN_TIMEOUT": "2"}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_mpi_battery(nprocs: int) -> None:
    result = run_workers("mpirun", nprocs, BATTERY, ["--engine", "mpi", "--case", *CASES],
                         timeout=120)
    assert_cases_ok(result, nprocs, CASES)


@pytest.mark.timeout(150)
def test_mpi_emulated_halves() -> None:
    result = run_workers("mpirun", 3, __file__, ["--engine", "mpi", "--case", *CASES],
                         env={"PYTHONPATH": str(REPO)}, timeout=120)
    assert_cases_ok(result, 3, CASES)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_mpi_timeout(nprocs: int) -> None:
    result = run_workers("mpirun", nprocs, BATTERY, ["--engine", "mpi", "--case", "timeout"],
                         env=TIMEOUT_ENV, timeout=60)
    assert_ranks_ok(result, nprocs, marker="TIMEOUT-OK")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.parametrize("case", CASES)
def test_horovod_battery(case: str, nprocs: int) -> None:
    result = run_workers("horovodrun", nprocs, BATTERY, ["--engine", "horovod", "--case", case],
                         timeout=120)
    assert_ranks_ok(result, nprocs)


@pytest.mark.timeout(90)
def test_horovod_timeout() -> None:
    # Two ranks only: with three, the first waiting rank to time out shuts
    # Horovod down, which fails the other waiting rank's pending all-reduce
    # with a (clear) "Horovod has been shut down" error instead of a timeout,
    # and the battery demands a timeout on every waiting rank.
    result = run_workers("horovodrun", 2, BATTERY, ["--engine", "horovod", "--case", "timeout"],
                         env=TIMEOUT_ENV, timeout=60)
    assert_ranks_ok(result, 2, marker="TIMEOUT-OK")


def _emulated_halves_worker() -> None:
    from dp_plugin.engines.mpi import MPIEngine

    # The battery and its case runner are scripts' siblings, not a package.
    sys.path.insert(0, str(HERE / "workers"))
    import engine_battery
    from _fail_fast import run_cases

    class EmulatedHalvesEngine(MPIEngine):
        _use_native_halves = False

    def start(args: argparse.Namespace) -> Engine:
        engine = engine_battery.start_engine(args, EmulatedHalvesEngine)
        halves = sorted(engine._half_types)
        if halves != ["bfloat16", "float16"]:
            raise AssertionError(f"halves not emulated: {halves}")
        return engine

    cases = {k: v for k, v in engine_battery.CASES.items() if k != "timeout"}
    run_cases(cases, parser=engine_battery.battery_parser(), setup=start,
              teardown=lambda engine: engine.shutdown())


if __name__ == "__main__":
    _emulated_halves_worker()
