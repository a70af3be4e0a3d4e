"""Keras 3 train-step time: 2 workers with DistributedCallback vs one process.

Model (built here, nothing downloaded): an MLP 512 -> 1024 -> 1024 -> 10
(ReLU, softmax), about 1.6 million parameters in 6 tensors (6.3 MiB of
float32 gradients per step), SGD with momentum, sparse categorical
cross-entropy. ``model.fit`` on generated data, ``steps_per_execution=1``.

Configurations:
  dp_plugin     2 workers (torchrun-style launch, gloo engine), each with the
                per-worker batch and ``dp.DistributedCallback()``;
  dp_plugin+xla the same with ``compile(jit_compile=True)`` (kept by the
                callback: the split train step);
  dp_plugin@mpi the same as dp_plugin under ``mpiexec`` (MPI engine);
  single        one process, no plugin, the global batch (2 x per-worker),
                with as many TensorFlow threads as the 2 workers have together;
  floor         2 independent processes without the plugin, per-worker batch
                each: the compute the workers do, with no communication;
  floor+xla     the same with ``jit_compile=True``;
  solo, solo+xla  the floor's 2 independent processes, each with
                ``DistributedCallback`` at world size 1 (local engine): the
                bridge (and the split step) without communication;
  dp_plugin@torch, floor@torch  dp_plugin and floor on Keras's torch backend
                (``KERAS_BACKEND=torch``; ``dp_plugin.keras.DistributedCallback``
                over the torch adapter's reduction; one torch thread per worker);
  mwms          TensorFlow's own way: 2 workers under
                ``MultiWorkerMirroredStrategy`` (TF_CONFIG on localhost),
                ``model.fit`` on a distributed dataset. Since TF 2.16 (Keras 3)
                it fails (keras-team/keras#20585); the table prints its error,
                or the time it ran if it ever works.

    python benchmarks/keras_step_bench.py                  # all, 3 rounds
    python benchmarks/keras_step_bench.py --configs dp_plugin,single --rounds 5
    python benchmarks/keras_step_bench.py --configs dp_plugin,dp_plugin:buckets=1,floor

A plugin configuration may end in ``:buckets=N`` (DP_PLUGIN_MIN_BUCKETS; 1
keeps the buckets at the fusion threshold, the plan before the default
spread a small model over 4).

Without a launcher it starts itself once per configuration and round,
interleaved, and prints a table: median step time over the measured steps
of all rounds, spread of the per-round medians, and, for the plugin rows,
the share of the step spent inside the bridge (the ``tf.numpy_function``
callback: pack, all-reduce, unpack) with the core scheduler's per-step
all-reduce and exposed times. The machine is shared: compare rows of one
invocation only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from dp_plugin.cli.jobs import Job, clean_env, free_port, mpiexec_job, run_jobs, torchrun_jobs

FEATURES, HIDDEN, CLASSES = 512, 1024, 10
BATCH = 64  # per worker
CONFIGS = ("dp_plugin", "dp_plugin+xla", "dp_plugin@mpi", "single", "floor", "floor+xla",
           "solo", "solo+xla", "dp_plugin@torch", "floor@torch", "mwms")
MWMS_TIMEOUT = 180.0


def step_timer(warmup: int) -> Any:
    """A Keras callback recording each train batch's wall time, and the bridge's
    counters (time inside the numpy callback, calls) when the warm-up ends."""
    import keras

    class StepTimer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []
            self.bridge_at_warmup = (0.0, 0)
            self._t0 = 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if batch == warmup:
                bridge = _bridge(self.model)
                if bridge is not None:
                    self.bridge_at_warmup = (bridge.seconds, bridge.calls)
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.times.append(time.perf_counter() - self._t0)

    return StepTimer()


def _bridge(model: Any) -> Any:
    if os.environ.get("KERAS_BACKEND") == "torch":
        return None  # no bridge: the torch adapter's hooks reduce the gradients
    from dp_plugin.tensorflow.optimizer import hook_of

    hook = hook_of(model.optimizer)
    return None if hook is None else hook.bridge


def build_model(jit: bool) -> Any:
    import keras

    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(HIDDEN, activation="relu"),
        keras.layers.Dense(HIDDEN, activation="relu"),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy", jit_compile=jit)
    return model


def worker(config: str, steps: int, warmup: int, threads: int) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np

    on_torch = config.endswith("@torch")
    if on_torch:
        import torch

        torch.set_num_threads(threads)
    else:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))
    import keras

    distributed = config.startswith(("dp_plugin", "solo"))
    rank, size = int(os.environ.get("BENCH_INDEX", "0")), 1
    if distributed and on_torch:
        import dp_plugin.keras as dp

        dp.init()
        rank, size = rank + dp.rank(), dp.size()
    elif distributed:
        import dp_plugin.tensorflow as dp

        dp.init()
        rank, size = rank + dp.rank(), dp.size()
    batch = BATCH * (2 if config == "single" else 1)
    if not on_torch:  # it imports TensorFlow, which a torch worker never loads
        keras.utils.set_random_seed(rank)
    rng = np.random.default_rng(rank)
    n = batch * (warmup + steps)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(n,))
    if config == "mwms":
        mwms_worker(x, y, steps, warmup)
        return
    model = build_model(jit=config.endswith("+xla"))
    timer = step_timer(warmup)
    callbacks = [timer]
    if distributed:
        callbacks.insert(0, dp.DistributedCallback())
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    times = timer.times[warmup:]
    result: dict[str, Any] = {"config": config, "size": size, "times": times,
                              "params": model.count_params(),
                              "tensors": len(model.trainable_weights), "jit": model.jit_compile}
    if distributed and on_torch:
        from dp_plugin.keras.torch_optimizer import hook_of
        from dp_plugin.launch import runtime

        stats = hook_of(model.optimizer).gradients.comm_stats()  # type: ignore[union-attr]
        result["engine"] = runtime.engine().name
        result["sched"] = {f: stats.mean(f, skip_first=warmup)
                           for f in ("buckets", "bytes_reduced", "allreduce_s", "exposed_s")}
        dp.shutdown()
    elif distributed:
        from dp_plugin.launch import runtime

        bridge = _bridge(model)
        sched = bridge.schedulers[0]
        result["engine"] = runtime.engine().name
        seconds, calls = bridge.seconds - timer.bridge_at_warmup[0], \
            bridge.calls - timer.bridge_at_warmup[1]
        result["bridge_s"] = seconds / max(1, calls)  # mean over the measured steps
        result["sched"] = {f: sched.stats.mean(f, skip_first=warmup)
                           for f in ("buckets", "bytes_reduced", "allreduce_s", "exposed_s")}
        dp.shutdown()
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def mwms_worker(x: Any, y: Any, steps: int, warmup: int) -> None:
    """TensorFlow's MultiWorkerMirroredStrategy with Keras 3 ``fit`` (TF_CONFIG set by
    ``launch``): prints its error in the RESULT, or its step times if it works."""
    import tensorflow as tf

    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    result: dict[str, Any] = {"config": "mwms", "times": []}
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = build_model(jit=False)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH * 2)
        timer = step_timer(warmup)
        model.fit(data, epochs=1, verbose=0, callbacks=[timer])
        result["times"] = timer.times[warmup:]
    except Exception as exc:  # the expected outcome since TF 2.16: report it
        text = " ".join(str(exc).split())
        if len(text) > 220:
            text = f"{text[:90]} ... {text[-120:]}"
        result["error"] = f"{type(exc).__name__}: {text}"
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def launch(config: str, nprocs: int, steps: int, warmup: int, timeout: float) -> dict[str, Any]:
    """Run one configuration to completion; return rank 0's RESULT."""

    def me(threads: int) -> list[str]:
        return [sys.executable, __file__, "--worker", config, "--steps", str(steps),
                "--warmup", str(warmup), "--threads", str(threads)]

    env = clean_env(TF_CPP_MIN_LOG_LEVEL="2")
    config, _, buckets = config.partition(":buckets=")
    if buckets:
        env["DP_PLUGIN_MIN_BUCKETS"] = buckets
    jobs: list[Job]
    if config == "mwms":
        return launch_mwms(me(1), nprocs, env, min(timeout, MWMS_TIMEOUT))
    if config == "dp_plugin@mpi":
        jobs = [mpiexec_job(me(1), nprocs, dict(env, DP_PLUGIN_ENGINE="mpi"))]
    elif config in ("dp_plugin", "dp_plugin+xla"):
        jobs = torchrun_jobs(me(1), nprocs, dict(env, DP_PLUGIN_ENGINE="gloo"))
    elif config == "dp_plugin@torch":
        jobs = torchrun_jobs(me(1), nprocs, dict(env, DP_PLUGIN_ENGINE="gloo",
                                                   KERAS_BACKEND="torch"))
    elif config == "single":
        jobs = [(me(nprocs), env)]
    else:  # floor, floor+xla, floor@torch, solo, solo+xla
        if config.startswith("solo"):
            env = dict(env, DP_PLUGIN_ENGINE="local")
        if config.endswith("@torch"):
            env = dict(env, KERAS_BACKEND="torch")
        jobs = [(me(1), dict(env, BENCH_INDEX=str(i))) for i in range(nprocs)]
    return run_jobs(config, jobs, timeout)


