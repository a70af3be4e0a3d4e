"""Training-step time of a small BERT-like encoder: dp_plugin vs DDP vs Horovod.

Model (built here, nothing downloaded): token + position embeddings
(vocabulary 8192, hidden 256), 4 post-norm transformer encoder layers
(4 heads, FFN 1024, GELU) and an MLM head (dense + LayerNorm + untied
decoder to the vocabulary); about 7.5 million parameters in 58 tensors.
Each worker trains on its own generated batches of 8 sequences of 128
tokens, 15% of them masked; the loss is cross-entropy at the masked
positions. Adam, lr 1e-4. One torch thread per worker.

Configurations (world size 2 unless noted):
  dp_plugin     ``dp_plugin.torch.DistributedOptimizer``, torchrun-style
                launch (``env``), default engine (gloo);
  ddp           ``torch.nn.parallel.DistributedDataParallel``, gloo, same launch;
  horovod       Horovod 0.28.1's own ``horovod.torch.DistributedOptimizer``
                under ``horovodrun --gloo``;
  dp_plugin@hvd ``dp_plugin.torch`` under ``horovodrun --gloo`` (engine auto ->
                gloo on CPUs; ``dp_plugin@hvd:engine=horovod`` for Horovod's ring);
  dp_plugin@mpi ``dp_plugin.torch`` under ``mpiexec`` (engine auto -> mpi);
  floor         no communication: two single-process trainings side by side
                (world size 1 each), so they compete for the cores as the
                others do.
The dp_plugin and horovod rows run the same training function; only the
``hvd`` module differs (``import dp_plugin.torch as hvd`` vs
``import horovod.torch as hvd``).

    python benchmarks/torch_step_bench.py                  # all, 3 rounds
    python benchmarks/torch_step_bench.py --rounds 5 --steps 20
    python benchmarks/torch_step_bench.py --configs dp_plugin,ddp
    python benchmarks/torch_step_bench.py --configs ddp,dp_plugin,dp_plugin:fusion=8

A configuration may end in options, each ``:name=value``: ``fusion=MiB``
(DP_PLUGIN_FUSION_THRESHOLD, or HOROVOD_FUSION_THRESHOLD for ``horovod``;
64 gives a plan of one 64 MiB bucket, as Horovod's default),
``views=0|1`` (DP_PLUGIN_GRADIENT_AS_BUCKET_VIEW), ``buckets=N``
(DP_PLUGIN_MIN_BUCKETS; 1 gives the plan before it: 1 MiB, then 25 MiB), ``cycle=ms``
(HOROVOD_CYCLE_TIME), ``dps=0|1`` (HOROVOD_DYNAMIC_PROCESS_SETS), and
``autotune=1``, ``tune_steps=N``, ``tune_warmup=N`` (DP_PLUGIN_AUTOTUNE and its
step counts; give --warmup enough steps to cover the tuning, see
benchmarks/autotune_bench.py), and ``engine=NAME`` (DP_PLUGIN_ENGINE, the
dp_plugin rows: ``dp_plugin@hvd:engine=horovod`` is Horovod's ring under horovodrun).

Without a launcher it starts itself once per configuration and round,
interleaved (A B C ... A B C ...), and prints a table: median step time over
all measured steps of all rounds, the best and worst per-run median, steps/s,
and the ratios to DDP and to Horovod (median over rounds of the ratio within
a round, so that load changes on a shared machine mostly cancel). For the
dp_plugin rows it also prints the core's per-step StepStats (buckets,
all-reduce time, the part of it exposed after backward). Under a launcher it
is one worker; rank 0 prints one JSON line with its step times (after
--warmup steps). Compare rows of the same invocation only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from dp_plugin.cli.jobs import Job, clean_env, horovodrun_job, mpiexec_job, run_jobs, torchrun_jobs

VOCAB, HIDDEN, LAYERS, HEADS, FFN = 8192, 256, 4, 4, 1024
SEQ, BATCH, MASK_FRACTION = 128, 8, 0.15
CONFIGS = ("dp_plugin", "ddp", "horovod", "dp_plugin@hvd", "floor", "dp_plugin@mpi")


def build_model() -> Any:
    import torch
    from torch import nn

    class Encoder(nn.Module):
        """BERT-base in miniature (post-norm layers, GELU, MLM head)."""

        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(VOCAB, HIDDEN)
            self.positions = nn.Embedding(SEQ, HIDDEN)
            self.norm = nn.LayerNorm(HIDDEN)
            layer = nn.TransformerEncoderLayer(
                HIDDEN, HEADS, FFN, dropout=0.0, activation="gelu", batch_first=True
            )
            self.layers = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.head = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN))
            self.decoder = nn.Linear(HIDDEN, VOCAB)

        def forward(self, ids: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(ids.shape[1], device=ids.device)
            h = self.layers(self.norm(self.tokens(ids) + self.positions(pos)))
            return self.decoder(self.head(h[masked]))  # logits at masked positions only

    return Encoder()


def make_batches(seed: int, count: int) -> list[tuple[Any, Any, Any]]:
    """(input ids with [MASK]=0, mask, labels at masked positions), generated up front."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        masked = torch.rand(BATCH, SEQ, generator=g) < MASK_FRACTION
        out.append((ids.masked_fill(masked, 0), masked, ids[masked]))
    return out


