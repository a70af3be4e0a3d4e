"""Worker: a rank that stops before the end, and the teardowns that wait for it.

- ``mpi_finalize`` (mpirun, mpi engine): both ranks run a collective and
  ``hvd.shutdown()``; rank 1 then sleeps ``LATE_S`` before exiting. Rank 0's
  ``MPI_Finalize`` at exit waits for rank 1 (mpi4py calls it holding the
  GIL, with no timeout): it must end within DP_PLUGIN_TIMEOUT instead,
  saying so (``exit_bounds.finalize_mpi_at_exit``).

Rank 0 prints ``rank 0 leaves at <unix time>`` when its program ends; rank
1 ``rank 1 late from <unix time>``.

- ``slow_teardown`` (mpirun x3, mpi engine): rank 2's teardown is slow (an
  ``atexit`` hook that sleeps ``SLOW_TEARDOWN_S``, then asks MPI its rank)
  while ranks 0 and 1 exit at once. Prints ``rank 2 teardown done``.
"""

from __future__ import annotations

import atexit
import os
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


SLOW_TEARDOWN_S = 3.0
"""How long rank 2's teardown takes after its program ends."""


def case_slow_teardown(_: Any) -> None:
    rank = int(os.environ["PMI_RANK"])
    if rank == 2:
        # Registered after ``import dp_plugin`` but before ``hvd.init()``, as
        # a library's flush often is: it must run while MPI is still up.

        def slow_teardown() -> None:
            from mpi4py import MPI  # imported by the engine already

            time.sleep(SLOW_TEARDOWN_S)
            MPI.COMM_WORLD.Get_rank()  # a log handler asking its rank at exit
            print(f"rank {rank} teardown done", flush=True)

        atexit.register(slow_teardown)
    hvd.init()
    hvd.allreduce(torch.ones(1), name="last")
    print(f"rank {hvd.rank()} leaves", flush=True)


CASES = {"mpi_finalize": case_mpi_finalize, "slow_teardown": case_slow_teardown}

if __name__ == "__main__":
    run_cases(CASES)
