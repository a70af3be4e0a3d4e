"""``dp-plugin plan``: predicted step time and scaling efficiency at scale.

An alpha-beta model of ring all-reduce with bucketed overlap (see
``dp_plugin.cli.alphabeta``): the link's latency and bandwidth come from a
``dp-plugin bench`` result (``--sweep results.json``) or the command line
(``--alpha-us``, ``--bandwidth-gbit``); the model's gradients from a known
shape list (``--model``); its compute time per step (forward + backward at
one worker) from ``--compute-ms``. For each worker count it prints the
predicted step, how much of it is communication nobody hides, the scaling
efficiency, and the bucket size that would minimise the step; below the
table, each worker count where a bucket size shortens the step against
the default plan, with the setting.

The default plan is dp_plugin's own (``Config.bucket_caps``): a 1 MiB first
bucket, then 25 MiB or a quarter of the gradient, whichever is smaller;
``--threshold-mib`` predicts one size for every bucket instead, as
``DP_PLUGIN_FUSION_THRESHOLD`` sets it. Hosts are assumed to hold 8 ranks
(a typical 8-GPU node) unless ``--ranks-per-host`` says otherwise.

    dp-plugin plan --model resnet50 --compute-ms 250 --alpha-us 10 --bandwidth-gbit 25
    dp-plugin plan --model bert-base --compute-ms 900 --sweep out/results.json --engine gloo
    dp-plugin plan --model bert-base --compute-ms 900 --alpha-us 50 --bandwidth-gbit 1 \
        --ranks-per-host 2 --workers 4

With ``--ranks-per-host P`` the link is each host's, shared by its P ranks,
and the plan also predicts the hierarchical all-reduce (reduce through
shared memory inside the host, ``--local-bandwidth-gbit``, then across
hosts). After the table it says what it would change in the defaults for
this link, and why: the bucket size, the hierarchy, and fp16 compression
where the exposed communication is a large share of the step and halving
the bytes shortens the step (a suggestion: it rounds the gradients).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from dp_plugin.cli import int_list
from dp_plugin.cli.alphabeta import (
    Link,
    MiB,
    Prediction,
    best_threshold,
    fit_link,
    predict,
    predict_powersgd,
)
from dp_plugin.cli.shapes import MODELS, model_shapes, param_count
from dp_plugin.config import Config
from dp_plugin.reduce.powersgd import PowerSGDSettings, wire_numel

HELP = "predict step time and scaling efficiency at 8-1024 workers (alpha-beta model)"
DEFAULT_WORKERS = "8,16,32,64,128,256,512,1024"
LOCAL_GBIT = 40.0
"""Default bandwidth between the ranks of one host (a shared-memory all-reduce
of large buffers on a server; measure yours with ``dp-plugin bench``)."""
WORTH = 0.05
"""A change is suggested when it shortens the predicted step by this share."""
BUSY = 0.10
"""fp16 is suggested only when exposed communication exceeds this share of the step."""
BETTER = 0.01
"""A bucket size is named for a worker count where it shortens the predicted step
against the default plan by this share (the model's tie rule is 0.5%)."""
POWERSGD_GFLOPS = 20.0
"""Default speed of PowerSGD's matrix products (float32 on one CPU core)."""
POWERSGD_GBYTES = 5.0
"""Default speed of PowerSGD's work on one rank, in bytes its passes read
and write per second (``dp_plugin.reduce.powersgd.touched_bytes``) while
every rank of the host runs it at once: CPU ranks sharing cores (measured:
BENCHMARKS.md, "PowerSGD", the ``plan`` item). At small ranks these passes,
not the products, set its compute time (``dp_plugin.reduce.powersgd.PASSES``)."""
TYPICAL_RANKS_PER_HOST = 8
"""The assumed node without ``--ranks-per-host``: 8 GPUs, one rank each."""


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


_workers = int_list("worker counts", 1, "8,64,512")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, choices=sorted(MODELS),
                        help="gradient shape list (float32)")
    parser.add_argument("--compute-ms", type=_positive, required=True,
                        help="forward + backward time of one step at one worker, ms")
    link = parser.add_argument_group("link (a sweep result or both numbers)")
    link.add_argument("--sweep", type=Path, help="results.json written by dp-plugin bench")
    link.add_argument("--engine", help="engine in the sweep (default: the first one)")
    link.add_argument("--fit-size", type=int,
                      help="fit on the sweep's rows at this world size (default: the largest)")
    link.add_argument("--alpha-us", type=float, help="latency per ring step, microseconds")
    link.add_argument("--bandwidth-gbit", type=_positive,
                      help="link bandwidth, Gbit/s")
    parser.add_argument("--workers", type=_workers, default=_workers(DEFAULT_WORKERS),
                        help=f"worker counts (default {DEFAULT_WORKERS})")
    parser.add_argument("--threshold-mib", type=_positive, default=None,
                        help="one bucket size for every bucket, as DP_PLUGIN_FUSION_THRESHOLD "
                             "(default: dp_plugin's plan, a 1 MiB first bucket, then 25 MiB "
                             "or a quarter of the gradient, whichever is smaller)")
    parser.add_argument("--backward-fraction", type=_positive, default=2 / 3,
                        help="share of compute that is backward (default 2/3)")
    parser.add_argument("--ready-by", choices=("tensors", "bytes"), default="tensors",
                        help="gradients ready evenly per tensor (default) or per byte")
    parser.add_argument("--ranks-per-host", type=int, default=None,
                        help="ranks on each host; the link is the host's (default "
                             f"{TYPICAL_RANKS_PER_HOST}, a typical GPU node, where it divides "
                             "every worker count; the plan prints what it assumed)")
    parser.add_argument("--local-bandwidth-gbit", type=_positive, default=LOCAL_GBIT,
                        help="bandwidth between the ranks of one host (shared memory), "
                             f"Gbit/s (default {LOCAL_GBIT:g})")
    powersgd = parser.add_argument_group("PowerSGD (dp_plugin.torch.powersgd)")
    powersgd.add_argument("--powersgd-rank", type=int, default=None,
                          help="also predict the step with PowerSGD at this rank: bytes on the "
                               "link from the formula, two all-reduces and the matrix products "
                               "per bucket")
    powersgd.add_argument("--powersgd-gflops", type=_positive, default=POWERSGD_GFLOPS,
                          help="speed of PowerSGD's matrix products, GFLOP/s (default "
                               f"{POWERSGD_GFLOPS:g}: a CPU core; a GPU does thousands)")
    powersgd.add_argument("--powersgd-gbytes", type=_positive, default=POWERSGD_GBYTES,
                          help="speed of PowerSGD's passes over the gradients on one rank while "
                               "the host's ranks all run them, GB/s (default "
                               f"{POWERSGD_GBYTES:g}: CPU ranks sharing cores; a core alone "
                               "~12; a GPU: over 1000)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def link_from_sweep(path: Path, engine: str | None,
                    fit_size: int | None = None) -> tuple[Link, str]:
    """Fit the link on the sweep's rows for ``engine`` at ``fit_size`` workers
    (default: the largest world size it has)."""
    try:
        data = json.loads(path.read_text())
        rows = data["sweep"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--sweep {path}: not a dp-plugin bench results.json ({exc}); "
                         "run `dp-plugin bench --out DIR` and pass DIR/results.json") from None
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    engine = engine or (engines[0] if engines else None)
    mine = [r for r in rows if r["engine"] == engine and r["size"] >= 2]
    if not mine:
        raise SystemExit(f"--engine {engine!r}: the sweep in {path} has no rows for it at "
                         f"2 or more workers; it has {', '.join(engines) or 'no engines'}")
    sizes = sorted({r["size"] for r in mine})
    n = sizes[-1] if fit_size is None else fit_size
    if n not in sizes:
        raise SystemExit(f"--fit-size {fit_size}: the sweep has {engine} at world sizes "
                         f"{', '.join(map(str, sizes))} only")
    link = fit_link([(r["bytes"], r["time_s"]) for r in mine if r["size"] == n], n)
    return link, f"fitted on {engine} at {n} workers from {path}"


