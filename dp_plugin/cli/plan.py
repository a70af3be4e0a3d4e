"""``dp-plugin plan``: predicted step time and scaling efficiency at scale.

An alpha-beta model of ring all-reduce with bucketed overlap (see
``dp_plugin.cli.alphabeta``): the link's latency and bandwidth come from a
``dp-plugin bench`` result (``--sweep results.json``) or the command line
(``--alpha-us``, ``--bandwidth-gbit``); the model's gradients from a known
shape list (``--model``); its compute time per step (forward + backward at
one worker) from ``--compute-ms``. For each worker count it prints the
predicted step, how much of it is communication nobody hides, the scaling
efficiency, and the bucket size that would minimise the step.

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
from dp_plugin.cli.alphabeta import Link, MiB, Prediction, best_threshold, fit_link, predict
from dp_plugin.cli.shapes import MODELS, model_shapes, param_count

HELP = "predict step time and scaling efficiency at 8-1024 workers (alpha-beta model)"
DEFAULT_WORKERS = "8,16,32,64,128,256,512,1024"
LOCAL_GBIT = 40.0
"""Default bandwidth between the ranks of one host (a shared-memory all-reduce
of large buffers on a server; measure yours with ``dp-plugin bench``)."""
WORTH = 0.05
"""A change is suggested when it shortens the predicted step by this share."""
BUSY = 0.10
"""fp16 is suggested only when exposed communication exceeds this share of the step."""


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
    parser.add_argument("--threshold-mib", type=_positive, default=64.0,
                        help="bucket size to predict with (default 64, Horovod's)")
    parser.add_argument("--backward-fraction", type=_positive, default=2 / 3,
                        help="share of compute that is backward (default 2/3)")
    parser.add_argument("--ready-by", choices=("tensors", "bytes"), default="tensors",
                        help="gradients ready evenly per tensor (default) or per byte")
    parser.add_argument("--ranks-per-host", type=int, default=1,
                        help="ranks on each host; the link is the host's (default 1)")
    parser.add_argument("--local-bandwidth-gbit", type=_positive, default=LOCAL_GBIT,
                        help="bandwidth between the ranks of one host (shared memory), "
                             f"Gbit/s (default {LOCAL_GBIT:g})")
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


def run(args: argparse.Namespace) -> int:
    if args.backward_fraction > 1:
        raise SystemExit(f"--backward-fraction {args.backward_fraction}: must be in (0, 1]")
    per_host = args.ranks_per_host
    if per_host < 1 or any(n % per_host for n in args.workers):
        raise SystemExit(f"--ranks-per-host {per_host}: must be >= 1 and divide every worker "
                         f"count ({', '.join(map(str, args.workers))})")
    link, source = resolve_link(args)
    local = Link(alpha=5e-6, beta=args.local_bandwidth_gbit * 1e9 / 8) if per_host > 1 else None
    shapes = model_shapes(args.model)
    sizes = [4 * math.prod(shape) for _, shape in shapes]
    compute = args.compute_ms / 1e3
    threshold = int(args.threshold_mib * MiB)
    rows = []
    for n in args.workers:
        p = predict(sizes, compute, n, link, threshold, args.backward_fraction, args.ready_by)
        best = best_threshold(sizes, compute, n, link, args.backward_fraction, args.ready_by)
        rows.append({"workers": n, "buckets": p.buckets, "comm_ms": p.comm_s * 1e3,
                     "exposed_ms": p.exposed_s * 1e3, "step_ms": p.step_s * 1e3,
                     "efficiency": p.efficiency, "best_threshold_mib": best.threshold / MiB,
                     "best_efficiency": best.efficiency})
    n = args.workers[-1]
    choice = suggest(sizes, compute, n, link, args, per_host, local)
    if args.json:
        json.dump({"model": args.model, "alpha_s": link.alpha, "beta_bytes_s": link.beta,
                   "rows": rows, "suggested": choice}, sys.stdout, indent=1)
        print()
        return 0
    hosts = f", {per_host} ranks per host sharing it" if per_host > 1 else ""
    print(f"{args.model}: {param_count(shapes) / 1e6:.1f} M parameters in {len(shapes)} "
          f"tensors ({sum(sizes) / MiB:.0f} MiB of float32 gradients), compute "
          f"{args.compute_ms:g} ms per step\nlink: alpha {link.alpha * 1e6:.1f} us, bandwidth "
          f"{link.beta * 8 / 1e9:.2f} Gbit/s ({source}){hosts}; buckets of "
          f"{args.threshold_mib:g} MiB, flat ring\n")
    print(f"{'workers':>7} {'buckets':>7} {'all-reduce':>11} {'exposed':>9} {'step':>9} "
          f"{'efficiency':>10} {'best bucket':>11} {'its eff.':>8}")
    for r in rows:
        print(f"{r['workers']:>7} {r['buckets']:>7} {r['comm_ms']:>8.1f} ms "
              f"{r['exposed_ms']:>6.1f} ms {r['step_ms']:>6.1f} ms {r['efficiency']:>9.1%} "
              f"{r['best_threshold_mib']:>7g} MiB {r['best_efficiency']:>7.1%}")
    print(f"\nsuggested at {n} workers: step {choice['step_ms']:.1f} ms "
          f"(efficiency {choice['efficiency']:.1%})")
    for line in choice["why"]:
        print(f"  - {line}")
    return 0


def suggest(sizes: list[int], compute: float, n: int, link: Link, args: argparse.Namespace,
            per_host: int, local: Link | None) -> dict[str, Any]:
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
    why.insert(0, f"bucket size {chosen.threshold / MiB:g} MiB (default "
                  f"{args.threshold_mib:g}): the shortest predicted step among "
                  "256 KiB-512 MiB")
    return {"workers": n, "threshold_mib": chosen.threshold / MiB,
            "hierarchical": hierarchical, "compression": compression,
            "step_ms": chosen.step_s * 1e3, "efficiency": chosen.efficiency, "why": why}

