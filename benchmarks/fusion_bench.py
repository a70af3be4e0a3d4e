"""Fused all-reduce vs one raw all-reduce vs per-tensor all-reduce.

For 100 float32 tensors totalling 64 MiB (sizes spread like a real model's
layers), reports per engine at world size 2:
  - raw:        one engine all-reduce of a single 64 MiB buffer (the floor);
  - fused:      GradientScheduler with the default 64 MiB threshold, the
                gradients copied into the fusion buffer and back (pack,
                all-reduce, average, unpack);
  - views:      the same, the gradients living in the fusion buffer
                (``view_for``, DDP's gradient_as_bucket_view): no copies;
  - 16 MiB:     copies, but 4 buckets, so packing/unpacking one bucket
                overlaps the all-reduce of another;
  - per-tensor: GradientScheduler with a 1-byte threshold (100 all-reduces).
Goal: fused within 10% of raw. Averaging needs one pass over the data that a
raw sum does not.

    python benchmarks/fusion_bench.py                 # all engines, 2 workers
    python benchmarks/fusion_bench.py --engines gloo --reps 20

Without a launcher it starts itself under each engine's launcher and prints
a table; under a launcher it is one worker and prints one JSON line (rank 0).
Timings are medians of --reps runs after --warmup; the machine is shared, so
compare rows from the same invocation only.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from _launch import clean_env, horovodrun_job, mpiexec_job, run_jobs, torchrun_jobs

from dp_plugin.cli.bench_worker import median_timer

TOTAL_BYTES = 64 * 2**20
N_TENSORS = 100


def tensor_sizes(n: int = N_TENSORS, total_elems: int = TOTAL_BYTES // 4) -> list[int]:
    rng = np.random.default_rng(0)
    weights = rng.lognormal(mean=0.0, sigma=1.5, size=n)
    sizes = np.maximum(1, np.floor(weights / weights.sum() * total_elems)).astype(int)
    sizes[np.argmax(sizes)] += total_elems - int(sizes.sum())
    return [int(s) for s in sizes]


def worker(reps: int, warmup: int) -> None:
    import torch

    import dp_plugin
    from dp_plugin.fusion import TensorSpec
    from dp_plugin.scheduler import GradientScheduler

    torch.set_num_threads(1)
    engine = dp_plugin.init()
    sizes = tensor_sizes()
    grads = [torch.full((s,), float(engine.rank + 1)) for s in sizes]
    specs = [TensorSpec.of(f"t{i}", g) for i, g in enumerate(grads)]
    raw = torch.ones(TOTAL_BYTES // 4)

    timer = median_timer(engine)

    def time_it(fn) -> float:
        return timer(fn, reps, warmup)

    def run_sched(sched: GradientScheduler) -> None:
        for i in reversed(range(len(grads))):
            sched.mark_ready(i, grads[i])
        sched.synchronize()

    def run_views(sched: GradientScheduler, views: list) -> None:
        for i in reversed(range(len(views))):
            sched.mark_ready(i, views[i])
        sched.synchronize()

    results = {"engine": engine.name, "size": engine.size}
    results["raw"] = time_it(lambda: engine.allreduce_async(raw, "sum", name="raw").wait())
    fused = GradientScheduler(specs, engine=engine, op="average")
    results["fused"] = time_it(lambda: run_sched(fused))
    results["fused_buckets"] = len(fused.plan)
    viewed = GradientScheduler(specs, engine=engine, op="average", name="views")
    run_sched(viewed)  # first step: the plan settles (rebuilt from the ready order)
    views = [viewed.view_for(i) for i in range(len(specs))]
    for v, g in zip(views, grads, strict=True):
        v.copy_(g)
    results["views"] = time_it(lambda: run_views(viewed, views))
    quarter = GradientScheduler(specs, engine=engine, op="average", name="quarter",
                                fusion_threshold=16 * 2**20)
    results["quarter"] = time_it(lambda: run_sched(quarter))
    results["quarter_buckets"] = len(quarter.plan)
    per = GradientScheduler(specs, engine=engine, op="average", fusion_threshold=1, name="per")
    results["per_tensor"] = time_it(lambda: run_sched(per))
    for sched in (fused, viewed, quarter, per):
        sched.close()
    if engine.rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dp_plugin.shutdown()


def launch(engine: str, nprocs: int, reps: int, warmup: int, timeout: float) -> dict:
    me = [sys.executable, __file__, "--worker", "--reps", str(reps), "--warmup", str(warmup)]
    env = clean_env(DP_PLUGIN_ENGINE=engine)
    if engine == "mpi":
        jobs = [mpiexec_job(me, nprocs, env)]
    elif engine == "horovod":
        jobs = [horovodrun_job(me, nprocs, env)]
    else:
        jobs = torchrun_jobs(me, nprocs, env)
    return run_jobs(engine, jobs, timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="gloo,mpi,horovod")
    ap.add_argument("-np", "--nprocs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.reps, args.warmup)
        return
    print(f"{N_TENSORS} float32 tensors, {TOTAL_BYTES >> 20} MiB total, "
          f"{args.nprocs} workers, median of {args.reps}\n")
    cols = [("fused", "fused (copy)"), ("views", "fused (views)"),
            ("quarter", "16 MiB x4"), ("per_tensor", "per-tensor")]
    print(f"{'engine':<8} {'raw 64 MiB':>11}" + "".join(f" {title:>20}" for _, title in cols))
    for engine in args.engines.split(","):
        r = launch(engine.strip(), args.nprocs, args.reps, args.warmup, args.timeout)
        cells = "".join(
            f" {r[key] * 1e3:>9.1f} ms ({r[key] / r['raw']:.2f}x)" for key, _ in cols
        )
        print(f"{r['engine']:<8} {r['raw'] * 1e3:>8.1f} ms{cells}", flush=True)


if __name__ == "__main__":
    main()
