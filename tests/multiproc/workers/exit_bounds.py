"""Worker: a rank that stops before the end, and the teardowns that wait for it.

- ``mpi_finalize`` (mpirun, mpi engine): both ranks run a collective and
  ``hvd.shutdown()``; rank 1 then sleeps ``LATE_S`` before exiting. Rank 0's
  ``MPI_Finalize`` at exit waits for rank 1 (mpi4py calls it holding the
  GIL, with no timeout): it must end within DP_PLUGIN_TIMEOUT instead,
  saying so (``exit_bounds.finalize_mpi_at_exit``).

Rank 0 prints ``rank 0 leaves at <unix time>`` when its program ends; rank
1 ``rank 1 late from <unix time>``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from _fail_fast import run_cases

import dp_plugin.torch as hvd

LATE_S = 40.0
"""Longer than DP_PLUGIN_TIMEOUT (12 s in the test) and its margin."""


def case_mpi_finalize(_: Any) -> None:
    hvd.init()
    hvd.allreduce(torch.ones(1), name="last")
    rank = hvd.rank()
    hvd.shutdown()
    if rank == 1:
        print(f"rank 1 late from {time.time():.3f}", flush=True)
        time.sleep(LATE_S)
    print(f"rank {rank} leaves at {time.time():.3f}", flush=True)


CASES = {"mpi_finalize": case_mpi_finalize}

if __name__ == "__main__":
    run_cases(CASES)