def resolve_link(args: argparse.Namespace) -> tuple[Link, str]:
    if args.sweep is not None:
        return link_from_sweep(args.sweep, args.engine, args.fit_size)
    if args.alpha_us is None or args.bandwidth_gbit is None:
        raise SystemExit("dp-plugin plan: give --sweep RESULTS.json, or both --alpha-us and "
                         "--bandwidth-gbit (e.g. --alpha-us 10 --bandwidth-gbit 25)")
    if args.alpha_us < 0:
        raise SystemExit(f"--alpha-us {args.alpha_us}: latency cannot be negative")
    link = Link(alpha=args.alpha_us * 1e-6, beta=args.bandwidth_gbit * 1e9 / 8)
    return link, "from the command line"


def ranks_per_host(given: int | None, workers: list[int]) -> tuple[int, str]:
    """The ranks per host to model and, where it was not given, the assumption
    to print: 8 (a typical GPU node), or the largest number below it that
    divides every worker count."""
    if given is not None:
        if given < 1 or any(n % given for n in workers):
            raise SystemExit(f"--ranks-per-host {given}: must be >= 1 and divide every worker "
                             f"count ({', '.join(map(str, workers))})")
        return given, ""
    per_host = math.gcd(TYPICAL_RANKS_PER_HOST, *workers)
    why = ("a typical 8-GPU node" if per_host == TYPICAL_RANKS_PER_HOST else
           f"the largest count up to {TYPICAL_RANKS_PER_HOST} that divides every worker count")
    return per_host, (f"assumed {per_host} ranks per host ({why}); give --ranks-per-host "
                      "for your hosts")


