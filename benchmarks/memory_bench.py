"""Memory of ``DistributedOptimizer`` over a long run: resident memory per
100 steps, fusion buffer bytes against the threshold and the gradients.

The memory goals: resident memory flat over 1,000 steps; fusion
memory at most twice the threshold (counted as what the fusion buffers add
beyond the gradients themselves: with gradients as bucket views the buffers
*are* the gradients' storage); no allocation per step once warm (the test
``tests/torch/test_grad_views.py`` checks buffer identity and data pointers).

Each configuration trains an MLP (8 layers of 512, 2.1 M parameters, 8.4 MB
of float32 gradients, SGD with momentum) for ``--steps`` steps on 2 gloo
workers with a 2 MiB fusion threshold (several buckets), then prints a
markdown table:

    python benchmarks/memory_bench.py                 # 1000 steps, views and copies
    python benchmarks/memory_bench.py --steps 300 --configs views

Resident memory is sampled on rank 0 from /proc/self/statm after steps 100,
200, ...; "growth" is the last sample minus the one at step 100 (the first
100 steps warm up the allocator and the bucket plan). The scheduler keeps
the ``StepStats`` of the last 1,000 steps (``StatsHistory``, ~0.3 KB each),
so a few hundred KB of growth up to step 1,000 is that bounded history.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from itertools import pairwise
from typing import Any

from dp_plugin.cli.jobs import clean_env, run_jobs, torchrun_jobs

CONFIGS = {"views": "1", "copies": "0"}
"""Config name -> DP_PLUGIN_GRADIENT_AS_BUCKET_VIEW."""
THRESHOLD = 2 << 20
LAYERS, WIDTH, BATCH = 8, 512, 32


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fusion_bytes(opt: Any, params: list[Any]) -> tuple[int, int]:
    """(bytes of the fusion buffers, of those also the storage of a ``.grad``):
    the pinned buffers (those gradients live in) and the slabs the others
    borrow (``dp_plugin.reduce.bucket``)."""
    reducer = opt._dp.reducer
    flats = [b.flat for b in reducer.buckets if b.pinned and b.flat is not None]
    flats += [s.storage for s in reducer.slabs if s.storage is not None]
    total = sum(f.numel() * f.element_size() for f in flats)

    def inside(grad: Any) -> bool:
        start = grad.data_ptr()
        return any(f.data_ptr() <= start < f.data_ptr() + f.numel() * f.element_size()
                   for f in flats)

    shared = sum(p.grad.numel() * p.grad.element_size() for p in params if inside(p.grad))
    return total, shared


def worker(steps: int) -> None:
    import torch

    import dp_plugin.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    params = list(model.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=1e-3, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(hvd.rank())
    samples = []
    for step in range(1, steps + 1):
        x = torch.randn(BATCH, WIDTH, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step % 100 == 0:
            samples.append((step, rss_bytes()))
    fused, shared = fusion_bytes(opt, params)
    grads = sum(p.numel() * p.element_size() for p in params)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({
            "samples": samples, "fusion_bytes": fused, "shared_bytes": shared,
            "grad_bytes": grads, "buckets": len(opt._dp.reducer.plan)}), flush=True)
    hvd.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.steps)
        return
    if args.steps < 200:
        raise SystemExit(f"--steps must be at least 200 (samples every 100), got {args.steps}")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(args.steps)]
    rows = []
    for name in args.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"unknown config {name!r}; choose from {', '.join(CONFIGS)}")
        env = clean_env(DP_PLUGIN_ENGINE="gloo", DP_PLUGIN_FUSION_THRESHOLD=str(THRESHOLD),
                        DP_PLUGIN_GRADIENT_AS_BUCKET_VIEW=CONFIGS[name])
        r = run_jobs(name, torchrun_jobs(cmd, 2, env), args.timeout)
        print(f"{name}: done", file=sys.stderr, flush=True)
        rows.append((name, r))
    report(rows, args.steps)


def report(rows: list[tuple[str, dict[str, Any]]], steps: int) -> None:
    mib = 1 << 20
    print(f"\nMLP {LAYERS}x{WIDTH}, 2 gloo workers, fusion threshold {THRESHOLD / mib:g} MiB, "
          f"{steps} steps; resident memory of rank 0\n")
    print("| config | buckets | gradients | fusion buffers | added beyond the gradients "
          "| added / threshold | RSS at step 100 | RSS at the end | growth | lowest - highest "
          "sample | growth per 100 steps (median) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows:
        added = r["fusion_bytes"] - r["shared_bytes"]
        rss = [b for _, b in r["samples"]]
        per_100 = statistics.median(b - a for a, b in pairwise(rss))
        print(f"| {name} | {r['buckets']} | {r['grad_bytes'] / mib:.2f} MiB "
              f"| {r['fusion_bytes'] / mib:.2f} MiB | {added / mib:.2f} MiB "
              f"| {added / THRESHOLD:.2f} | {rss[0] / mib:.1f} MiB | {rss[-1] / mib:.1f} MiB "
              f"| {(rss[-1] - rss[0]) / 1024:+.0f} KiB | {min(rss) / mib:.1f} - "
              f"{max(rss) / mib:.1f} MiB | {per_100 / 1024:+.0f} KiB |")
    for name, r in rows:
        series = ", ".join(f"{b / mib:.1f}" for _, b in r["samples"])
        print(f"\n{name}, RSS (MiB) every 100 steps from step 100: {series}")


if __name__ == "__main__":
    main()
