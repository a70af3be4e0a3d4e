"""What one multi-process test launch costs, fresh and forked warm: a table.

A 2-rank job through the test harness (tests/multiproc/harness.py): import
torch and dp_plugin, ``hvd.init()``, one ``DistributedOptimizer`` step with
its all-reduce, ``hvd.shutdown()``, exit. Each launcher fresh (a new
interpreter per rank, as every launch once was) and, where the
harness forks ranks from its warm server (env, horovodrun), warm; the TF
row imports TensorFlow too. Median and min of ``--rounds`` launches, after
one launch that starts the warm servers (not counted).

    python benchmarks/launch_cost.py [--rounds 5]   # from the repository root
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.multiproc.harness import assert_ranks_ok, run_workers

WORKER = '''
import os
{extra}
import torch
import dp_plugin.torch as hvd

hvd.init()
model = torch.nn.Linear(16, 4)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
model(torch.randn(8, 16)).square().mean().backward()
opt.step()
print(f"rank {{hvd.rank()}} OK", flush=True)
hvd.shutdown()
'''

ROWS = [  # (label, launcher, engine, flavour, modes)
    ("env, gloo", "env", "gloo", "torch", ("fresh", "warm")),
    ("horovodrun, horovod", "horovodrun", "horovod", "torch", ("fresh", "warm")),
    ("env, gloo, TensorFlow imported", "env", "gloo", "tensorflow", ("fresh", "warm")),
    ("mpirun, mpi", "mpirun", "mpi", "torch", ("fresh",)),
    ("torchrun, gloo", "torchrun", "gloo", "torch", ("fresh",)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scripts = {}
        for flavour, extra in (("torch", ""), ("tensorflow", "import tensorflow")):
            scripts[flavour] = Path(tmp) / f"launch_{flavour}.py"
            scripts[flavour].write_text(WORKER.format(extra=extra))
        print("| launch (2 ranks) | fresh, median (min) | warm, median (min) |")
        print("|---|---|---|")
        for label, launcher, engine, flavour, modes in ROWS:
            cells = {}
            for mode in modes:
                fresh = mode == "fresh"
                if not fresh:  # start the warm server outside the timed launches
                    _launch(launcher, engine, scripts[flavour], fresh)
                times = [_launch(launcher, engine, scripts[flavour], fresh)
                         for _ in range(args.rounds)]
                cells[mode] = f"{statistics.median(times):.2f} s ({min(times):.2f} s)"
            print(f"| {label} | {cells['fresh']} | {cells.get('warm', '-')} |", flush=True)


def _launch(launcher: str, engine: str, script: Path, fresh: bool) -> float:
    start = time.perf_counter()
    result = run_workers(launcher, 2, script, env={"DP_PLUGIN_ENGINE": engine},
                         timeout=180, fresh=fresh)
    took = time.perf_counter() - start
    assert_ranks_ok(result, 2)
    return took


if __name__ == "__main__":
    main()
