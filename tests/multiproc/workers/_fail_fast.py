"""How a multi-process test worker ends when something fails."""

from __future__ import annotations

import os
import sys
import traceback


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
