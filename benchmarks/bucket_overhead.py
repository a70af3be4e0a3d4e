"""Per-bucket cost of dp_plugin's own Python layer (no network): a table.

One process, the local engine (its all-reduce is a no-op), 100 gradients of
1000 floats and a 1-byte fusion threshold, so every gradient is its own
bucket: the time per bucket is what the Reducer, the
Bucket (pack, unpack) and the hook add on top of the engine's collective.

    python benchmarks/bucket_overhead.py [--steps 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tensors", type=int, default=100)
    args = parser.parse_args()
    os.environ["DP_PLUGIN_ENGINE"] = "local"
    import torch

    import dp_plugin
    from dp_plugin.reduce.fusion import TensorSpec
    from dp_plugin.reduce.reducer import GradientScheduler

    torch.set_num_threads(1)
    engine = dp_plugin.init()
    grads = [torch.full((1000,), 1.0) for _ in range(args.tensors)]
    specs = [TensorSpec.of(f"t{i}", g) for i, g in enumerate(grads)]
    sched = GradientScheduler(specs, engine=engine, op="average", fusion_threshold=1,
                              name="per_tensor")

    def step() -> None:
        for i in reversed(range(len(grads))):
            sched.mark_ready(i, grads[i])
        sched.synchronize()

    for _ in range(10):
        step()
    per_bucket, cpu_per_bucket = [], []
    buckets = args.steps * len(sched.plan) / 1e6
    for _ in range(args.rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            step()
        per_bucket.append((time.perf_counter() - t0) / buckets)
        cpu_per_bucket.append((time.process_time() - c0) / buckets)
    # CPU time (every thread of the process) moves less than wall time on a
    # loaded machine, where the process waits for a core.
    print(f"{'buckets':>8} {'median us/bucket':>17} {'best':>8} {'worst':>8} "
          f"{'median CPU us/bucket':>21}")
    print(f"{len(sched.plan):>8} {statistics.median(per_bucket):>17.1f} "
          f"{min(per_bucket):>8.1f} {max(per_bucket):>8.1f} "
          f"{statistics.median(cpu_per_bucket):>21.1f}")
    dp_plugin.shutdown()


if __name__ == "__main__":
    main()
