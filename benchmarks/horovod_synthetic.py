"""Horovod's synthetic benchmark under horovodrun: images per second, side by side.

The loop of Horovod's ``examples/pytorch/pytorch_synthetic_benchmark.py``
(written again here; torchvision is not usable in this environment, so
ResNet-18 is built in this file): random 224x224 images and labels made
once, SGD (lr 0.01 x size), ``hvd.DistributedOptimizer`` with
``named_parameters``, ``broadcast_parameters`` and
``broadcast_optimizer_state`` from rank 0, warm-up batches, then
``--iters`` timings of ``--batches-per-iter`` batches each; a worker's
img/s is ``batch x batches / time`` and the job's is that times the size
(Horovod's "Total img/sec"). Nothing is downloaded.

Configurations (``horovodrun --gloo -np N -H localhost:N``; the script is
the same, only the ``hvd`` module and the environment differ):
  horovod          ``import horovod.torch as hvd``: real Horovod 0.28.1;
  dp_plugin        ``import dp_plugin.torch as hvd``, default settings
                   (``auto``: the gloo engine, shared memory on one host);
  dp_plugin:ring   the same with ``DP_PLUGIN_ENGINE=horovod`` (Horovod's ring);
  torchrun         ``dp_plugin.torch`` under a torchrun-style launch (gloo).

    python benchmarks/horovod_synthetic.py                        # all, 2 rounds
    python benchmarks/horovod_synthetic.py --configs horovod,dp_plugin --rounds 3

Without a launcher it starts the configurations interleaved (A B C ... A B
C ...) and prints a table: the median over rounds of the job's img/s, the
best and worst round, and the ratio to real Horovod (median over rounds of
the ratio within a round, so that load changes on a shared machine mostly
cancel). Compare rows of one invocation only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
import timeit
from typing import Any

from dp_plugin.cli.jobs import clean_env, horovodrun_job, run_jobs, torchrun_jobs

CONFIGS = {
    # name -> (hvd module, extra environment, launcher)
    "horovod": ("horovod.torch", {}, "horovodrun"),
    "dp_plugin": ("dp_plugin.torch", {}, "horovodrun"),
    "dp_plugin:ring": ("dp_plugin.torch", {"DP_PLUGIN_ENGINE": "horovod"}, "horovodrun"),
    "torchrun": ("dp_plugin.torch", {}, "torchrun"),
}


def resnet18(classes: int = 1000) -> Any:
    """ResNet-18 (He et al. 2016): 4 stages of 2 basic blocks, 11.7 M parameters."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
                nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: Any) -> Any:
            return self.relu(self.body(x) + self.skip(x))

    stages, cin = [], 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        stages += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    return nn.Sequential(
        nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1), *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(512, classes))


def worker(module: str, batch: int, warmup: int, batches_per_iter: int, iters: int) -> None:
    import torch
    import torch.nn.functional as F

    hvd: Any = importlib.import_module(module)
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = resnet18()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    data = torch.randn(batch, 3, 224, 224)
    target = torch.randint(0, 1000, (batch,))

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    timeit.timeit(step, number=warmup)
    rates = [batch * batches_per_iter / timeit.timeit(step, number=batches_per_iter)
             for _ in range(iters)]
    engine = "horovod.torch"
    if module.startswith("dp_plugin"):
        from dp_plugin.launch import runtime

        engine = runtime.engine().name
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({"rates": rates, "size": hvd.size(), "engine": engine}),
              flush=True)


def launch(config: str, args: argparse.Namespace) -> dict[str, Any]:
    module, extra, launcher = CONFIGS[config]
    me = [sys.executable, __file__, "--worker", module, "--batch-size", str(args.batch_size),
          "--warmup", str(args.warmup), "--batches-per-iter", str(args.batches_per_iter),
          "--iters", str(args.iters)]
    env = clean_env(**extra)
    jobs = ([horovodrun_job(me, args.nprocs, env)] if launcher == "horovodrun"
            else torchrun_jobs(me, args.nprocs, env))
    return run_jobs(config, jobs, args.timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("-np", "--nprocs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2, help="warm-up batches")
    ap.add_argument("--batches-per-iter", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3, help="timed iterations")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--worker", metavar="MODULE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.batch_size, args.warmup, args.batches_per_iter, args.iters)
        return
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; valid: {', '.join(CONFIGS)}")
    totals: dict[str, list[float]] = {c: [] for c in configs}
    engines: dict[str, str] = {}
    began = time.monotonic()
    for rnd in range(args.rounds):
        for config in configs:
            result = launch(config, args)
            total = statistics.mean(result["rates"]) * result["size"]
            totals[config].append(total)
            engines[config] = result["engine"]
            print(f"round {rnd + 1}/{args.rounds} {config:<15} {total:6.2f} img/s "
                  f"({result['engine']})", file=sys.stderr, flush=True)
    print(f"\nResNet-18, batch {args.batch_size} per worker, {args.nprocs} workers x 1 thread; "
          f"{args.rounds} interleaved rounds of {args.warmup} warm-up + {args.iters} x "
          f"{args.batches_per_iter} timed batches; total {time.monotonic() - began:.0f} s\n")
    print(f"{'config':<15} {'engine':<14} {'img/s':>6} {'best':>6} {'worst':>6} "
          f"{'vs horovod':>10}")
    for config, rounds in totals.items():
        ratio = "-"
        if "horovod" in totals:
            pairs = zip(rounds, totals["horovod"], strict=True)
            ratio = f"{statistics.median(a / b for a, b in pairs):.2f}x"
        print(f"{config:<15} {engines[config]:<14} {statistics.median(rounds):>6.2f} "
              f"{max(rounds):>6.2f} {min(rounds):>6.2f} {ratio:>10}")
    print("\nimg/s: the job's (per-worker mean x workers), median over rounds; vs horovod: "
          "median over rounds of the ratio within the round (> 1 is faster)")


if __name__ == "__main__":
    main()
