"""Worker: the last rank sleeps past DP_PLUGIN_STALL_WARNING_SECONDS before
an all-reduce; the others wait in it and must log the stall warning
(naming the all-reduce and the late rank) on their way, then all finish
with the right sum (the warning never ends the wait).
``STALL_SLEEP_S``: how long the last rank sleeps.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from _fail_fast import run_cases

from dp_plugin.launch import runtime


def case_late_rank(engine: Any) -> None:
    if engine.rank == engine.size - 1:
        time.sleep(float(os.environ["STALL_SLEEP_S"]))
    buf = np.full(4, engine.rank + 1.0, dtype=np.float32)
    engine.allreduce_async(buf, "sum", "late").wait()
    expected = engine.size * (engine.size + 1) / 2
    if not np.all(buf == expected):
        raise AssertionError(f"rank {engine.rank}: sum {buf} != {expected}")
    print(f"rank {engine.rank} OK", flush=True)


CASES = {"late_rank": case_late_rank}


if __name__ == "__main__":
    run_cases(CASES, setup=lambda _: runtime.init())
