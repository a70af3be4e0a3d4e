"""One worker of ``dp-plugin bench``, started under a launcher by ``bench.py``.

Times the engine's all-reduce of one float32 buffer per size (a barrier
before each repetition, median of the repetitions), then, per model shape
list, the fused all-reduce of every gradient through ``GradientScheduler``
(default fusion threshold, averaging, as a training step does; with the
gradients as separate tensors, then as views of the fusion buffer, the
``DistributedOptimizer`` default; then views with ``op=sum``, which isolates
what fusion costs from averaging's pass) against one raw all-reduce (a sum)
of the same bytes and, under the horovod engine, Horovod's own
``grouped_allreduce``.
Rank 0 prints ``PROGRESS`` after each item and one ``RESULT {json}`` line at
the end.

    python -m dp_plugin.cli.bench_worker --sizes 4096,65536 --reps 10 --warmup 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any


def reps_for(nbytes: int, reps: int) -> int:
    """Fewer repetitions for large buffers: ``reps`` up to 16 MiB, at least 3."""
    return max(3, min(reps, reps * (16 << 20) // max(nbytes, 1)))


def median_timer(engine: Any) -> Callable[[Callable[[], None], int, int], float]:
    """``time_it(fn, reps, warmup)``: the median time of ``fn`` over ``reps`` runs
    after ``warmup``, each started together on every rank (a barrier first)."""
    def time_it(fn: Callable[[], None], reps: int, warmup: int) -> float:
        times = []
        for i in range(warmup + reps):
            engine.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return time_it


def _fused(engine: Any, model: str, reps: int, warmup: int) -> dict[str, Any]:
    import torch

    from dp_plugin.cli.shapes import model_shapes
    from dp_plugin.fusion import TensorSpec
    from dp_plugin.scheduler import GradientScheduler

    grads = [torch.full(shape, 1.0) for _, shape in model_shapes(model)]
    specs = [TensorSpec.of(f"g{i}", g) for i, g in enumerate(grads)]
    sched = GradientScheduler(specs, engine=engine, op="average", name=f"bench_{model}")

    def step(tensors: list[Any]) -> None:
        for i in reversed(range(len(tensors))):
            sched.mark_ready(i, tensors[i])
        sched.synchronize()

    time_it = median_timer(engine)
    nbytes = sum(4 * g.numel() for g in grads)
    step(grads)  # the plan settles from the observed ready order
    fused = time_it(lambda: step(grads), reps, warmup)
    # DistributedOptimizer's default: gradients live in the fusion buffer.
    views = [sched.view_for(i, g) for i, g in enumerate(grads)]
    for view in views:
        view.fill_(1.0)
    fused_views = time_it(lambda: step(views), reps, warmup)
    buckets = len(sched.plan)
    sched.close()
    views.clear()
    # The same with op=sum: what fusion costs beside the raw all-reduce (a
    # sum too), without averaging's pass over the gradients.
    sched = GradientScheduler(specs, engine=engine, op="sum", name=f"bench_{model}_sum")
    step(grads)
    views = [sched.view_for(i, g) for i, g in enumerate(grads)]
    for view in views:
        view.fill_(1.0)
    fused_sum = time_it(lambda: step(views), reps, warmup)
    sched.close()
    views.clear()
    result = {"model": model, "bytes": nbytes, "tensors": len(specs), "buckets": buckets,
              "fused_s": fused, "fused_views_s": fused_views, "fused_views_sum_s": fused_sum}
    if engine.name == "horovod":  # Horovod's own answer to the same list
        import horovod.torch as hvd

        result["horovod_grouped_s"] = time_it(
            lambda: hvd.grouped_allreduce(grads, op=hvd.Average, name=f"hvd_{model}"),
            reps, warmup)
    grads.clear()  # free them before the raw buffer of the same size
    raw = torch.ones(nbytes // 4)
    result["raw_s"] = time_it(lambda: engine.allreduce_async(raw, "sum", name="raw").wait(),
                              reps, warmup)
    return result


def worker(sizes: list[int], reps: int, warmup: int, models: list[str]) -> None:
    import torch

    import dp_plugin

    torch.set_num_threads(1)
    engine = dp_plugin.init()
    lead = engine.rank == 0
    time_it = median_timer(engine)
    sweep = []
    for nbytes in sizes:
        buf = torch.ones(max(1, nbytes // 4))
        def once(b: Any = buf) -> None:
            engine.allreduce_async(b, "sum", name="sweep").wait()

        t = time_it(once, reps_for(nbytes, reps), warmup)
        sweep.append({"bytes": nbytes, "time_s": t})
        if lead:
            print("PROGRESS", flush=True)
    fused = []
    for model in models:
        fused.append(_fused(engine, model, max(3, reps // 4), 1))
        if lead:
            print("PROGRESS", flush=True)
    if lead:
        print("RESULT " + json.dumps({"engine": engine.name, "size": engine.size,
                                      "sweep": sweep, "models": fused}), flush=True)
    dp_plugin.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--models", default="")
    args = ap.parse_args(argv)
    worker([int(s) for s in args.sizes.split(",")], args.reps, args.warmup,
           [m for m in args.models.split(",") if m])


if __name__ == "__main__":
    main()
