"""What ``DP_PLUGIN_AUTOTUNE=1`` picks on the BERT-like encoder, and how close
that is to the best fixed bucket size.

Runs ``torch_step_bench.py``'s dp_plugin configuration (world size 2, gloo,
the 7.5 M-parameter encoder) once per fixed fusion threshold and once with
autotune, interleaved over ``--rounds`` rounds, every run with the same
number of measured steps after its warm-up: ``--warmup`` steps for the fixed
settings, the whole tuning (1 + candidates x (tune warm-up + tune steps)
steps) plus one for autotune, so that only steps with its final choice count. Prints a
markdown table: per configuration the median step time over all measured
steps, the per-round medians and the ratio to the best fixed setting
(median over rounds of the within-round ratio); then, per autotune run, the
threshold chosen and rank 0's medians measured while tuning.

    python benchmarks/autotune_bench.py                       # 2 rounds, 10 steps
    python benchmarks/autotune_bench.py --rounds 3 --tune-steps 5 --tune-warmup 2
    python benchmarks/autotune_bench.py --launcher horovodrun --thresholds fusion=4,default

Under ``--launcher horovodrun`` (or ``mpirun``) every row runs on the engine
``auto`` picks there (Horovod's ring, or MPI).

The fixed rows: ``fusion=N`` sets DP_PLUGIN_FUSION_THRESHOLD (every bucket N
MiB, the first included); ``default`` is the default plan: a 1 MiB first
bucket, then a quarter of this 28.5 MiB gradient (7.1 MiB, the spread of
DP_PLUGIN_MIN_BUCKETS) instead of 25 MiB. Autotune's candidates keep the
default 1 MiB first bucket (1, 4, 8, 25, 64 MiB and the default's 7.1), so
its rows are close to, not identical with, the fixed ones.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from torch_step_bench import launch

THRESHOLDS = {"fusion=1": ":fusion=1", "fusion=4": ":fusion=4", "fusion=8": ":fusion=8",
              "default (1, then 7.1)": "", "fusion=64": ":fusion=64"}
CANDIDATES = 6
"""1, 4, 8, 25, 64 MiB and the default's 7.1: all distinct plans for this 30 MB model."""
LAUNCHED = {"torchrun": "dp_plugin", "horovodrun": "dp_plugin@hvd", "mpirun": "dp_plugin@mpi"}
"""Per launcher: torch_step_bench's configuration (engine ``auto``)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="measured steps per run")
    ap.add_argument("--tune-steps", type=int, default=5, help="DP_PLUGIN_AUTOTUNE_STEPS")
    ap.add_argument("--tune-warmup", type=int, default=2,
                    help="DP_PLUGIN_AUTOTUNE_WARMUP_STEPS")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up of the fixed settings")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--launcher", choices=tuple(LAUNCHED), default="torchrun",
                    help="horovodrun, mpirun: Horovod's ring or MPI (engine auto)")
    ap.add_argument("--thresholds", default="fusion=1,fusion=4,fusion=8,default,fusion=64",
                    help="the fixed rows (comma-separated, of the defaults)")
    args = ap.parse_args()
    base = LAUNCHED[args.launcher]
    tuned = f"{base}:autotune=1:tune_steps={args.tune_steps}:tune_warmup={args.tune_warmup}"
    wanted = args.thresholds.split(",")
    fixed = {name: f"{base}{opt}" for name, opt in THRESHOLDS.items()
             if name.split(" ")[0] in wanted}
    configs = {**fixed, "autotune": tuned}
    tuning = 1 + CANDIDATES * (args.tune_steps + args.tune_warmup) + 1
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    start = time.monotonic()
    for rnd in range(args.rounds):
        for name, spec in configs.items():
            warmup = tuning if name == "autotune" else args.warmup
            r = launch(spec, 2, args.steps, warmup, args.timeout)
            runs[name].append(r)
            print(f"round {rnd + 1}/{args.rounds} {name:<22} median "
                  f"{statistics.median(r['times']) * 1e3:7.1f} ms", file=sys.stderr, flush=True)
    report(runs, fixed, args, tuning, time.monotonic() - start)


def report(runs: dict[str, list[dict[str, Any]]], fixed: dict[str, str],
           args: argparse.Namespace, tuning: int, elapsed: float) -> None:
    medians = {c: statistics.median(t for r in rs for t in r["times"]) for c, rs in runs.items()}
    per_round = {c: [statistics.median(r["times"]) for r in rs] for c, rs in runs.items()}
    best = min(fixed, key=lambda c: medians[c])
    print(f"\nBERT-like encoder, 2 workers under {args.launcher}, {args.rounds} interleaved "
          f"rounds x "
          f"{args.steps} measured steps after {args.warmup} warm-up steps (autotune: after "
          f"{tuning}: {args.tune_warmup} warm-up + {args.tune_steps} timed steps per "
          "candidate); "
          f"total {elapsed:.0f} s\n")
    print("| config | median step (ms) | per-round medians (ms) | vs best fixed "
          f"({best}) |")
    print("|---|---|---|---|")
    for c in runs:
        ratio = statistics.median(a / b for a, b in zip(per_round[c], per_round[best],
                                                          strict=True))
        rounds = ", ".join(f"{m * 1e3:.0f}" for m in per_round[c])
        print(f"| {c} | {medians[c] * 1e3:.0f} | {rounds} | {ratio:.2f} |")
    print("\n| autotune run | chose | rank 0's median step while tuning, per candidate |")
    print("|---|---|---|")
    for i, r in enumerate(runs["autotune"]):
        d = r.get("autotune", {})
        timings = ", ".join(f"{t >> 20} MiB: {m * 1e3:.0f} ms"
                            for t, m in zip(d.get("candidates", []), d.get("rank0_median_s", []),
                                            strict=True))
        print(f"| round {i + 1} | {d.get('chosen', 0) >> 20} MiB | {timings} |")


if __name__ == "__main__":
    main()