def default_plan(sizes: list[int], threshold_mib: float | None) -> tuple[int, int | None, str]:
    """(bucket cap, first bucket cap, words): dp_plugin's default plan for
    these gradients (``Config.bucket_caps``), or one size for every bucket."""
    if threshold_mib is not None:
        return int(threshold_mib * MiB), None, f"buckets of {threshold_mib:g} MiB"
    cap, first = Config().bucket_caps(total_bytes=sum(sizes))
    first_text = "" if first is None else f"first bucket {first / MiB:g} MiB, then "
    return cap, first, f"dp_plugin's default plan ({first_text}{cap / MiB:.3g} MiB)"


def run(args: argparse.Namespace) -> int:
    if args.backward_fraction > 1:
        raise SystemExit(f"--backward-fraction {args.backward_fraction}: must be in (0, 1]")
    per_host, assumed = ranks_per_host(args.ranks_per_host, args.workers)
    link, source = resolve_link(args)
    local = Link(alpha=5e-6, beta=args.local_bandwidth_gbit * 1e9 / 8) if per_host > 1 else None
    shapes = model_shapes(args.model)
    sizes = [4 * math.prod(shape) for _, shape in shapes]
    compute = args.compute_ms / 1e3
    threshold, first, plan_words = default_plan(sizes, args.threshold_mib)
    rows, better = [], []
    for n in args.workers:
        p = predict(sizes, compute, n, link, threshold, args.backward_fraction, args.ready_by,
                    first_threshold=first)
        best = best_threshold(sizes, compute, n, link, args.backward_fraction, args.ready_by)
        gain = 1 - best.step_s / p.step_s
        rows.append({"workers": n, "buckets": p.buckets, "comm_ms": p.comm_s * 1e3,
                     "exposed_ms": p.exposed_s * 1e3, "step_ms": p.step_s * 1e3,
                     "efficiency": p.efficiency,
                     # None: no single size beats the plan predicted (its small first
                     # bucket can win, and a set threshold drops it)
                     "best_threshold_mib": best.threshold / MiB if gain > 0 else None,
                     "best_efficiency": max(best.efficiency, p.efficiency)})
        if gain >= BETTER:
            better.append({"workers": n, "threshold_mib": best.threshold / MiB,
                           "fusion_threshold": best.threshold, "step_ms": best.step_s * 1e3,
                           "default_step_ms": p.step_s * 1e3, "shorter": gain})
    lowrank = powersgd_rows(args, shapes, compute, link, threshold, first, per_host, local)
    n = args.workers[-1]
    choice = suggest(sizes, compute, n, link, args, per_host, local, plan_words)
    if args.json:
        json.dump({"model": args.model, "alpha_s": link.alpha, "beta_bytes_s": link.beta,
                   "plan": {"threshold_bytes": threshold, "first_threshold_bytes": first},
                   "ranks_per_host": per_host, "assumed": assumed, "rows": rows,
                   "better_buckets": better, "suggested": choice,
                   **({} if lowrank is None else {"powersgd": lowrank})}, sys.stdout, indent=1)
        print()
        return 0
    hosts = f", {per_host} ranks per host sharing it" if per_host > 1 else ""
    print(f"{args.model}: {param_count(shapes) / 1e6:.1f} M parameters in {len(shapes)} "
          f"tensors ({sum(sizes) / MiB:.0f} MiB of float32 gradients), compute "
          f"{args.compute_ms:g} ms per step\nlink: alpha {link.alpha * 1e6:.1f} us, bandwidth "
          f"{link.beta * 8 / 1e9:.2f} Gbit/s ({source}){hosts}; {plan_words}, flat ring")
    if assumed:
        print(assumed)
    print(f"\n{'workers':>7} {'buckets':>7} {'all-reduce':>11} {'exposed':>9} {'step':>9} "
          f"{'efficiency':>10} {'best bucket':>11} {'its eff.':>8}")
    for r in rows:
        print(f"{r['workers']:>7} {r['buckets']:>7} {r['comm_ms']:>8.1f} ms "
              f"{r['exposed_ms']:>6.1f} ms {r['step_ms']:>6.1f} ms {r['efficiency']:>9.1%} "
              f"{_mib(r['best_threshold_mib']):>11} {r['best_efficiency']:>7.1%}")
    if better:
        print(f"\na better bucket size than {plan_words}:")
        for b in better:
            print(f"  - at {b['workers']} workers: DP_PLUGIN_FUSION_THRESHOLD="
                  f"{b['fusion_threshold']} ({b['threshold_mib']:g} MiB), step "
                  f"{b['step_ms']:.1f} ms against {b['default_step_ms']:.1f} ms "
                  f"({b['shorter']:.0%} shorter)")
    else:
        print(f"\nno bucket size shortens the step by {BETTER:.0%} or more against "
              f"{plan_words} at these worker counts")
    if lowrank is not None:
        print_powersgd(lowrank)
    print(f"\nsuggested at {n} workers: step {choice['step_ms']:.1f} ms "
          f"(efficiency {choice['efficiency']:.1%})")
    for line in choice["why"]:
        print(f"  - {line}")
    return 0


