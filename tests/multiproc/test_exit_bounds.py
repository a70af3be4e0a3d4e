"""A teardown that waits for every rank ends within DP_PLUGIN_TIMEOUT
(workers/exit_bounds.py): MPI_Finalize at exit. Ranks that tear down at
different speeds end the job with status 0.

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
    assert result.returncodes[0] != 0, out
    if "rank 1 leaves" in out:
        # Rank 0 left while Hydra's proxy was in the PMI barrier of its
        # MPI_Finalize: the proxy failed on the closed socket and mpiexec
        # never killed rank 1 (MPICH's race, seen once in a suite run), so
        # the job's end says nothing of rank 0's; its message and status do.
        assert "unable to send PMI message" in out or "error sending barrier_out" in out, out
        return
    assert ended - _late(out) < TIMEOUT_S + MARGIN_S, out



def test_a_slow_teardown_on_one_rank_of_three_ends_cleanly() -> None:
    """Rank 2's exit hook (registered before ``hvd.init()``) sleeps 3 s and
    asks MPI its rank, while ranks 0 and 1 leave at once. MPI_Finalize came
    before that hook, and the job ended with ``Attempting to use an MPI
    routine ... after finalizing MPICH``, exit 1; now it runs after every
    hook registered since ``import dp_plugin``. Hydra does not cut a rank's
    slow teardown short once every rank has finalized (MPICH 4.x / Hydra
    5.0.2: 3 and 12 s on rank 0 or 2)."""
    result = run_workers("mpirun", 3, WORKER, args=["--case", "slow_teardown"],
                         env={"DP_PLUGIN_ENGINE": "mpi", "DP_PLUGIN_TIMEOUT": "60"},
                         timeout=150)
    assert "rank 2 teardown done" in result.output, result.output
    assert "BAD TERMINATION" not in result.output, result.output
