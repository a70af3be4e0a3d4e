#!/usr/bin/env python3
"""All-reduce of real gradient lists on the rehearsal cluster (scripts/cluster.py).

For each configuration (hosts x ranks per host, link rate) it starts the
cluster once and, on every rank, reduces the gradient list of each model
(``dp_plugin/cli/shapes.py``, float32) with each method, interleaved round
by round so that load from outside hits all methods alike:

- ``dp grouped``: ``hvd.grouped_allreduce(list)`` (new tensors out, what a
  user calls), dp_plugin's default engine and settings;
- ``dp grouped_``: ``hvd.grouped_allreduce_(list)`` (in place);
- ``torch flat``: ``torch.distributed.all_reduce`` of one flat float32 gloo
  buffer of the same bytes (DDP's path without its bucketing: the best a
  ring over Gloo does here);
- ``dp clone+grouped_`` (only when asked for): a clone of every tensor,
  then ``hvd.grouped_allreduce_`` of the clones: what ``dp grouped`` did
  before its copies were pipelined with the wire, its anchor;
- ``torch list`` (only when asked for): one asynchronous
  ``torch.distributed.all_reduce`` per tensor, all started at once, then
  waited for: what Gloo itself does with the list, unfused.

``--engines gloo horovod`` launches the cluster once per dp_plugin engine
(``DP_PLUGIN_ENGINE``); ``torch flat`` runs in the gloo launch only (the
horovod engine makes no torch.distributed group). ``--launcher horovodrun``
starts the ranks with horovodrun across the hosts (``cluster.py
--launcher``), the only launcher the horovod engine runs under.

Per method: the slowest rank's time (median over rounds), bus bandwidth
``2 (n-1)/n x S / t``, the bytes host 1 sent on its link while it ran
(``/sys/class/net/eth0``) as a share of the link rate, and the
alpha-beta model's prediction (``dp_plugin.cli.alphabeta``, the model
``dp-plugin plan`` uses) with its error. Needs root (namespaces).

    sudo .venv/bin/python benchmarks/cluster_bench.py                       # the full table
    sudo .venv/bin/python benchmarks/cluster_bench.py --ranks-per-host 2 --links 1gbit \\
        --models bert-base --rounds 3
    sudo .venv/bin/python benchmarks/cluster_bench.py --launcher horovodrun \\
        --engines horovod gloo --ranks-per-host 2 --links 1gbit --models bert-base
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CLUSTER = ROOT / "scripts" / "cluster.py"
METHODS = ("dp grouped", "dp grouped_", "torch flat")
EXTRA_METHODS = ("dp clone+grouped_", "torch list")
ALPHA_S = 50e-6
"""Latency per ring step the predictions use (Gloo over veth, measured small
next to the transfers here)."""
LINK_PAYLOAD = 0.93
"""The share of a shaped link's rate that arrives as payload, the
predictions' bandwidth: what one flat Gloo buffer reached on the quiet
machine (docs/benchmarks-history.md, "Shaped links on a quiet machine": 0.936 and 0.930 of
1 Gbit/s as bus bandwidth at 2 x 1 and 2 x 2); the rest is TCP/IP and
Ethernet headers and tbf's accounting. As ``dp-plugin plan --sweep`` takes
a measured bandwidth, not the nominal one."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--links", nargs="+", default=["1gbit", "10gbit"])
    ap.add_argument("--models", nargs="+", default=["bert-base", "resnet50"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS + EXTRA_METHODS)
    ap.add_argument("--chunks-mib", type=float, nargs="*", default=[],
                    help="also run dp grouped_ with PIPELINE_CHUNK set to each (0: one bucket)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up)")
    ap.add_argument("--timeout", type=float, default=900.0, help="per cluster run, seconds")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--table-of", type=Path, nargs="+", metavar="JSON",
                    help="print the table of rows written by --json (today's predictions); "
                         "run nothing")
    ap.add_argument("--hierarchical", nargs="+", choices=["auto", "0", "1"], default=["auto"],
                    help="DP_PLUGIN_HIERARCHICAL_ALLREDUCE per launch at 2+ ranks per host "
                         "(auto: unset, the engine's choice; each value is a launch)")
    ap.add_argument("--launcher", choices=["torchrun", "horovodrun"], default="torchrun",
                    help="how cluster.py starts the ranks")
    ap.add_argument("--engines", nargs="+", choices=["gloo", "horovod"], default=["gloo"],
                    help="dp_plugin engines, one cluster launch each (horovod: horovodrun only)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# -- on every rank -----------------------------------------------------------------


def tx_bytes() -> int:
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import dp_plugin.torch as hvd
    from dp_plugin.cli.shapes import model_shapes

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    from dp_plugin.launch import runtime

    engine = runtime.engine()
    if engine.name == "horovod":
        path = "horovod engine"
    else:
        path = "hierarchical" if getattr(engine, "hierarchical", False) else "flat"
    from dp_plugin.reduce import collective

    link_bps = int(os.environ.get("DP_CLUSTER_LINK_BPS", "0"))
    default_chunk = collective.PIPELINE_CHUNK
    chunked = {f"dp grouped_ chunk={c:g}MiB": int(c * 2**20) or 1 << 62
               for c in args.chunks_mib}
    # torch flat needs the torch.distributed group of the gloo engine.
    methods = [m for m in [*args.methods, *chunked]
               if not m.startswith("torch") or dist.is_initialized()]
    gen = torch.Generator().manual_seed(rank)
    for model in args.models:
        shapes = model_shapes(model)
        grads = [torch.randn(shape, generator=gen) for _, shape in shapes]
        nbytes = sum(g.numel() * 4 for g in grads)
        flat = torch.cat([g.flatten() for g in grads])
        times: dict[str, list[float]] = {m: [] for m in methods}
        sent: dict[str, list[int]] = {m: [] for m in methods}
        cpu: dict[str, list[float]] = {m: [] for m in methods}
        for r in range(args.rounds + 1):
            order = methods if r % 2 == 0 else list(reversed(methods))
            for method in order:
                hvd.barrier()
                tx0, t0, c0 = tx_bytes(), time.perf_counter(), time.process_time()
                collective.PIPELINE_CHUNK = chunked.get(method, default_chunk)
                if method == "dp grouped":
                    hvd.grouped_allreduce(grads, op=hvd.Sum, name=f"{model}.g{r}")
                elif method == "dp clone+grouped_":
                    clones = [g.clone() for g in grads]
                    hvd.grouped_allreduce_(clones, op=hvd.Sum, name=f"{model}.c{r}")
                    del clones
                elif method.startswith("dp grouped_"):
                    hvd.grouped_allreduce_(grads, op=hvd.Sum, name=f"{model}.i{r}")
                    for g in grads:  # keep the values from growing round after round
                        g.mul_(1.0 / size)
                elif method == "torch list":
                    for work in [dist.all_reduce(g, async_op=True) for g in grads]:
                        work.wait()
                    for g in grads:
                        g.mul_(1.0 / size)
                else:
                    dist.all_reduce(flat)
                    flat.mul_(1.0 / size)
                dt, tx = time.perf_counter() - t0, tx_bytes() - tx0
                used = time.process_time() - c0
                # The slowest rank's time; host 1's bytes (local rank 0 there is rank 0).
                slowest = hvd.allreduce(torch.tensor([dt]), op=hvd.Max, name="slowest")
                if r > 0:  # round 0 warms up (buffers, connections)
                    times[method].append(slowest.item())
                    sent[method].append(tx)
                    cpu[method].append(used)
        if rank == 0:
            for method in methods:
                t = statistics.median(times[method])
                tx = statistics.median(sent[method])
                label = f"{method} ({path})" if method.startswith("dp") else method
                print("RESULT " + json.dumps({
                    "model": model, "method": label, "size": size, "bytes": nbytes,
                    "tensors": len(grads), "time_s": t, "times_s": times[method],
                    "link_bps": link_bps, "host_tx_bytes": tx,
                    "cpu_s": statistics.median(cpu[method]),
                    "link_share": (tx * 8 / t / link_bps) if link_bps else None,
                }), flush=True)
        del grads, flat
    hvd.shutdown()
    return 0


# -- the driver ---------------------------------------------------------------------


def run_config(args: argparse.Namespace, hosts: int, per_host: int, link: str) -> list[dict]:
    rows = []
    launches = [(engine, hier) for engine in args.engines
                for hier in (args.hierarchical if per_host > 1 and engine == "gloo" else ["auto"])]
    for n, (engine, hier) in enumerate(launches):
        cmd = [sys.executable, str(CLUSTER), "--hosts", str(hosts), "--ranks-per-host",
               str(per_host), "--link", link, "--launcher", args.launcher,
               "--timeout", str(args.timeout), "--",
               str(Path(__file__).resolve()), "--worker", "--rounds", str(args.rounds),
               "--models", *args.models, "--methods", *args.methods,
               "--chunks-mib", *map(str, args.chunks_mib)]
        env = {**os.environ, "DP_PLUGIN_ENGINE": engine, "DP_PLUGIN_TIMEOUT": "300"}
        if hier != "auto":
            env["DP_PLUGIN_HIERARCHICAL_ALLREDUCE"] = hier
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        got = [{**json.loads(line.partition("RESULT ")[2]), "hosts": hosts,
                "per_host": per_host, "link": link, "launch": n, "launcher": args.launcher}
               for line in proc.stdout.splitlines() if "RESULT " in line]
        if proc.returncode != 0 or not got:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            raise SystemExit(f"cluster_bench: {hosts}x{per_host} at {link} failed "
                             f"(exit {proc.returncode}):\n{tail}")
        rows += got
    return rows


def predicted_s(row: dict) -> float | None:
    """The alpha-beta model's time for one ring all-reduce of the bytes over
    every rank at the link's payload rate (``LINK_PAYLOAD``; the ranks of a
    host add no link traffic of their own: a ring through ``P`` ranks per
    host crosses each host link once per step each way, so ``2 (n-1)/n x S``
    over the link); for the hierarchical path ``2 (H-1)/H x S`` over the
    link beside the intra-host reduce-scatter and all-gather, pipelined in
    pieces (``dp_plugin.cli.alphabeta.allreduce_time``)."""
    from dp_plugin.cli.alphabeta import Link, allreduce_time
    from dp_plugin.cli.plan import LOCAL_GBIT

    if not row["link_bps"]:
        return None
    local = (Link(alpha=5e-6, beta=LOCAL_GBIT * 1e9 / 8)
             if "(hierarchical)" in row["method"] else None)
    link = Link(alpha=ALPHA_S, beta=row["link_bps"] / 8 * LINK_PAYLOAD)
    return allreduce_time(row["bytes"], row["size"], link, row["per_host"], local)


def table(rows: list[dict]) -> str:
    out = ["| hosts x ranks | link | model | method | time (s) | bus bw (Gbit/s) | link share "
           "| vs torch flat | CPU (s) | predicted (s) | error |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    # Against torch flat of the same launch, else of the configuration's first launch.
    base = {(r["hosts"], r["per_host"], r["link"], r["model"], r.get("launch", 0)): r["time_s"]
            for r in rows if r["method"] == "torch flat"}
    for r in rows:
        if r["method"] == "torch flat":
            base.setdefault((r["hosts"], r["per_host"], r["link"], r["model"], None), r["time_s"])
    for r in rows:
        n = r["size"]
        bus = 2 * (n - 1) / n * r["bytes"] * 8 / r["time_s"] / 1e9
        share = "" if r["link_share"] is None else f"{r['link_share']:.0%}"
        ref = base.get((r["hosts"], r["per_host"], r["link"], r["model"], r.get("launch", 0)),
                       base.get((r["hosts"], r["per_host"], r["link"], r["model"], None)))
        speed = "" if ref is None else f"{ref / r['time_s']:.2f}x"
        pred = predicted_s(r)
        err = "" if pred is None else f"{(pred - r['time_s']) / r['time_s']:+.0%}"
        out.append(f"| {r['hosts']} x {r['per_host']} | {r['link']} | {r['model']} "
                   f"({r['bytes'] / 2**20:.0f} MiB, {r['tensors']}) | {r['method']} | "
                   f"{r['time_s']:.3f} | {bus:.2f} | {share} | {speed} | {r['cpu_s']:.2f} | "
                   f"{'' if pred is None else f'{pred:.3f}'} | {err} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.table_of:
        for path in args.table_of:
            print(f"{path}:\n{table(json.loads(path.read_text()))}\n")
        return 0
    rows: list[dict] = []
    for link in args.links:
        for per_host in args.ranks_per_host:
            t0 = time.monotonic()
            rows += run_config(args, args.hosts, per_host, link)
            print(f"# {args.hosts} x {per_host} at {link}: {time.monotonic() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
