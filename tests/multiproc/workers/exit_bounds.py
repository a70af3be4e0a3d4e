"""Worker: a rank that stops before the end, and the teardowns that wait for it.

- ``mpi_finalize`` (mpirun, mpi engine): both ranks run a collective and
  ``hvd.shutdown()``; rank 1 then sleeps ``LATE_S`` before exiting. Rank 0's
  ``MPI_Finalize`` at exit waits for rank 1 (mpi4py calls it holding the
  GIL, with no timeout): it must end within DP_PLUGIN_TIMEOUT instead,
  saying so (``exit_bounds.finalize_mpi_at_exit``).
- ``horovod_shutdown`` (horovodrun, horovod engine): rank 1 freezes
  (SIGSTOP; a child process SIGKILLs it ``LATE_S`` later) after a
  collective; rank 0's ``hvd.shutdown()`` agrees the shutdown with every
  rank and must raise ``CollectiveTimeoutError`` within DP_PLUGIN_TIMEOUT,
  and the process must then exit (Horovod's own exit hook would wait again).

Rank 0 prints ``rank 0 leaves at <unix time>`` when its program ends and
``rank 0 error at <unix time>: ...`` for an error; rank 1 ``rank 1 late
from <unix time>``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

import torch
from _fail_fast import run_cases

import dp_plugin.torch as hvd

LATE_S = 25.0


def case_mpi_finalize(_: Any) -> None:
    hvd.init()
    hvd.allreduce(torch.ones(1), name="last")
    rank = hvd.rank()
    hvd.shutdown()
    if rank == 1:
        print(f"rank 1 late from {time.time():.3f}", flush=True)
        time.sleep(LATE_S)
    print(f"rank {rank} leaves at {time.time():.3f}", flush=True)


def case_horovod_shutdown(_: Any) -> None:
    hvd.init()
    hvd.allreduce(torch.ones(1), name="last")
    rank = hvd.rank()
    if rank == 1:
        subprocess.Popen(["sh", "-c", f"sleep {LATE_S}; kill -KILL {os.getpid()}"])
        print(f"rank 1 late from {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        hvd.shutdown()
    except Exception as exc:
        print(f"rank {rank} error at {time.time():.3f}: {type(exc).__name__}: {exc}", flush=True)
        raise
    print(f"rank {rank} leaves at {time.time():.3f}", flush=True)


CASES = {"mpi_finalize": case_mpi_finalize, "horovod_shutdown": case_horovod_shutdown}

if __name__ == "__main__":
    run_cases(CASES)
