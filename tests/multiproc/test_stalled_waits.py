"""Waits a library gives no timeout (MPI_Comm_split, hvd.add_process_set, ...)
end with a clear error within DP_PLUGIN_TIMEOUT plus a margin when a rank
never arrives (workers/stalled_waits.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers

WORKER = Path(__file__).parent / "workers" / "stalled_waits.py"
TIMEOUT_S = 4.0
MARGIN_S = 20.0


@pytest.mark.parametrize(("case", "launcher", "engine"), [
    ("mpi_split", "mpirun", "mpi"),
    ("hvd_add_process_set", "horovodrun", "horovod"),
    ("gloo_new_group", "env", "gloo"),
])
def test_a_rank_that_never_arrives_is_reported_within_the_timeout(
        case: str, launcher: str, engine: str, tmp_path: Path) -> None:
    # The stalled rank leaves once rank 0 has reported (STALL_RELEASE), not
    # after sleeping out its 19 s: the launcher waits for it.
    result = run_workers(launcher, 2, WORKER, args=["--case", case],
                         env={"DP_PLUGIN_ENGINE": engine, "DP_PLUGIN_TIMEOUT": str(TIMEOUT_S),
                              "STALL_RELEASE": str(tmp_path / "reported")},
                         timeout=120)
    assert_ranks_ok(result, 1)  # rank 0; the launcher may end the stalled rank first
    found = re.search(r"rank 0 timed out after ([0-9.]+) s: rank 0: (.*)", result.output)
    assert found, result.output
    assert TIMEOUT_S <= float(found.group(1)) < TIMEOUT_S + MARGIN_S, found.group(0)
    assert "did not finish within 4 s (DP_PLUGIN_TIMEOUT)" in found.group(2), found.group(0)