def train(model: Any, opt: Any, batches: list[tuple[Any, Any, Any]]) -> list[float]:
    """One step per batch; returns each step's wall time (this rank's clock)."""
    import torch.nn.functional as F

    times = []
    for ids, masked, labels in batches:
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(ids, masked), labels)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def worker(config: str, steps: int, warmup: int) -> None:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model()
    stats: dict[str, Any] = {}
    if config in ("dp_plugin", "horovod", "dp_plugin@hvd", "dp_plugin@mpi"):
        if config == "horovod":
            import horovod.torch as hvd
        else:
            import dp_plugin.torch as hvd  # type: ignore[no-redef]
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        times = train(model, opt, make_batches(rank, warmup + steps))[warmup:]
        # dp_plugin's optimizer keeps its Reducer here (private; a
        # benchmark may look): its StepStats say where communication time went.
        reducer = getattr(getattr(opt, "_dp", None), "reducer", None)
        if reducer is not None:
            stats = _scheduler_stats(reducer, warmup)
            tuner = reducer.autotuner
            if tuner is not None and tuner.decision is not None:
                stats["autotune"] = tuner.decision.as_args()
        stats["engine"] = _engine_name(hvd)
    elif config == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
        times = train(ddp, opt, make_batches(rank, warmup + steps))[warmup:]
        dist.destroy_process_group()
    else:  # floor: no communication at all
        rank, size = int(os.environ.get("BENCH_INDEX", "0")), 1
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        times = train(model, opt, make_batches(rank, warmup + steps))[warmup:]
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        n_tensors = sum(1 for _ in model.parameters())
        print("RESULT " + json.dumps({"config": config, "size": size, "times": times,
                                      "params": n_params, "tensors": n_tensors, **stats}),
              flush=True)


def _engine_name(hvd: Any) -> str:
    if hvd.__name__.startswith("horovod"):
        return "horovod.torch"
    from dp_plugin.launch import runtime

    return str(runtime.engine().name)


def _scheduler_stats(sched: Any, warmup: int) -> dict[str, Any]:
    """Per-step means of the core's StepStats over the measured steps."""
    fields = ("buckets", "bytes_reduced", "allreduce_s", "exposed_s", "step_s")
    return {"sched": {f: sched.stats.mean(f, skip_first=warmup) for f in fields}}


# -- launching ---------------------------------------------------------------

OPTIONS = {
    # option -> (variable, what the value means, how to turn it into the variable's value)
    "fusion": ("DP_PLUGIN_FUSION_THRESHOLD", "MiB", lambda v: str(int(float(v) * 2**20))),
    "views": ("DP_PLUGIN_GRADIENT_AS_BUCKET_VIEW", "0 or 1", str),
    "buckets": ("DP_PLUGIN_MIN_BUCKETS", "count", str),
    "cycle": ("HOROVOD_CYCLE_TIME", "ms", str),
    "dps": ("HOROVOD_DYNAMIC_PROCESS_SETS", "0 or 1", str),
    "autotune": ("DP_PLUGIN_AUTOTUNE", "0 or 1", str),
    "tune_steps": ("DP_PLUGIN_AUTOTUNE_STEPS", "steps", str),
    "tune_warmup": ("DP_PLUGIN_AUTOTUNE_WARMUP_STEPS", "steps", str),
    "engine": ("DP_PLUGIN_ENGINE", "engine name", str),
}


