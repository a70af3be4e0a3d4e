"""CPU cost of the shared-memory transport's per-operation header check
(dp_plugin/engines/shm.py): pack this rank's header, which rides on the
operation's first barrier instead of its one byte, and compare it with a
peer's, as each operation does once per peer (the system calls are the
barrier's own and are not counted). CPU time (``time.process_time``), so a
loaded machine inflates it less than wall time; compare it with an
all-reduce's time at the same size. ``dp-plugin bench --shm-check`` times
the whole all-reduce with and without the check, interleaved.

    PYTHONPATH=. python benchmarks/shm_check_cost.py
"""

from __future__ import annotations

import statistics
import time

import torch

from dp_plugin.engines import shm
from dp_plugin.engines.base import ReduceOp
from tests.unit.test_shm import connected

N = 20000


def main() -> None:
    with connected(2) as ts:
        t = ts[0]
        data = torch.ones(1 << 18)
        job = shm._Job(data, ReduceOp.SUM, None, 1.0, None)  # type: ignore[arg-type]
        theirs = t._header("allreduce", job, data)  # what the peer sends: the usual, equal case
        runs = []
        for _ in range(5):
            c0 = time.process_time()
            for _ in range(N):
                if t._header("allreduce", job, data) != theirs:
                    raise SystemExit("headers differ")
            runs.append((time.process_time() - c0) / N)
        print(f"header pack + compare per operation, 2 ranks: median "
              f"{statistics.median(runs) * 1e6:.2f} us CPU, min {min(runs) * 1e6:.2f} us "
              f"(5 x {N})")


if __name__ == "__main__":
    main()