def _mib(value: float | None) -> str:
    return "this plan" if value is None else f"{value:g} MiB"


def suggest(sizes: list[int], compute: float, n: int, link: Link, args: argparse.Namespace,
            per_host: int, local: Link | None, plan_words: str) -> dict[str, Any]:
    """What to change in the defaults at ``n`` workers on this link: the bucket
    size, hierarchy (when several ranks share a host) and fp16 compression,
    each with the prediction that justifies it (``why``); also the JSON
    output's ``suggested``."""
    frac, ready = args.backward_fraction, args.ready_by

    def best(wire: float, hier: bool) -> Prediction:
        return best_threshold([int(s * wire) for s in sizes], compute, n, link, frac, ready,
                              per_host, local if hier else None)

    why: list[str] = []
    flat = best(1.0, False)
    chosen, hierarchical = flat, False
    if local is not None:
        hier = best(1.0, True)
        gain = 1 - hier.step_s / flat.step_s
        if gain >= WORTH:
            chosen, hierarchical = hier, True
            why.append(f"hierarchical all-reduce: step {hier.step_s * 1e3:.1f} ms against "
                       f"{flat.step_s * 1e3:.1f} ms flat ({gain:.0%} shorter: the host link "
                       f"carries 2(H-1)/H of the bytes instead of 2(n-1)/n)")
        else:
            why.append(f"flat all-reduce: hierarchical would save only {gain:.0%} "
                       f"(< {WORTH:.0%})")
    compression = "none"
    exposed = chosen.exposed_s / chosen.step_s
    half = best(0.5, hierarchical)
    gain = 1 - half.step_s / chosen.step_s
    if exposed > BUSY and gain >= WORTH:
        compression = "fp16"
        why.append(f"compression fp16: {exposed:.0%} of the step is communication nobody "
                   f"hides; halving the bytes makes the step {half.step_s * 1e3:.1f} ms "
                   f"({gain:.0%} shorter; it rounds gradients to fp16, check convergence)")
        chosen = half
    else:
        why.append(f"no compression: exposed communication is {exposed:.0%} of the step and "
                   f"fp16 would save {max(gain, 0):.0%}")
    why.insert(0, f"bucket size {chosen.threshold / MiB:g} MiB (DP_PLUGIN_FUSION_THRESHOLD="
                  f"{chosen.threshold}; against {plan_words}): the shortest predicted step "
                  "among 256 KiB-512 MiB")
    return {"workers": n, "threshold_mib": chosen.threshold / MiB,
            "hierarchical": hierarchical, "compression": compression,
            "step_ms": chosen.step_s * 1e3, "efficiency": chosen.efficiency, "why": why}



