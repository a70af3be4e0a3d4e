"""Driver of the Ray Train v2 tests: dp_plugin's backend beside TorchTrainer.

    RAY_ADDRESS=HOST:PORT python ray_train_v2.py OUTDIR [KIND...]

(The tests run it as the ``train_v2`` part of ray_driver.py, in that
driver's Ray session.)

Joins the cluster of RAY_ADDRESS (two nodes of 1 CPU each). KINDs pick
which of the runs below to do (default: all).

One training loop, run three times in one Ray session, each a ``fit()`` of
2 workers:

1. ``HorovodTrainer`` (dp_plugin's backend): ``DistributedOptimizer``, one
   worker of 1 CPU on each node;
2. ``TorchTrainer`` (DDP), the same model, data, steps and placement;
3. ``HorovodTrainer`` again, both workers on one node (0.5 CPU each, Ray's
   default PACK placement), with ``FailureConfig(max_failures=1)``, where
   rank 1 SIGKILLs its own process after step ``KILL_AFTER`` of the first
   attempt: Ray restarts the worker group and the loop resumes from the last
   checkpoint it reported (``ray.train.get_checkpoint()``).

Each prints ``weights <kind> <rank> <hex>`` (the float32 bytes of every
parameter at the end), ``ranks <kind> ...`` (each worker's dp_plugin rank,
local rank and Ray's world rank) and ``attempts <kind> N``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray
import torch
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn

from dp_plugin.ray.train import BackendConfig, HorovodTrainer

STEPS = 8
REPORT_EVERY = 2
KILL_AFTER = 4


def loop(config: dict[str, Any]) -> None:
    import ray.train

    kind, out = config["kind"], Path(config["out"])
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if kind == "ddp":
        import ray.train.torch

        model = ray.train.torch.prepare_model(model)
        opt = base
    else:
        import dp_plugin.torch as hvd

        hvd.init()  # already done by the backend: returns at once, as in a Horovod script
        (out / f"ranks-{kind}-{rank}.json").write_text(json.dumps(
            [hvd.rank(), hvd.local_rank(), hvd.size(), rank]))
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            saved = torch.load(Path(d) / "state.pt", weights_only=True)
        target = model.module if kind == "ddp" else model
        target.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"] + 1
    attempts = out / f"attempts-{kind}"
    with attempts.open("a") as f:
        f.write(f"{rank}:{start}\n")
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if (kind == "killed" and rank == 1 and step == KILL_AFTER
                and not (out / "killed-once").exists()):
            (out / "killed-once").write_text("")
            os.kill(os.getpid(), signal.SIGKILL)
        if step % REPORT_EVERY == REPORT_EVERY - 1:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    target = model.module if kind == "ddp" else model
                    torch.save({"model": target.state_dict(), "opt": opt.state_dict(),
                                "step": step}, Path(d) / "state.pt")
                ray.train.report({"step": step},
                                 checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)
    raw = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    (out / f"weights-{kind}-{rank}.hex").write_text(raw.hex())


KINDS = ("dp_plugin", "ddp", "killed")


def reference() -> str:
    """The loop's final weights at 2 ranks, in this process without Ray or any
    engine: both ranks' gradients averaged by hand, the plain optimizer stepped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        grads = []
        for rank in (0, 1):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, a, b in zip(model.parameters(), *grads, strict=True):
            p.grad = (a + b) / 2
        opt.step()
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters()).hex()


def main(out: Path, kinds: list[str]) -> None:
    print(f"weights reference - {reference()}", flush=True)
    spread = ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1},
                           placement_strategy="STRICT_SPREAD")  # one worker on each node
    packed = ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.5})
    for kind in kinds:
        scaling = packed if kind == "killed" else spread
        run = RunConfig(storage_path=str(out / "ray_results"), name=kind,
                        failure_config=FailureConfig(max_failures=1 if kind == "killed" else 0))
        config = {"kind": kind, "out": str(out)}
        if kind == "ddp":
            result = TorchTrainer(loop, train_loop_config=config, scaling_config=scaling,
                                  run_config=run).fit()
        else:
            # The survivor of the kill gives up its all-reduce within 20 s, not 30
            # min; the other fit keeps 60 s, as the two-host tests' other jobs:
            # on a loaded machine a worker of the other node can reach the
            # group's formation more than 20 s after the first.
            timeout = "20" if kind == "killed" else "60"
            backend = BackendConfig(env={"DP_PLUGIN_TIMEOUT": timeout})
            result = HorovodTrainer(loop, train_loop_config=config, scaling_config=scaling,
                                    run_config=run, backend_config=backend).fit()
        print(f"error {kind} {result.error!r}", flush=True)
        for rank in (0, 1):
            path = out / f"weights-{kind}-{rank}.hex"
            print(f"weights {kind} {rank} {path.read_text() if path.exists() else 'missing'}",
                  flush=True)
            ranks = out / f"ranks-{kind}-{rank}.json"
            if ranks.exists():
                print(f"ranks {kind} {rank} {ranks.read_text()}", flush=True)
        attempts = (out / f"attempts-{kind}").read_text().split()
        print(f"attempts {kind} {' '.join(attempts)}", flush=True)


if __name__ == "__main__":
    ray.init(logging_level="ERROR")
    kinds = [a for a in sys.argv[2:] if a in KINDS] or list(KINDS)
    main(Path(sys.argv[1]), kinds)
