"""Worker: a rank that never arrives at a wait the library gives no timeout.

Rank 0 must get ``CollectiveTimeoutError`` naming the wait within
DP_PLUGIN_TIMEOUT (plus a margin the pytest side checks from the printed
time); the stalled last rank sleeps past that and then leaves with exit 0:
until rank 0 has reported (it creates the file ``STALL_RELEASE`` names,
when set) or DP_PLUGIN_TIMEOUT + 15 s, whichever comes first; under
mpirun rank 0 leaves after it (``STALL_RELEASE.left``).
Cases:
- ``mpi_split``: the last rank passes subgroup's agreement, then stalls
  before ``MPI_Comm_split`` (mpirun, engine mpi).
- ``hvd_add_process_set``: the last rank stalls inside ``hvd.add_process_set``
  (horovodrun, engine horovod).
- ``gloo_new_group``: the last rank stalls before a channel's
  ``dist.new_group`` (env launcher, engine gloo): Gloo's connection of the
  new group waits in the store (torch raised its raw ``DistStoreError``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from _fail_fast import run_cases

from dp_plugin.agree import checked
from dp_plugin.errors import CollectiveTimeoutError
from dp_plugin.launch import runtime

RELEASE = os.environ.get("STALL_RELEASE")
"""A file rank 0 creates once it has reported: the stall may end then."""


def _stall() -> None:
    deadline = time.monotonic() + runtime.engine().config.timeout_s + 15
    while time.monotonic() < deadline and not (RELEASE and os.path.exists(RELEASE)):
        time.sleep(0.1)
    print(f"rank {runtime.engine().rank} OK (stalled)", flush=True)
    if RELEASE:
        open(f"{RELEASE}.left", "w").close()
    os._exit(0)


def _expect_timeout(fn: Any, needle: str, after_stalled: bool = False) -> None:
    start = time.monotonic()
    try:
        fn()
    except CollectiveTimeoutError as exc:
        elapsed = time.monotonic() - start
        if needle not in str(exc):
            raise AssertionError(f"the error does not name {needle!r}: {exc}") from exc
        print(f"rank 0 timed out after {elapsed:.1f} s: {exc}", flush=True)
        print("rank 0 OK", flush=True)
        if RELEASE:
            open(RELEASE, "w").close()
        if RELEASE and after_stalled:
            # Leave after the stalled rank: mpiexec kills the ranks still running
            # once one exits without MPI_Finalize (exit code 9, seen under load).
            # Not under horovodrun: there Horovod's loop aborts when a peer leaves.
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not os.path.exists(f"{RELEASE}.left"):
                time.sleep(0.05)
        os._exit(0)  # the stalled rank is still inside the library: no clean teardown
    raise AssertionError("no CollectiveTimeoutError")


def case_mpi_split(engine: Any) -> None:
    if engine.rank == engine.size - 1:
        type(engine)._subgroup = lambda *args: _stall()  # passes the agreement, not Split
    _expect_timeout(lambda: checked.subgroup(engine, [0, engine.size - 1], "pair"),
                    "mpi Comm.Split ('pair')", after_stalled=True)


def case_hvd_add_process_set(engine: Any) -> None:
    if engine.rank == engine.size - 1:
        engine._hvd.add_process_set = lambda ranks: _stall()
    # [0]: not every rank (that is Horovod's global set), yet collective over all.
    _expect_timeout(lambda: checked.subgroup(engine, [0], "first"), "hvd.add_process_set([0])")


def case_gloo_new_group(engine: Any) -> None:
    if engine.rank == engine.size - 1:
        _stall()
    _expect_timeout(lambda: engine.channel("late"), "torch.distributed.new_group")


CASES = {"mpi_split": case_mpi_split, "hvd_add_process_set": case_hvd_add_process_set,
         "gloo_new_group": case_gloo_new_group}


if __name__ == "__main__":
    run_cases(CASES, setup=lambda _: runtime.init(process_sets=True))
