"""A teardown that waits for every rank ends within DP_PLUGIN_TIMEOUT
(workers/exit_bounds.py): MPI_Finalize at exit.

(hvd.shutdown() is bounded too, but no case was found here where it waits:
with the other rank SIGSTOPped it returned at once.)"""

from __future__ import annotations

import re
import time
from pathlib import Path

from tests.multiproc.harness import run_workers

WORKER = Path(__file__).parent / "workers" / "exit_bounds.py"
TIMEOUT_S = 12.0
"""Long enough for hvd.init() / MPI's start on a loaded machine; the wait
bounded here begins after both ranks have run a collective."""
MARGIN_S = 6.0


def _late(output: str) -> float:
    found = re.search(r"rank 1 late from ([0-9.]+)", output)
    assert found is not None, output
    return float(found.group(1))


def test_mpi_finalize_at_exit_is_bounded() -> None:
    result = run_workers("mpirun", 2, WORKER, args=["--case", "mpi_finalize"],
                         env={"DP_PLUGIN_ENGINE": "mpi", "DP_PLUGIN_TIMEOUT": str(TIMEOUT_S)},
                         timeout=120, check=False)
    ended = time.time()
    out = result.output
    assert "rank 0: MPI_Finalize at exit did not finish within 12 s (DP_PLUGIN_TIMEOUT)" in out, out
    assert result.returncodes[0] != 0 and "rank 1 leaves" not in out, out
    assert ended - _late(out) < TIMEOUT_S + MARGIN_S, out

