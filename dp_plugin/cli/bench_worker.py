"""One worker of ``dp-plugin bench``, started under a launcher by ``bench.py``.

Times the engine's all-reduce of one float32 buffer per size, then, per
model shape list, the fused all-reduce of every gradient through
``GradientScheduler`` (``_fused`` says which variants) against one raw
all-reduce of the same bytes, their repetitions interleaved so that the
ratios are measured side by side. With ``--shm-check`` (every rank on one
host) every size is timed on two shared-memory transports of the worker's
own, with and without the per-operation header check
(``connect(checked=False)``, which only this does), to measure what the
check costs. Rank 0 prints ``PROGRESS`` after each item and one
``RESULT {json}`` line at the end.

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


def interleaved_medians(engine: Any, fns: dict[str, Callable[[], None]], reps: int,
                        warmup: int) -> dict[str, float]:
    """The median time of each of ``fns``, their repetitions interleaved
    (one of each in turn, a barrier before each), so that a machine that
    drifts during the run moves every one alike and their ratios hold. The
    turn starts one further each round: none always follows the same one
    (a step with copies leaves the caches and pages to the next)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for i in range(warmup + reps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            engine.barrier()
            t0 = time.perf_counter()
            fns[name]()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _fused(engine: Any, model: str, reps: int, warmup: int,
           per_tensor: bool = False) -> dict[str, Any]:
    import torch

    from dp_plugin.cli.shapes import model_shapes
    from dp_plugin.reduce.fusion import TensorSpec
    from dp_plugin.reduce.reducer import GradientScheduler

    grads = [torch.full(shape, 1.0) for _, shape in model_shapes(model)]
    specs = [TensorSpec.of(f"g{i}", g) for i, g in enumerate(grads)]
    nbytes = sum(4 * g.numel() for g in grads)
    scheds: list[Any] = []

    def stepper(op: str, suffix: str, views: bool,
                threshold: int | None = None) -> Callable[[], None]:
        sched = GradientScheduler(specs, engine=engine, op=op, name=f"bench_{model}{suffix}",
                                  fusion_threshold=threshold)
        scheds.append(sched)
        step(sched, grads)  # the plan settles from the observed ready order
        # views: DistributedOptimizer's default, gradients live in the fusion buffer.
        tensors = [sched.view_for(i, g).fill_(1.0) for i, g in enumerate(grads)] if views else grads
        return lambda: step(sched, tensors)

    fns = {"fused_s": stepper("average", "", False),
           "fused_views_s": stepper("average", "_views", True),
           # op=sum: what fusion costs beside the raw all-reduce (a sum too).
           "fused_views_sum_s": stepper("sum", "_sum", True)}
    if per_tensor:  # a 1-byte threshold: one all-reduce per gradient, what fusion saves
        fns["per_tensor_s"] = stepper("average", "_per", False, threshold=1)
    if engine.name == "horovod":  # Horovod's own answer to the same list
        import horovod.torch as hvd

        fns["horovod_grouped_s"] = lambda: hvd.grouped_allreduce(grads, op=hvd.Average,
                                                                 name=f"hvd_{model}")
    raw = torch.ones(nbytes // 4)
    fns["raw_s"] = lambda: engine.allreduce_async(raw, "sum", name="raw").wait()
    result = {"model": model, "bytes": nbytes, "tensors": len(specs),
              "buckets": len(scheds[0].plan), **interleaved_medians(engine, fns, reps, warmup)}
    for sched in scheds:
        sched.close()
    return result


def _check_transports(engine: Any) -> dict[str, Any]:
    """Two shared-memory transports over the engine's ranks (collective): the
    one ``time_s`` times checks every operation's header, as the engine's
    does; the one ``unchecked_s`` times does not. None where the job is not
    on one host or the segments cannot be had (the log says why)."""
    from dp_plugin.engines import shm
    from dp_plugin.reduce.arrays import as_numpy

    def exchange(row: Any, what: str) -> Any:  # any engine: GlooEngine.exchange_rows's table
        return as_numpy(engine.allgather(row[None, :], [1] * engine.size, f"{what} (headers)"))

    one_host = engine.topology.local_size == engine.size
    made = {key: shm.connect(exchange, engine.rank, engine.size, one_host,
                             engine.config.timeout_s, checked=key == "time_s")
            for key in ("time_s", "unchecked_s")}
    if None in made.values():
        for transport in made.values():
            if transport is not None:
                transport.close()
        return {}
    return made


def step(sched: Any, tensors: list[Any]) -> None:
    """One backward's worth: every gradient ready, last first, then wait."""
    for i in reversed(range(len(tensors))):
        sched.mark_ready(i, tensors[i])
    sched.synchronize()


def worker(sizes: list[int], reps: int, warmup: int, models: list[str],
           per_tensor: bool = False, shm_check: bool = False) -> None:
    import torch

    import dp_plugin
    from dp_plugin.engines.base import ReduceOp

    torch.set_num_threads(1)
    engine = dp_plugin.init()
    lead = engine.rank == 0
    checks = _check_transports(engine) if shm_check else {}
    sweep = []
    for nbytes in sizes:
        buf = torch.ones(max(1, nbytes // 4))

        def through(t: Any, b: Any = buf) -> Callable[[], None]:
            return lambda: t.allreduce_async(b, ReduceOp.SUM, "sweep", engine.mark_broken,
                                             None).wait()

        def once(b: Any = buf) -> None:
            engine.allreduce_async(b, "sum", name="sweep").wait()

        fns: dict[str, Callable[[], None]] = (
            {key: through(t) for key, t in checks.items()} if checks else {"time_s": once})
        sweep.append({"bytes": nbytes, **interleaved_medians(engine, fns, reps_for(nbytes, reps),
                                                             warmup)})
        if lead:
            print("PROGRESS", flush=True)
    for transport in checks.values():
        transport.close()
    fused = []
    for model in models:
        fused.append(_fused(engine, model, max(5, reps // 2), 1, per_tensor))
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
    ap.add_argument("--per-tensor", action="store_true")
    ap.add_argument("--shm-check", action="store_true")
    args = ap.parse_args(argv)
    worker([int(s) for s in args.sizes.split(",")], args.reps, args.warmup,
           [m for m in args.models.split(",") if m], args.per_tensor, args.shm_check)


if __name__ == "__main__":
    main()
