"""Worker: the program makes torch.distributed's group itself, then uses dp_plugin.

    python adopt.py RANK WORLD tcp://HOST:PORT [bert_pretrain.py flags...]

No launcher variables: ``hvd.init()`` must adopt the group (rank, size,
local topology from it) and leave it initialized at ``shutdown()``. Then the
BERT example runs inside the same group (its own init/shutdown), and the
group is still the program's to destroy.
"""

from __future__ import annotations

import runpy
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import dp_plugin.torch as hvd
from dp_plugin.launch import runtime

rank, world, method, *bert_args = sys.argv[1:]
dist.init_process_group("gloo", init_method=method, rank=int(rank), world_size=int(world),
                        timeout=timedelta(seconds=60))
hvd.init()
topo = runtime.topology()
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="ranks").item()
print(f"rank {hvd.rank()} of {hvd.size()} local {hvd.local_rank()}/{hvd.local_size()} "
      f"cross {hvd.cross_rank()}/{hvd.cross_size()} launcher {topo.launcher} sum {total:g}",
      flush=True)
hvd.shutdown()
print(f"rank {rank} group kept after shutdown: {dist.is_initialized()}", flush=True)
if bert_args:
    example = Path(__file__).resolve().parents[3] / "examples" / "bert_pretrain.py"
    sys.argv = [str(example), *bert_args]
    runpy.run_path(str(example), run_name="__main__")
    print(f"rank {rank} group kept after the example: {dist.is_initialized()}", flush=True)
dist.destroy_process_group()
