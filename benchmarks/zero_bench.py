"""Sharded optimizer state (ZeRO stage 1) against the unsharded optimizer and
torch's ``ZeroRedundancyOptimizer`` + DDP: state bytes, peak memory, step time.

Every configuration trains the same MLP (``--layers`` layers of ``--width``,
8 x 1024 by default: 8.4 M parameters, 33.6 MB of float32) with Adam on
gloo workers of one host, at 2 and 3 ranks:

- ``dp_plugin``: ``hvd.DistributedOptimizer(Adam)``, the unsharded anchor;
- ``dp_plugin sharded``: the same with ``shard_optimizer_state=True``;
- ``torch ZeRO + DDP``: ``DistributedDataParallel`` (gloo) with
  ``torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=Adam)``.

Per rank: the bytes of the optimizer's state tensors after the last step
(``optimizer.state``; for torch's, its local optimizer's), the peak resident
memory (``ru_maxrss``) and the median wall time of a step (forward,
backward, step) over ``--steps`` timed steps after ``--warmup``. The
configurations run interleaved, ``--rounds`` times each (round 1: all three,
then round 2...), and the table shows per configuration the median over the
rounds of rank 0's median step time, and each round's numbers for the
largest rank's memory. Run on a quiet machine::

    python benchmarks/zero_bench.py                    # 2 and 3 ranks, 3 rounds
    python benchmarks/zero_bench.py --ranks 2 --rounds 1 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from typing import Any

from dp_plugin.cli.jobs import clean_env, run_jobs, torchrun_jobs

CONFIGS = ("dp_plugin", "dp_plugin sharded", "torch ZeRO + DDP")
BATCH = 32


def state_bytes(optimizer: Any) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if hasattr(v, "element_size"))


def build(config: str, layers: int, width: int) -> tuple[Any, Any, Any, Any]:
    """(model to run, optimizer to step, optimizer holding the state, gather)."""
    import torch

    torch.manual_seed(0)
    parts: list[Any] = []
    for _ in range(layers):
        parts += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*parts)
    if config == "torch ZeRO + DDP":
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer

        dist.init_process_group("gloo")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                      lr=1e-4)

        def gather(obj: Any) -> list[Any]:
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
            return out

        return ddp, opt, opt.optim, gather
    import dp_plugin.torch as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                   named_parameters=model.named_parameters(),
                                   shard_optimizer_state=config == "dp_plugin sharded")
    return model, opt, opt, lambda obj: hvd.allgather_object(obj, name="zero_bench")


def worker(config: str, layers: int, width: int, warmup: int, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    model, opt, holder, gather = build(config, layers, width)
    rank = int(os.environ["RANK"])
    gen = torch.Generator().manual_seed(rank)
    times = []
    for step in range(warmup + steps):
        x = torch.randn(BATCH, width, generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    mine = {"state": state_bytes(holder), "rss": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024, "step": statistics.median(times)}
    everyone = gather(mine)
    if rank == 0:
        print("RESULT " + json.dumps({"ranks": everyone}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--ranks", default="2,3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.layers, args.width, args.warmup, args.steps)
        return
    results: dict[tuple[int, str], list[list[dict[str, float]]]] = {}
    for n in (int(r) for r in args.ranks.split(",")):
        for round_ in range(args.rounds):
            for config in CONFIGS:  # interleaved: each round runs all three
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", config,
                       "--layers", str(args.layers), "--width", str(args.width),
                       "--warmup", str(args.warmup), "--steps", str(args.steps)]
                env = clean_env(DP_PLUGIN_ENGINE="gloo")
                r = run_jobs(f"{config} x{n}", torchrun_jobs(cmd, n, env), args.timeout)
                results.setdefault((n, config), []).append(r["ranks"])
                print(f"{n} ranks, round {round_ + 1}, {config}: done", file=sys.stderr,
                      flush=True)
    report(results, args)


def report(results: dict[tuple[int, str], list[Any]], args: argparse.Namespace) -> None:
    mib = 1 << 20
    params = args.layers * (args.width * args.width + args.width)
    print(f"\nMLP {args.layers} x {args.width} ({params / 1e6:.1f} M float32 parameters), "
          f"Adam, batch {BATCH} per rank, gloo on one host; median of {args.rounds} "
          f"interleaved rounds of {args.steps} timed steps\n")
    print("| ranks | configuration | optimizer state per rank (max) | vs unsharded / N "
          "| peak RSS per rank (max) | step time (rank 0) | vs dp_plugin |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n in sorted({n for n, _ in results}):
        base = results[(n, "dp_plugin")]
        base_state = max(r["state"] for r in base[0])
        base_step = statistics.median(rounds[0]["step"] for rounds in base)
        for config in CONFIGS:
            rounds = results[(n, config)]
            state = max(r["state"] for r in rounds[0])
            rss = statistics.median(max(r["rss"] for r in ranks) for ranks in rounds)
            step = statistics.median(ranks[0]["step"] for ranks in rounds)
            print(f"| {n} | {config} | {state / mib:.1f} MiB | {state / (base_state / n):.3f} "
                  f"| {rss / mib:.0f} MiB | {step * 1e3:.1f} ms | {step / base_step:.2f}x |")


if __name__ == "__main__":
    main()