def powersgd_rows(args: argparse.Namespace, shapes: list[tuple[str, tuple[int, ...]]],
                  compute: float, link: Link, threshold: int, first: int | None,
                  per_host: int, local: Link | None) -> dict[str, Any] | None:
    """The PowerSGD prediction at ``--powersgd-rank`` (None without it): bytes
    on the link per step from the formula, and each worker count's step
    beside the plain one on the same buckets and the same path: hierarchical
    where several ranks share a host (the gloo engine's automatic choice),
    else the flat ring."""
    if args.powersgd_rank is None:
        return None
    try:
        settings = PowerSGDSettings(rank=args.powersgd_rank)
    except ValueError as exc:
        raise SystemExit(f"--powersgd-rank {args.powersgd_rank}: {exc}") from None
    tensor_shapes = [shape for _, shape in shapes]
    sizes = [4 * math.prod(shape) for shape in tensor_shapes]
    wire = wire_numel(tensor_shapes, settings)
    out = []
    for n in args.workers:
        hier = local if per_host > 1 and n > per_host else None
        p = predict_powersgd(tensor_shapes, compute, n, link, threshold, settings,
                             args.powersgd_gflops * 1e9, args.powersgd_gbytes * 1e9,
                             args.backward_fraction, args.ready_by, first_threshold=first,
                             per_host=per_host, local=hier)
        plain = predict(sizes, compute, n, link, threshold, args.backward_fraction,
                        args.ready_by, per_host, hier, first_threshold=first)
        out.append({"workers": n, "path": "flat ring" if hier is None else "hierarchical",
                    "comm_ms": p.comm_s * 1e3, "step_ms": p.step_s * 1e3,
                    "efficiency": p.efficiency, "plain_step_ms": plain.step_s * 1e3})
    return {"rank": settings.rank, "dense_bytes": 4 * wire.dense, "wire_bytes": 4 * wire.total,
            "p_bytes": 4 * wire.p, "q_bytes": 4 * wire.q, "uncompressed_bytes": 4 * wire.whole,
            "ratio": wire.ratio, "gflops": args.powersgd_gflops,
            "gbytes": args.powersgd_gbytes, "rows": out}


def print_powersgd(lowrank: dict[str, Any]) -> None:
    print(f"\nPowerSGD at rank {lowrank['rank']}: {lowrank['wire_bytes'] / MiB:.2f} MiB per "
          f"all-reduce step instead of {lowrank['dense_bytes'] / MiB:.1f} MiB "
          f"({lowrank['ratio']:.1f}x fewer: P {lowrank['p_bytes'] / MiB:.2f} + Q "
          f"{lowrank['q_bytes'] / MiB:.2f} + uncompressed {lowrank['uncompressed_bytes'] / MiB:.2f}"
          f" MiB); matrix products at {lowrank['gflops']:g} GFLOP/s, passes over the "
          f"gradients at {lowrank['gbytes']:g} GB/s, on the rank's device in series with "
          "backward")
    print(f"{'workers':>7} {'path':>12} {'all-reduce':>11} {'step':>9} {'efficiency':>10} "
          f"{'plain step':>10}")
    for r in lowrank["rows"]:
        print(f"{r['workers']:>7} {r['path']:>12} {r['comm_ms']:>8.1f} ms {r['step_ms']:>6.1f} ms "
              f"{r['efficiency']:>9.1%} {r['plain_step_ms']:>7.1f} ms")
