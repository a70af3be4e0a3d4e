"""DP_PLUGIN_CHECK_FINITE on real processes: an inf on one rank (workers/check_finite.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers

WORKER = Path(__file__).parent / "workers" / "check_finite.py"


@pytest.mark.parametrize(("case", "mode"), [("skip", "skip"), ("raise", "raise"),
                                            ("raise_joined", "raise")])
@pytest.mark.parametrize(("launcher", "engine"), [("env", "gloo"), ("mpirun", "mpi")])
def test_inf_on_one_rank(case: str, mode: str, launcher: str, engine: str) -> None:
    result = run_workers(
        launcher, 2, WORKER, args=["--case", case],
        env={"DP_PLUGIN_ENGINE": engine, "DP_PLUGIN_CHECK_FINITE": mode,
             "DP_PLUGIN_TIMEOUT": "60"}, timeout=120,
    )
    assert_ranks_ok(result, 2)
    if mode == "skip":
        assert result.output.count("the optimizer step is skipped on every rank") == 1, \
            result.output
