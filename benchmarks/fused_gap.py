"""Where a fused all-reduce of a model's gradient list loses to one raw
all-reduce of the same bytes: a table.

Run under a launcher (2 ranks, the default engine). Timed interleaved (one
repetition of each in turn, each round starting one further):
  raw      one all-reduce of all the bytes (what ``dp-plugin bench`` compares with);
  split    the same buffer all-reduced as slices of the scheduler's bucket
           sizes, launched back to back: what splitting into buckets costs;
  fused    ``GradientScheduler`` with the gradients as views of its buffers
           (``DistributedOptimizer``'s default), op=sum: ``split`` plus marking
           every gradient ready, in reverse, as backward would;
  marks    the ``mark_ready`` loop of ``fused`` alone (its all-reduces run
           on the engine's thread meanwhile and are waited for untimed).

    torchrun --nproc-per-node 2 benchmarks/fused_gap.py [--model resnet50] [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import dp_plugin
from dp_plugin.cli.bench_worker import interleaved_medians, step
from dp_plugin.cli.shapes import model_shapes
from dp_plugin.fusion import TensorSpec
from dp_plugin.scheduler import GradientScheduler


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = dp_plugin.init()
    grads = [torch.full(shape, 1.0) for _, shape in model_shapes(args.model)]
    specs = [TensorSpec.of(f"g{i}", g) for i, g in enumerate(grads)]
    sched = GradientScheduler(specs, engine=engine, op="sum", name="gap")
    step(sched, grads)  # the plan settles from the observed ready order
    views = [sched.view_for(i, g).fill_(1.0) for i, g in enumerate(grads)]
    raw = torch.ones(sum(g.numel() for g in grads))
    parts, offset = [], 0
    for bucket in sched.plan:
        parts.append(raw[offset:offset + bucket.numel])
        offset += bucket.numel

    def split() -> None:
        handles = [engine.allreduce_async(p, "sum", name=f"part{k}") for k, p in enumerate(parts)]
        for h in handles:
            h.wait()

    marks: list[float] = []

    def timed_marks() -> None:
        t0 = time.perf_counter()
        for i in reversed(range(len(views))):
            sched.mark_ready(i, views[i])
        marks.append(time.perf_counter() - t0)
        sched.synchronize()

    fns: dict[str, Any] = {
        "raw": lambda: engine.allreduce_async(raw, "sum", name="raw").wait(),
        "split": split, "fused": lambda: step(sched, views), "marks+wait": timed_marks}
    medians = interleaved_medians(engine, fns, args.reps, 2)
    if engine.rank == 0:
        mib = raw.numel() * 4 / 2**20
        print(f"{args.model}: {len(specs)} gradients, {mib:.1f} MiB, {len(parts)} buckets, "
              f"engine {engine.name}, {engine.size} ranks, median of {args.reps}")
        for name in ("raw", "split", "fused"):
            print(f"  {name:<8} {medians[name] * 1e3:7.2f} ms  "
                  f"{medians['raw'] / medians[name]:.2f} of raw's bus bandwidth")
        print(f"  marks    {statistics.median(marks[2:]) * 1e3:7.2f} ms  "
              f"({len(views)} mark_ready calls, the engine's thread running beside them)")
    sched.close()
    dp_plugin.shutdown()


if __name__ == "__main__":
    main()
