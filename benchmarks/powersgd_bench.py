#!/usr/bin/env python3
"""PowerSGD on the rehearsal cluster: step time and bytes on the link, with BERT-base's gradients.

Starts scripts/cluster.py once (``--hosts`` x ``--ranks-per-host``, a
shaped ``--link``) and, on every rank, steps a model whose parameters have
BERT-base's gradient shapes (``dp_plugin.cli.shapes.bert``, 109.5 M
parameters; ``--layers`` fewer for a quick run) and whose backward costs
next to nothing (the loss is a fixed random weighting of the parameters),
so the step is the gradient reduction itself. One block of steps per
method, the blocks interleaved so that outside load hits all alike:

- ``dp``: ``hvd.DistributedOptimizer``, plain all-reduces (the anchor);
- ``dp powersgd``: the same with ``PowerSGDHook(rank=R, start_iter=0)``;
- ``ddp powersgd``: ``DistributedDataParallel`` over the Gloo group
  dp_plugin's engine made, with torch's ``powerSGD_hook`` at the same rank
  (``start_powerSGD_iter=2``; the warm-up steps are not timed), in one
  bucket (``--ddp-bucket-mb 1000``): torch's hook starts each bucket's
  next all-reduce from the last one's completion callback, so with several
  buckets on Gloo the ranks issued them in different orders (seen here at
  2 x 2 with 25 MB buckets: Gloo's "Received data size doesn't match
  expected size", every rank aborted). Its gradients are views of that
  bucket (``gradient_as_bucket_view``), as dp_plugin's are of its fusion
  buffer: one copy of the model less.

Per method: median step (slowest rank), its ratio to ``dp``, the bytes
each host's link sent per step (the host's ``eth0`` counter, read by its
local rank 0 before and after the block), the formula's bytes per step
(``dp_plugin.reduce.powersgd.wire_numel``: what one all-reduce moves; the link
carries a multiple of it, 1x on the hierarchical path at 2 hosts, 1.5x on
a flat ring of 4), and the step ``dp-plugin plan`` predicts
(``alphabeta.predict`` / ``predict_powersgd`` with the measured no-comm
step as compute, the shaped rate, the speed of the hook's work measured on
the ranks beside the PowerSGD steps (one BERT matrix through the hook's
operations, every rank at once, the slowest rank's: ranks that share a
host's cores share them in the hook too), and the path the gloo engine
takes: hierarchical when each host holds several ranks). On failure it
prints each rank's own traceback. Needs root (namespaces).

    sudo .venv/bin/python benchmarks/powersgd_bench.py
    sudo .venv/bin/python benchmarks/powersgd_bench.py --layers 2 --steps 3 --blocks 1
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CLUSTER = ROOT / "scripts" / "cluster.py"
METHODS = ("dp", "dp powersgd", "ddp powersgd")
ALPHA_S = 50e-6
IFACE = "eth0"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=2)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--layers", type=int, default=12, help="BERT layers (12: BERT-base)")
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD's rank")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per method (per block)")
    ap.add_argument("--blocks", type=int, default=2, help="interleaved blocks per method")
    ap.add_argument("--gflops", type=float, default=None,
                    help="the plan's speed of the matrix products (default: its own)")
    ap.add_argument("--gbytes", type=float, default=None,
                    help="the plan's speed of the hook's work, GB/s of touched_bytes (default: "
                         "measured on the ranks during the run, the slowest rank's)")
    ap.add_argument("--timeout", type=float, default=1500.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                    help="methods to run (the no-communication step always runs too)")
    ap.add_argument("--ddp-bucket-mb", type=float, default=1000.0,
                    help="DDP's bucket_cap_mb for torch's powerSGD_hook (one bucket: see above)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--errors", type=Path, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def tx_bytes() -> int:
    """This host's link: bytes sent so far (-1 outside the cluster)."""
    try:
        return int(Path(f"/sys/class/net/{IFACE}/statistics/tx_bytes").read_text())
    except OSError:
        return -1


