"""DP_PLUGIN_CHECK_FINITE on real processes: an inf on one rank (workers/check_finite.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_cases_ok, run_workers

WORKER = Path(__file__).parent / "workers" / "check_finite.py"


RUNS = [
    *(("env", "gloo", [case], mode) for case, mode in
      (("skip", "skip"), ("raise", "raise"), ("raise_joined", "raise"))),
    # mpirun's ranks start fresh: the two cases of one mode share a launch.
    ("mpirun", "mpi", ["skip"], "skip"),
    ("mpirun", "mpi", ["raise", "raise_joined"], "raise"),
]


@pytest.mark.parametrize(("launcher", "engine", "cases", "mode"), RUNS,
                         ids=lambda v: "-".join(v) if isinstance(v, list) else None)
def test_inf_on_one_rank(launcher: str, engine: str, cases: list[str], mode: str) -> None:
    result = run_workers(
        launcher, 2, WORKER, args=["--case", *cases],
        env={"DP_PLUGIN_ENGINE": engine, "DP_PLUGIN_CHECK_FINITE": mode,
             "DP_PLUGIN_TIMEOUT": "60"}, timeout=120,
    )
    assert_cases_ok(result, 2, cases)
    if mode == "skip":
        assert result.output.count("the optimizer step is skipped on every rank") == 1, \
            result.output
