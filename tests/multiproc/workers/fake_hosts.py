"""Run a worker script as if its ranks were spread over several hosts.

    DP_TEST_RANKS_PER_HOST=2 python fake_hosts.py WORKER.py --case NAME

Before anything reads them, rewrites the variables torchrun sets per host
(``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``)
from ``RANK`` and ``WORLD_SIZE``: rank r is local rank r % P of host r // P,
as torchrun with ``--nproc-per-node P`` on WORLD_SIZE / P nodes would say.
Everything after that is the real code path: ``dp_plugin.launch.launchers.detect``
builds the topology from these variables and the engine decides from it.
The "hosts" share one kernel, so the cross-host step runs over loopback
TCP (Gloo's), not a real link: this tests correctness, not speed.
"""

from __future__ import annotations

import os
import runpy
import sys

per_host = int(os.environ["DP_TEST_RANKS_PER_HOST"])
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if size % per_host:
    raise SystemExit(f"WORLD_SIZE={size} is not a multiple of {per_host} ranks per host")
os.environ.update(LOCAL_RANK=str(rank % per_host), LOCAL_WORLD_SIZE=str(per_host),
                  GROUP_RANK=str(rank // per_host), GROUP_WORLD_SIZE=str(size // per_host))
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