def launch_mwms(cmd: list[str], nprocs: int, env: dict[str, str],
                timeout: float) -> dict[str, Any]:
    """The mwms workers, one TF_CONFIG each; a hang or crash becomes the row's error."""
    hosts = [f"localhost:{free_port()}" for _ in range(nprocs)]
    jobs: list[Job] = [(cmd, dict(env, TF_CONFIG=json.dumps(
        {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}})))
        for i in range(nprocs)]
    try:
        return run_jobs("mwms", jobs, timeout)
    except SystemExit as exc:  # hung past the timeout, or a worker crashed
        text = str(exc).strip().splitlines()
        return {"config": "mwms", "times": [], "error": text[0][:160] if text else "failed"}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("-np", "--nprocs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.threads)
        return
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted({c for c in configs if c.partition(":buckets=")[0] not in CONFIGS})
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; valid: {', '.join(CONFIGS)}")
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    t_start = time.monotonic()
    load = os.getloadavg()[0]
    for rnd in range(args.rounds):
        for config in configs:
            if config == "mwms" and runs[config]:
                continue  # once is enough to show what it does
            r = launch(config, args.nprocs, args.steps, args.warmup, args.timeout)
            runs[config].append(r)
            shown = r.get("error") or f"median {statistics.median(r['times']) * 1e3:7.2f} ms"
            print(f"round {rnd + 1}/{args.rounds} {config:<14} {shown}", file=sys.stderr,
                  flush=True)
    report(runs, args, time.monotonic() - t_start, (load, os.getloadavg()[0]))


def _floor_of(config: str, medians: dict[str, float]) -> float | None:
    """The floor row a row is compared with: the one with the same XLA setting
    and Keras backend."""
    if config.endswith("@torch"):
        return medians.get("floor@torch")
    return medians.get("floor+xla" if config.endswith("+xla") else "floor")


def report(runs: dict[str, list[dict[str, Any]]], args: Any, seconds: float,
           load: tuple[float, float]) -> None:
    timed = {c: rs for c, rs in runs.items() if all(r["times"] for r in rs)}
    first = next((rs[0] for rs in timed.values() if "params" in rs[0]), None)
    if first is not None:
        print(f"\nKeras MLP: {first['params'] / 1e6:.2f} M parameters in {first['tensors']} "
              f"tensors; per-worker batch {BATCH}, global batch {BATCH * args.nprocs}; "
              f"{args.nprocs} workers x 1 thread (single: {args.nprocs} threads); "
              f"{args.rounds} interleaved rounds x {args.steps} steps (after {args.warmup} "
              f"warm-up); total {seconds:.0f} s; load average {load[0]:.2f} at the start, "
              f"{load[1]:.2f} at the end\n")
    print(f"{'config':<14} {'median step':>12} {'round medians (min-max)':>24} "
          f"{'vs floor':>9} {'vs single':>10} {'bridge/step':>13} {'overhead':>13} "
          f"{'allreduce':>10} {'exposed':>9}")
    medians = {c: statistics.median(t for r in rs for t in r["times"]) for c, rs in timed.items()}
    for config, rs in timed.items():
        per_round = [statistics.median(r["times"]) * 1e3 for r in rs]
        floor = _floor_of(config, medians)
        vs_floor = f"{medians[config] / floor:.2f}" if floor else "-"
        vs = f"{medians[config] / medians['single']:.2f}" if "single" in medians else "-"
        bridge = overhead = allreduce = exposed = "-"
        if "sched" in rs[0]:
            allreduce = f"{statistics.median(r['sched']['allreduce_s'] for r in rs) * 1e3:.2f} ms"
            exposed = f"{statistics.median(r['sched']['exposed_s'] for r in rs) * 1e3:.2f} ms"
        if "bridge_s" in rs[0]:
            b = statistics.median(r["bridge_s"] for r in rs)
            e = statistics.median(r["sched"]["exposed_s"] for r in rs)
            bridge = f"{b * 1e3:.2f} ms {100 * b / medians[config]:.0f}%"
            overhead = f"{(b - e) * 1e3:.2f} ms {100 * (b - e) / medians[config]:.0f}%"
        print(f"{config:<14} {medians[config] * 1e3:>9.2f} ms "
              f"{min(per_round):>13.2f} - {max(per_round):>6.2f} ms {vs_floor:>9} {vs:>10} "
              f"{bridge:>13} {overhead:>13} {allreduce:>10} {exposed:>9}")
    for config, rs in runs.items():
        for r in rs:
            if r.get("error"):
                print(f"{config:<14} failed: {r['error']}")
    print("\nvs floor: against floor (the +xla rows against floor+xla). bridge/step: time "
          "inside the bridge's tf.numpy_function callbacks per step (pack and launch, wait, "
          "results) and its share of the median step; overhead: bridge/step minus exposed, "
          "i.e. everything in the callbacks but waiting for the all-reduce; allreduce/exposed: "
          "the core scheduler's StepStats (all-reduce in flight / waited for), medians of the "
          "per-round means.")


if __name__ == "__main__":
    main()
