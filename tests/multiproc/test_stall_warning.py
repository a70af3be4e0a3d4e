"""The stall warning: a rank that waits in a collective past
DP_PLUGIN_STALL_WARNING_SECONDS logs, every period, which collective and
which ranks are not there yet, and still finishes once they come
(workers/stall_warning.py). The hard timeout stays DP_PLUGIN_TIMEOUT's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers

WORKER = Path(__file__).parent / "workers" / "stall_warning.py"
WARN_S = 1.0
SLEEP_S = 4.5


@pytest.mark.multiproc
@pytest.mark.parametrize(("launcher", "engine", "nprocs"), [
    ("env", "gloo", 3),
    ("mpirun", "mpi", 2),
])
def test_waiting_ranks_warn_naming_the_late_rank(launcher: str, engine: str, nprocs: int) -> None:
    result = run_workers(launcher, nprocs, WORKER, args=["--case", "late_rank"],
                         env={"DP_PLUGIN_ENGINE": engine, "DP_PLUGIN_TIMEOUT": "60",
                              "DP_PLUGIN_STALL_WARNING_SECONDS": str(WARN_S),
                              "STALL_SLEEP_S": str(SLEEP_S)},
                         timeout=120)
    assert_ranks_ok(result, nprocs)
    late = nprocs - 1
    for rank in range(late):
        warnings = re.findall(rf"rank {rank}: .*late.* has waited (\d+) s for the other ranks; "
                              rf"ranks not there yet: \[{late}\]", result.output)
        assert len(warnings) >= 2, result.output  # periodic: about one a second
        assert "raises after 60 s (DP_PLUGIN_TIMEOUT)" in result.output, result.output
    assert f"rank {late}: " not in result.output.replace(f"rank {late} OK", ""), result.output


@pytest.mark.multiproc
def test_no_warning_when_set_to_zero() -> None:
    result = run_workers("env", 2, WORKER, args=["--case", "late_rank"],
                         env={"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_STALL_WARNING_SECONDS": "0",
                              "STALL_SLEEP_S": "2"}, timeout=120)
    assert_ranks_ok(result, 2)
    assert "has waited" not in result.output, result.output
