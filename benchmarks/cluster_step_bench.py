#!/usr/bin/env python3
"""Training step of the BERT example's model on the rehearsal cluster: dp_plugin beside DDP.

On each configuration (hosts x ranks per host, link rate) it starts
scripts/cluster.py once and, on every rank, trains the model
examples/bert_pretrain.py builds with its defaults (``BertForMaskedLM``,
4 layers, hidden 256, vocabulary 4096, 64 tokens, global batch 32, AdamW)
on random token batches, one block of steps per method, the blocks
interleaved so that outside load hits all methods alike:

- ``local``: no communication at all (the compute-only step);
- ``dp``: ``hvd.DistributedOptimizer`` with its defaults;
- ``dp fp16``: the same with ``compression=hvd.Compression.fp16``;
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over the Gloo
  process group dp_plugin's engine made.

``--engines gloo horovod`` adds a launch with the horovod engine (local and
dp only: it makes no torch.distributed group for DDP), compared with the
gloo launch's DDP; ``--launcher horovodrun`` starts every launch with
horovodrun across the hosts, the only launcher the horovod engine runs under.

Per method: median step time (slowest rank), tokens/s, the exposed
communication (step minus the local step), dp_plugin's own count of
exposed over all-reduce time (``opt.comm_stats()``), and the step
``dp-plugin plan``'s model predicts (``dp_plugin.cli.alphabeta.predict``
with the measured local step as compute, the link rate, dp_plugin's
default bucket size) with its error. Needs root (namespaces).

    sudo .venv/bin/python benchmarks/cluster_step_bench.py
    sudo .venv/bin/python benchmarks/cluster_step_bench.py --ranks-per-host 2 --links 1gbit
    sudo .venv/bin/python benchmarks/cluster_step_bench.py --launcher horovodrun \\
        --engines horovod gloo --ranks-per-host 2 --links 1gbit --no-fp16
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
METHODS = ("local", "dp", "dp fp16", "ddp")
LAYERS, HIDDEN, HEADS, VOCAB, SEQ, GLOBAL_BATCH = 4, 256, 4, 4096, 64, 32
ALPHA_S = 50e-6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--links", nargs="+", default=["1gbit", "10gbit"])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per method (per block)")
    ap.add_argument("--blocks", type=int, default=2, help="interleaved blocks per method")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-fp16", action="store_true",
                    help="skip the launch with fp16 compression (see LAUNCHES)")
    ap.add_argument("--launcher", choices=["torchrun", "horovodrun"], default="torchrun",
                    help="how cluster.py starts the ranks")
    ap.add_argument("--engines", nargs="+", choices=["gloo", "horovod"], default=["gloo"],
                    help="dp_plugin engines, launches of their own (horovod: horovodrun only)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def worker(args: argparse.Namespace) -> int:
    import torch
    from transformers import BertConfig, BertForMaskedLM
    from transformers.utils import logging as hf_logging

    import dp_plugin.torch as hvd
    from dp_plugin.launch import runtime

    hvd.init()
    hf_logging.set_verbosity_error()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    per_rank = GLOBAL_BATCH // size
    config = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, intermediate_size=4 * HIDDEN,
                        max_position_embeddings=SEQ)
    gen = torch.Generator().manual_seed(rank)

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(5, VOCAB, (per_rank, SEQ), generator=gen)
        labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.15, ids, -100)
        return {"input_ids": ids, "labels": labels}

    def make(method: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = BertForMaskedLM(config)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if method == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        elif method.startswith("dp"):
            comp = hvd.Compression.fp16 if method == "dp fp16" else hvd.Compression.none
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression=comp)
        return model, opt

    methods = args.methods
    setups = {m: make(m) for m in methods}
    times: dict[str, list[float]] = {m: [] for m in methods}
    exposed: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
    for block in range(args.blocks):
        order = methods if block % 2 == 0 else list(reversed(methods))
        for method in order:
            model, opt = setups[method]
            for step in range(args.steps + 1):
                b = batch()
                hvd.barrier()
                t0 = time.perf_counter()
                model(**b).loss.backward()
                opt.step()
                opt.zero_grad()
                dt = hvd.allreduce(torch.tensor([time.perf_counter() - t0]), op=hvd.Max,
                                   name="slowest")
                if step > 0:  # the first step of a block warms up
                    times[method].append(dt.item())
            stats = opt.comm_stats() if method.startswith("dp") else None
            if stats:
                recent = list(stats)[-args.steps:]
                exposed[method].append((sum(min(s.exposed_s, s.allreduce_s) for s in recent),
                                        sum(s.allreduce_s for s in recent)))
    if rank == 0:
        from dp_plugin.cli.alphabeta import Link, predict
        from dp_plugin.config import DEFAULT_FUSION_THRESHOLD

        model = setups["local"][0]
        sizes = [p.numel() * 4 for p in model.parameters()]
        local = statistics.median(times["local"])
        link_bps = int(os.environ.get("DP_CLUSTER_LINK_BPS", "0"))
        for method in methods:
            t = statistics.median(times[method])
            pred = None
            if link_bps and method != "local":
                wire = 0.5 if method == "dp fp16" else 1.0
                pred = predict([int(s * wire) for s in sizes], local, size,
                               Link(alpha=ALPHA_S, beta=link_bps / 8),
                               DEFAULT_FUSION_THRESHOLD).step_s
            exp, total = (sum(x for x, _ in exposed[method]), sum(y for _, y in exposed[method]))
            on_horovod = runtime.engine().name == "horovod" and method.startswith("dp")
            label = f"{method} (horovod engine)" if on_horovod else method
            print("RESULT " + json.dumps({
                "method": label, "size": size, "step_s": t, "local_s": local,
                "tokens_s": GLOBAL_BATCH * SEQ / t, "params": sum(sizes) // 4,
                "exposed_share": (exp / total) if total else None,
                "predicted_s": pred, "link_bps": link_bps,
                "ddp_s": statistics.median(times["ddp"]) if "ddp" in times else None,
            }), flush=True)
    hvd.shutdown()
    return 0


LAUNCHES = (("local", "dp", "ddp"), ("local", "dp fp16", "ddp"))
"""One dp_plugin optimizer per process: with two (dp and dp fp16) in one
process the first fp16 step hung here (not investigated), so each runs in a
launch of its own, beside its own local and DDP blocks."""


def run_config(args: argparse.Namespace, hosts: int, per_host: int, link: str) -> list[dict]:
    rows = []
    launches = [("gloo", m) for m in (LAUNCHES[:1] if args.no_fp16 else LAUNCHES)
                if "gloo" in args.engines]
    if "horovod" in args.engines:
        launches.append(("horovod", ("local", "dp")))
    for n, (engine, methods) in enumerate(launches):
        cmd = [sys.executable, str(CLUSTER), "--hosts", str(hosts), "--ranks-per-host",
               str(per_host), "--link", link, "--launcher", args.launcher,
               "--timeout", str(args.timeout), "--",
               str(Path(__file__).resolve()), "--worker", "--steps", str(args.steps),
               "--blocks", str(args.blocks), "--methods", *methods]
        env = {**os.environ, "DP_PLUGIN_ENGINE": engine, "DP_PLUGIN_TIMEOUT": "300"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        got = [{**json.loads(line.partition("RESULT ")[2]), "hosts": hosts,
                "per_host": per_host, "link": link}
               for line in proc.stdout.splitlines() if "RESULT " in line]
        if proc.returncode != 0 or not got:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            raise SystemExit(f"cluster_step_bench: {hosts}x{per_host} at {link} failed "
                             f"(exit {proc.returncode}):\n{tail}")
        rows += [r for r in got if n == 0 or r["method"] not in LAUNCHES[0]]
    ddp = next((r["ddp_s"] for r in rows if r["ddp_s"] is not None), None)
    return [{**r, "ddp_s": ddp if r["ddp_s"] is None else r["ddp_s"]} for r in rows]


def table(rows: list[dict]) -> str:
    out = ["| hosts x ranks | link | method | step (ms) | tokens/s | vs ddp | exposed (ms) "
           "| exposed / all-reduce | plan (ms) | plan error |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = r["ddp_s"]
        share = "" if r["exposed_share"] is None else f"{r['exposed_share']:.0%}"
        pred = r["predicted_s"]
        ratio = "" if ref is None else f"{r['step_s'] / ref:.2f}x"
        plan = "" if pred is None else f"{pred * 1e3:.0f}"
        err = "" if pred is None else f"{(pred - r['step_s']) / r['step_s']:+.0%}"
        out.append(
            f"| {r['hosts']} x {r['per_host']} | {r['link']} | {r['method']} | "
            f"{r['step_s'] * 1e3:.0f} | {r['tokens_s']:,.0f} | {ratio} | "
            f"{(r['step_s'] - r['local_s']) * 1e3:.0f} | {share} | {plan} | {err} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
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
