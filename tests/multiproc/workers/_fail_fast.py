"""How every multi-process test worker runs its cases and ends.

A worker module defines its cases in one literal dict at module level::

    CASES = {"allreduce": check_allreduce, "errors": check_errors}

    if __name__ == "__main__":
        run_cases(CASES, setup=start_engine, teardown=stop_engine)

and is started by the launcher with ``--case NAME`` (``--list-cases`` prints
the names), or ``--case NAME NAME ...``: several cases one after the other
in one launch, on one engine (one process start instead of several, for
cases that leave nothing behind; each prints ``rank R case NAME passed``).
``run_cases`` is the one place with the ending every test relies on: the
case's exception is printed with the rank (and the case) and the process
exits 1 at once (``fail_fast``) so that the other ranks fail their next
collective instead of waiting for this one; when every case passed it
prints ``rank R OK``.

The pytest side reads the names from the ``CASES`` literal without importing
the worker (``tests.multiproc.harness.worker_cases``), so keep it a literal
dict with string keys.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def fail_fast(rank: object) -> None:
    """Print the current exception for ``rank`` and exit 1 at once.

    ``os._exit``, not ``sys.exit``: after a failure the other ranks may never
    answer, and a normal interpreter exit could block in an engine's teardown
    (a pending collective, MPI_Finalize); the harness must see the exit code
    and this traceback, not a hang. Call it inside ``except BaseException:``.
    """
    print(f"rank {rank} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _launcher_rank() -> object:
    """This process's rank as the launcher gave it ("?" if it cannot be read)."""
    from dp_plugin.launch.launchers import detect

    try:
        return detect().rank
    except Exception:
        return "?"


def run_cases(
    cases: Mapping[str, Callable[[T], object]],
    argv: Sequence[str] | None = None,
    *,
    parser: argparse.ArgumentParser | None = None,
    setup: Callable[[argparse.Namespace], T] | None = None,
    teardown: Callable[[T], object] | None = None,
) -> None:
    """Parse ``--case NAME [NAME ...]`` (plus ``parser``'s own options), run
    those cases in that order, end.

    ``setup(args)`` (default: the parsed ``args`` themselves) gives the value
    each case and ``teardown`` receive, e.g. a started engine. Any exception
    in setup, case or teardown ends the process through ``fail_fast``; on
    success ``rank R OK`` is printed and the function returns.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--list-cases" in argv:  # before parsing: the worker's own options may be required
        print("\n".join(cases), flush=True)
        return
    parser = parser or argparse.ArgumentParser()
    parser.add_argument("--case", required=True, nargs="+", choices=list(cases),
                        help="the cases to run, in this order (see --list-cases)")
    parser.add_argument("--list-cases", action="store_true", help="print the case names")
    args = parser.parse_args(argv)
    names: list[str] = args.case
    args.case = names[0]  # what a one-case worker's setup reads
    rank = _launcher_rank()
    try:
        context: Any = setup(args) if setup is not None else args
        for name in names:
            if len(names) > 1:
                print(f"rank {rank} case {name}", flush=True)
            cases[name](context)
            if len(names) > 1:
                print(f"rank {rank} case {name} passed", flush=True)
        if teardown is not None:
            teardown(context)
    except BaseException:
        fail_fast(rank)
    print(f"rank {rank} OK", flush=True)
