"""Teardowns at interpreter exit that wait for every rank, bounded.

Two libraries end a process with a wait that has no timeout:

- **MPI_Finalize.** mpi4py calls it from ``Py_AtExit``, after Python has
  stopped, holding the GIL; MPICH's finalize waits until every rank has
  reached its own (a rank that stalls keeps the others there for ever).
  ``finalize_mpi_at_exit`` registers a Python ``atexit`` hook that calls
  ``MPI_Finalize`` itself, through ``ctypes`` (which releases the GIL), on
  the main thread as MPI requires, while a watchdog thread waits
  ``DP_PLUGIN_TIMEOUT``; mpi4py's own hook then finds MPI finalized and
  does nothing. The hook is registered when ``dp_plugin`` is imported,
  not when the engine starts: ``atexit`` runs the last registered first,
  so every hook registered after ``import dp_plugin`` (a library's flush,
  the user's own, also one registered before ``hvd.init()``) runs while
  MPI is still up and may use it. Only hooks registered before
  ``import dp_plugin`` and the interpreter's own teardown run after it.
- **Horovod's shutdown.** ``hvd.shutdown()`` joins Horovod's background
  thread, which first agrees on the shutdown with every rank; Horovod
  registers it with ``atexit`` and its global state's destructor joins the
  thread again. The horovod engine bounds its own call (``deadline.bounded``)
  and replaces Horovod's ``atexit`` hook by ``bound_at_exit``.

On expiry the process says what it waited for on stderr and ends with
``os._exit(1)`` (stdout and stderr flushed): the remaining teardown would
only wait again, and a launcher (mpiexec, horovodrun) then ends the other
ranks. Exit status 1, not the program's: the job did not end together.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Callable

_registered: set[str] = set()
"""What already has an exit hook in this process (one hook per teardown)."""

_finalize_mpi: list[Callable[[], None]] = []
"""The bounded ``MPI_Finalize`` once an engine has armed it (``run_armed_at_exit``)."""


def finalize_mpi_at_exit(rank: int, timeout_s: float) -> None:
    """Finalize MPI at interpreter exit within ``timeout_s`` (once per
    process; later calls do nothing). Does nothing if mpi4py is told not to
    finalize (``mpi4py.rc.finalize = False``): the program owns MPI then."""
    if "mpi" in _registered:
        return
    import mpi4py
    from mpi4py import MPI

    if mpi4py.rc.finalize is False or not MPI.Is_initialized():
        return
    _registered.add("mpi")
    # dlsym on the extension module's handle also searches the libraries it
    # links, libmpi among them: the same MPI_Finalize mpi4py would call.
    finalize = ctypes.CDLL(MPI.__file__).MPI_Finalize
    finalize.restype = ctypes.c_int

    what = f"rank {rank}: MPI_Finalize at exit"
    done = threading.Event()

    def watch() -> None:
        if not done.wait(timeout_s):
            die(f"{what} did not finish within {timeout_s:g} s (DP_PLUGIN_TIMEOUT): it waits "
                "for every rank, and another has not reached the same point (it died, stalls, "
                "or still runs); exiting with status 1 without it. Check the other ranks' logs")

    def at_exit() -> None:
        if MPI.Is_finalized():
            return
        threading.Thread(target=watch, name=f"dp_plugin: {what}", daemon=True).start()
        finalize()  # ctypes releases the GIL: the watchdog can run meanwhile
        done.set()

    _finalize_mpi.append(at_exit)


def run_armed_at_exit() -> None:
    """The exit hook registered at import: the bounded ``MPI_Finalize``, if armed."""
    for finalize in _finalize_mpi:
        finalize()


atexit.register(run_armed_at_exit)  # at import: see the module docstring


def bound_at_exit(key: str, teardown: Callable[[], bool], what: str) -> None:
    """Run ``teardown`` at interpreter exit (once per ``key``); it returns
    False when it did not finish in time, and the process then ends at once
    (``what`` names the wait in the message)."""
    if key in _registered:
        return
    _registered.add(key)

    def at_exit() -> None:
        if not teardown():
            die(f"{what} did not finish in time (DP_PLUGIN_TIMEOUT); exiting without it")

    atexit.register(at_exit)


def die(message: str) -> None:
    """Say ``message`` on stderr and end the process with status 1, now."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream must not stop the exit
            stream.flush()
    try:
        os.write(2, f"dp_plugin: {message}\n".encode(errors="replace"))
    finally:
        os._exit(1)