def parse_config(spec: str) -> tuple[str, dict[str, str]]:
    """``name[:option=value]...`` -> (name, extra environment); see ``OPTIONS``."""
    name, *options = spec.split(":")
    valid = ", ".join(f"{k}=<{v[1]}>" for k, v in OPTIONS.items())
    if name not in CONFIGS:
        raise SystemExit(f"unknown configuration {spec!r}; valid: {', '.join(CONFIGS)}, "
                         f"optionally followed by ':option=value' ({valid})")
    env: dict[str, str] = {}
    for option in options:
        key, _, value = option.partition("=")
        number = value.replace(".", "", 1).isdigit()
        wrong_kind = number if key == "engine" else not number  # engine: a name; others: numbers
        if key not in OPTIONS or wrong_kind or name in ("ddp", "floor") \
                or (key == "engine" and not name.startswith("dp_plugin")):
            raise SystemExit(f"{spec!r}: options are {valid} (numbers, but an engine name), "
                             "for dp_plugin, dp_plugin@hvd and horovod (engine: dp_plugin only)")
        variable, _, convert = OPTIONS[key]
        if key == "fusion" and name == "horovod":
            variable = "HOROVOD_FUSION_THRESHOLD"
        env[variable] = convert(value)
    return name, env


def launch(spec: str, nprocs: int, steps: int, warmup: int, timeout: float) -> dict[str, Any]:
    """Run one configuration to completion; return rank 0's RESULT."""
    config, extra_env = parse_config(spec)
    me = [sys.executable, __file__, "--worker", config, "--steps", str(steps),
          "--warmup", str(warmup)]
    env = clean_env(**extra_env)
    jobs: list[Job]
    if config in ("horovod", "dp_plugin@hvd"):
        jobs = [horovodrun_job(me, nprocs, env)]
    elif config == "dp_plugin@mpi":
        jobs = [mpiexec_job(me, nprocs, env)]
    elif config == "floor":
        jobs = [(me, dict(env, BENCH_INDEX=str(i))) for i in range(nprocs)]
    else:
        jobs = torchrun_jobs(me, nprocs, env)
    return run_jobs(spec, jobs, timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("-np", "--nprocs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup)
        return
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for spec in configs:
        parse_config(spec)  # fail before the first run
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    t_start = time.monotonic()
    for rnd in range(args.rounds):
        for config in configs:
            r = launch(config, args.nprocs, args.steps, args.warmup, args.timeout)
            runs[config].append(r)
            print(f"round {rnd + 1}/{args.rounds} {config:<22} median "
                  f"{statistics.median(r['times']) * 1e3:7.1f} ms", file=sys.stderr, flush=True)
    first = next(iter(runs.values()))[0]
    print(f"\nBERT-like encoder: {first['params'] / 1e6:.2f} M parameters in "
          f"{first['tensors']} tensors; batch {BATCH}x{SEQ} tokens per worker; "
          f"{args.nprocs} workers, 1 thread each; {args.rounds} interleaved rounds x "
          f"{args.steps} steps (after {args.warmup} warm-up); "
          f"total {time.monotonic() - t_start:.0f} s\n")
    print(f"{'config':<22} {'median step':>11} {'best round':>10} {'worst round':>11} "
          f"{'steps/s':>7} {'vs DDP':>6} {'vs horovod':>10}")
    medians = {c: statistics.median(t for r in rs for t in r["times"]) for c, rs in runs.items()}
    round_medians = {c: [statistics.median(r["times"]) for r in rs] for c, rs in runs.items()}

    def paired(config: str, base: str) -> str:
        # Median over rounds of this round's ratio: runs of one round are
        # minutes apart at most, so load changes on the machine mostly cancel.
        if base not in round_medians:
            return "-"
        pairs = zip(round_medians[config], round_medians[base], strict=True)
        return f"{statistics.median(a / b for a, b in pairs):.2f}"

    for config in runs:
        per_round = round_medians[config]
        print(f"{config:<22} {medians[config] * 1e3:>8.1f} ms {min(per_round) * 1e3:>7.1f} ms "
              f"{max(per_round) * 1e3:>8.1f} ms {1 / medians[config]:>7.2f} "
              f"{paired(config, 'ddp'):>6} {paired(config, 'horovod'):>10}")
    print("\nmedian step: over all measured steps of all rounds; best/worst round: the "
          "lowest/highest per-run median; vs DDP / vs horovod: median over rounds of the "
          "ratio of per-run medians within the round (< 1 is faster)")
    for config, rs in runs.items():
        if "sched" in rs[-1]:
            s = rs[-1]["sched"]
            shown = ", ".join(f"{k} {v * 1e3:.1f} ms" if k.endswith("_s") else f"{k} {v:g}"
                              for k, v in s.items())
            print(f"\n{config} ({rs[-1].get('engine')} engine), scheduler StepStats per "
                  f"step (means, last round): {shown}")


if __name__ == "__main__":
    main()