def worker(args: argparse.Namespace) -> int:
    """One rank; its traceback, if it fails, goes to ``--errors``/rank<N>.txt
    for the launching side to print (the launchers' output keeps only the
    last rank's last lines, and torchrun its own summary)."""
    try:
        return _worker(args)
    except BaseException:
        if args.errors is not None:
            name = f"rank{os.environ.get('RANK', os.getpid())}.txt"
            (args.errors / name).write_text(
                f"host {os.environ.get('GROUP_RANK', '?')}, local rank "
                f"{os.environ.get('LOCAL_RANK', '?')}, peak RSS {peak_rss_mib():.0f} MiB\n"
                + traceback.format_exc())
        raise


def peak_rss_mib() -> float:
    """This process's peak resident memory (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    import dp_plugin.torch as hvd
    from dp_plugin.cli.shapes import bert
    from dp_plugin.reduce.powersgd import PowerSGDSettings, touched_bytes
    from dp_plugin.torch.powersgd import PowerSGDHook, orthogonalize_

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    shapes = bert(layers=args.layers)

    # The loss's weights: views of one random buffer the size of the largest
    # parameter (the word embeddings), not a second copy of the model.
    gen = torch.Generator().manual_seed(1 + rank)
    pool = torch.randn(max(math.prod(s) for _, s in shapes), generator=gen)
    weights = [pool[:math.prod(s)].view(s) for _, s in shapes]

    class Shapes(torch.nn.Module):
        """Parameters of BERT's shapes; the loss weights each by a fixed
        random tensor, so backward is one multiply per parameter."""

        def __init__(self) -> None:
            super().__init__()
            gen = torch.Generator().manual_seed(0)
            self.params = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for _, s in shapes])

        def forward(self) -> torch.Tensor:
            return sum((p * w).sum() for p, w in zip(self.params, weights, strict=True))

    def make(method: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = Shapes()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        if method == "ddp powersgd":
            model = torch.nn.parallel.DistributedDataParallel(  # gradients in its bucket,
                model, bucket_cap_mb=args.ddp_bucket_mb,  # as dp_plugin's in its buffer
                gradient_as_bucket_view=True)
            state = torch_psgd.PowerSGDState(process_group=None,
                                             matrix_approximation_rank=args.rank,
                                             start_powerSGD_iter=2)
            model.register_comm_hook(state, torch_psgd.powerSGD_hook)
        elif method != "local":
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            if method == "dp powersgd":
                opt.register_comm_hook(PowerSGDHook(rank=args.rank, start_iter=0))
        return model, opt

    def hook_work_gbytes() -> float:
        """The speed of the hook's own work on this rank, in the plan's
        terms: one BERT feed-forward matrix (3072 x 768) put through every
        operation ``PowerSGDHook`` runs on a compressed member (add the
        error, keep it, orthogonalize ``Q``, ``M Q``, orthogonalize ``P``,
        ``P^T M``, ``P Q^T``, subtract it from the error) for half a second,
        ``touched_bytes`` of that matrix over the time per round. Every rank
        starts it after a barrier, so a host's ranks run it at once, as they
        run the hook (on a CPU host with more ranks than cores they share the
        cores: 4 ranks on 2 cores measured ~5 GB/s each, one alone ~12)."""
        n, m, r = 3072, 768, min(args.rank, 768)
        mat, err = torch.randn(n, m), torch.zeros(n, m)
        qt, p = torch.randn(r, m), torch.empty(n, r)

        def one_round() -> None:
            mat.add_(err)
            err.copy_(mat)
            orthogonalize_(qt.mT, 1e-8)
            torch.matmul(mat, qt.mT, out=p)
            orthogonalize_(p, 1e-8)
            torch.matmul(p.mT, mat, out=qt)
            torch.matmul(p, qt, out=mat)
            err.sub_(mat, alpha=1.0 / size)

        one_round()
        hvd.barrier()
        rounds, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.5:
            one_round()
            rounds += 1
        per_round = (time.perf_counter() - t0) / rounds
        return touched_bytes([(n, m)], PowerSGDSettings(rank=args.rank)) / per_round / 1e9

    methods = ["local", *args.methods]
    passes: list[float] = []
    times: dict[str, list[float]] = {m: [] for m in methods}
    sent: dict[str, list[float]] = {m: [] for m in methods}
    counts_link = int(os.environ.get("LOCAL_RANK", "0")) == 0
    for block in range(args.blocks):
        order = methods if block % 2 == 0 else list(reversed(methods))
        for method in order:
            # Built afresh for each block, and dropped after it: at BERT-base's
            # size a setup holds about 2 GB per rank (parameters, gradients,
            # fusion buffers, PowerSGD's errors), and all four at once on each
            # of 4 ranks ran the 24 GiB machine out of memory.
            if method == "dp powersgd":  # measured beside the steps it explains
                passes.append(hvd.allreduce(torch.tensor([hook_work_gbytes()]), op=hvd.Min,
                                            name="hook_work").item())
            model, opt = make(method)
            for step in range(args.steps + 2):
                hvd.barrier()
                if step == 2:
                    before = tx_bytes()
                t0 = time.perf_counter()
                model().backward()
                opt.step()
                opt.zero_grad()
                dt = hvd.allreduce(torch.tensor([time.perf_counter() - t0]), op=hvd.Max,
                                   name="slowest")
                if step >= 2:  # two warm-up steps per block (torch's hook: plain ones)
                    times[method].append(dt.item())
            hvd.barrier()
            if counts_link and before >= 0:
                sent[method].append((tx_bytes() - before) / args.steps)
            del model, opt
            gc.collect()
    peak = hvd.allreduce(torch.tensor([peak_rss_mib()]), op=hvd.Max, name="peak_rss")
    per_host = [statistics.median(v) if v else -1.0 for v in sent.values()]
    table = torch.tensor(per_host, dtype=torch.float64)
    # Every host's local rank 0 counted its link; rank 0 reports the largest.
    table = hvd.allreduce(table if counts_link else torch.full_like(table, -1.0),
                          op=hvd.Max, name="link")
    if rank == 0:
        from dp_plugin.cli.alphabeta import Link, predict, predict_powersgd
        from dp_plugin.cli.plan import LOCAL_GBIT, POWERSGD_GBYTES, POWERSGD_GFLOPS
        from dp_plugin.config import Config
        from dp_plugin.reduce.powersgd import wire_numel

        settings = PowerSGDSettings(rank=args.rank)
        tensor_shapes = [s for _, s in shapes]
        wire = wire_numel(tensor_shapes, settings)
        local = statistics.median(times["local"])
        link_bps = int(os.environ.get("DP_CLUSTER_LINK_BPS", "0"))
        link = Link(alpha=ALPHA_S, beta=link_bps / 8) if link_bps else None
        # The gloo engine's automatic path: hierarchical where hosts hold several ranks.
        ranks_per_host = int(os.environ.get("DP_CLUSTER_RANKS_PER_HOST", "1"))
        inside = (Link(alpha=5e-6, beta=LOCAL_GBIT * 1e9 / 8)
                  if 1 < ranks_per_host < size else None)
        sizes = [4 * math.prod(s) for s in tensor_shapes]
        cap, first = Config().bucket_caps(total_bytes=sum(sizes))
        gflops = args.gflops or POWERSGD_GFLOPS
        measured = statistics.median(passes) if passes else None
        gbytes = args.gbytes or measured or POWERSGD_GBYTES
        dp = statistics.median(times["dp" if "dp" in times else "local"])
        for i, method in enumerate(methods):
            t = statistics.median(times[method])
            pred = None
            if link is not None and method in ("dp", "dp powersgd"):
                pred = (predict(sizes, local, size, link, cap, per_host=ranks_per_host,
                                local=inside, first_threshold=first).step_s
                        if method == "dp" else
                        predict_powersgd(tensor_shapes, local, size, link, cap, settings,
                                         gflops * 1e9, gbytes * 1e9, first_threshold=first,
                                         per_host=ranks_per_host, local=inside).step_s)
            formula = 4 * (wire.dense if method in ("local", "dp") else wire.total)
            print("RESULT " + json.dumps({
                "method": method, "size": size, "step_s": t, "vs_dp": t / dp,
                "link_bytes_per_step": float(table[i]), "formula_bytes": formula,
                "predicted_s": pred, "local_s": local, "params": wire.dense,
                "rank": args.rank, "layers": args.layers, "link_bps": link_bps,
                "peak_rss_mib": peak.item(), "plan_gbytes": gbytes, "plan_gflops": gflops,
            }), flush=True)
    dist.barrier()
    hvd.shutdown()
    return 0


def table(rows: list[dict]) -> str:
    out = ["| hosts x ranks | link | BERT layers | method | step (ms) | vs dp | link bytes / step "
           "(MB, per host) | formula (MB) | link / formula | plan (ms) | plan error |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred = r["predicted_s"]
        link = r["link_bytes_per_step"]
        formula = r["formula_bytes"]
        ratio = f"{link / formula:.2f}" if link > 0 and r["method"] != "local" else ""
        plan = "" if pred is None else f"{pred * 1e3:.0f}"
        error = "" if pred is None else f"{(pred - r['step_s']) / r['step_s']:+.0%}"
        out.append(
            f"| {r['hosts']} x {r['per_host']} | {r['link']} | {r['layers']} | {r['method']} | "
            f"{r['step_s'] * 1e3:.0f} | {r['vs_dp']:.2f}x | "
            f"{link / 1e6:.2f} | {formula / 1e6:.2f} | {ratio} | {plan} | {error} |")
    return "\n".join(out)


def failure_report(proc: subprocess.CompletedProcess[str], errors: Path, ranks: int) -> str:
    """What a failed cluster run says: each rank's own traceback (written by
    ``worker``), the ranks that left none (killed by a signal: the kernel's
    OOM killer, the cluster's timeout), then the launchers' last lines."""
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    parts = [f"powersgd_bench: the cluster run failed (exit {proc.returncode})."]
    silent = []
    for rank in range(ranks):
        found = errors / f"rank{rank}.txt"
        if found.exists():
            parts.append(f"--- rank {rank}'s error ---\n{found.read_text().rstrip()}")
        else:
            silent.append(str(rank))
    if silent:
        parts.append(f"rank(s) {', '.join(silent)} raised no Python error: ran to the end, "
                     "or killed by a signal (the kernel's OOM killer: see "
                     "`dmesg | grep -i oom`; the cluster's --timeout)")
    parts.append(f"--- the launchers' last lines ---\n{tail}")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="powersgd_bench.") as errors:
        os.chmod(errors, 0o777)  # the ranks may run as another user
        cmd = [sys.executable, str(CLUSTER), "--hosts", str(args.hosts), "--ranks-per-host",
               str(args.ranks_per_host), "--link", args.link, "--timeout", str(args.timeout),
               "--", str(Path(__file__).resolve()), "--worker", "--errors", errors,
               "--layers", str(args.layers), "--rank", str(args.rank), "--steps",
               str(args.steps), "--blocks", str(args.blocks), "--ddp-bucket-mb",
               str(args.ddp_bucket_mb), "--methods", *args.methods,
               *([] if args.gflops is None else ["--gflops", str(args.gflops)]),
               *([] if args.gbytes is None else ["--gbytes", str(args.gbytes)])]
        env = {**os.environ, "DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "600"}
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        rows = [{**json.loads(line.partition("RESULT ")[2]), "hosts": args.hosts,
                 "per_host": args.ranks_per_host, "link": args.link}
                for line in proc.stdout.splitlines() if "RESULT " in line]
        if proc.returncode != 0 or not rows:
            raise SystemExit(failure_report(proc, Path(errors), args.hosts * args.ranks_per_host))
    print(f"# {args.hosts} x {args.ranks_per_host} at {args.link}: "
          f"{time.monotonic() - t0:.0f} s", file=sys.stderr)
    print(table(rows))
    print(f"\npeak resident memory per rank: {rows[0]['peak_rss_mib']:.0f} MiB (the largest "
          f"rank); the plan's hook work at {rows[0]['plan_gbytes']:.2f} GB/s "
          f"({'given' if args.gbytes else 'measured, the slowest rank'}), products at "
          f"{rows[0]['plan_gflops']:g} GFLOP/s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
