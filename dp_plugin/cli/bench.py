"""``dp-plugin bench``: all-reduce sweep per engine and world size, with references.

For every available engine (gloo, mpi, horovod, nccl with CUDA) and world
size (2 and 3 by default) it starts the workers under the engine's launcher
on this machine and times one all-reduce per buffer size (4 KiB to 256 MiB,
doubling), reporting time, algorithm bandwidth and bus bandwidth as
nccl-tests defines them (busbw = algbw x 2(n-1)/n). Loopback TCP and memcpy
are measured in the same run as references. With ``--models`` it also times
the fused all-reduce of a model's gradient shape list (default threshold)
against one raw all-reduce of the same bytes (``--per-tensor``: and unfused,
one all-reduce per gradient). Writes ``results.json``,
``results.md`` and PNG plots into ``--out``.

    dp-plugin bench --out bench-out
    dp-plugin bench --out /tmp/quick --engines gloo --world-sizes 2 --max-size 1M --models none
    dp-plugin bench --out /tmp/check --engines gloo --world-sizes 2 --models none --shm-check
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from dp_plugin.cli import bandwidth as bw
from dp_plugin.cli import int_list
from dp_plugin.cli.bench_worker import reps_for
from dp_plugin.cli.jobs import (
    BINDIR,
    Job,
    clean_env,
    horovodrun_job,
    mpiexec_job,
    run_jobs,
    torchrun_jobs,
)
from dp_plugin.cli.progress import Progress
from dp_plugin.cli.shapes import MODELS

HELP = "all-reduce sweep per engine and world size; markdown table and PNG plots"
ENGINES = ("gloo", "mpi", "horovod", "nccl")
LAUNCHER_TOOL = {"mpi": "mpiexec", "horovod": "horovodrun"}
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """``4K``, ``256M``, ``1G`` or a byte count -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in UNITS and t[-1:] else ""
    try:
        value = int(float(t[: len(t) - len(unit)]) * UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write bytes or a number with K, M or G (e.g. 4K, 256M)"
        ) from None
    if value < 4:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 4 bytes")
    return value


def _names(choices: tuple[str, ...], allow_none: bool = False) -> Any:
    def parse(text: str) -> list[str]:
        if allow_none and text.strip() == "none":
            return []
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"{text!r}: unknown {', '.join(bad) or 'empty list'}; choose from "
                f"{', '.join(choices)}{' or none' if allow_none else ''}, comma-separated")
        return names
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="folder for results and plots")
    parser.add_argument("--engines", type=_names(ENGINES),
                        help="engines to run (default: every available one)")
    parser.add_argument("--world-sizes", type=int_list("world sizes", 2, "2,3"), default=[2, 3],
                        help="comma-separated (default 2,3)")
    parser.add_argument("--min-size", type=parse_size, default=4 * 2**10, help="default 4K")
    parser.add_argument("--max-size", type=parse_size, default=256 * 2**20, help="default 256M")
    parser.add_argument("--models", type=_names(tuple(MODELS), allow_none=True),
                        default=["bert-base", "resnet50"],
                        help="shape lists to fuse (default bert-base,resnet50; 'none' skips)")
    parser.add_argument("--reps", type=int, default=20, help="repetitions (fewer above 16 MiB)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800, help="per job, seconds")
    parser.add_argument("--per-tensor", action="store_true",
                        help="also time the model lists unfused, one all-reduce per gradient")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--shm-check", action="store_true",
                        help="every rank on one host: time each size through shared memory "
                             "with and without its per-operation header check, interleaved")


def sizes_between(lo: int, hi: int) -> list[int]:
    if lo > hi:
        raise SystemExit(f"--min-size {lo} is larger than --max-size {hi}: swap them")
    return [lo << i for i in range((hi // lo).bit_length())]  # lo, 2 lo, 4 lo, ... <= hi


def available_engines(wanted: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """The engines to run and, for each one left out, why.

    Without ``--engines`` every engine is probed (imports torch, mpi4py and
    horovod here); engines named on the command line only need their
    launcher: their workers say why, if the engine cannot start.
    """
    from dp_plugin.engines import availability
    from dp_plugin.launch.launchers import detect

    topo = detect()
    ok, skipped = [], {}
    for name in wanted or list(ENGINES):
        avail = None if wanted else availability(name, topo)
        tool = LAUNCHER_TOOL.get(name)
        if avail is not None and not avail.ok:
            skipped[name] = avail.reason
        elif tool and not (BINDIR / tool).exists() and shutil.which(tool) is None:
            skipped[name] = f"{tool} is not on PATH"
        else:
            ok.append(name)
    if wanted and skipped:
        raise SystemExit("dp-plugin bench: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    return ok, skipped


def _jobs(engine: str, n: int, cmd: list[str]) -> list[Job]:
    env = clean_env(DP_PLUGIN_ENGINE=engine)
    if engine == "mpi":
        return [mpiexec_job(cmd, n, env)]
    if engine == "horovod":
        return [horovodrun_job(cmd, n, env)]
    return torchrun_jobs(cmd, n, env)


def references(sizes: list[int], reps: int, warmup: int, bar: Progress) -> list[dict[str, Any]]:
    rows = []
    for s in sizes:
        r = reps_for(s, reps)
        rows.append({"bytes": s, "loopback_tcp_s": bw.loopback_tcp_time(s, r, warmup),
                     "memcpy_s": bw.memcpy_time(s, r, warmup)})
        bar.advance()
    return rows


def run(args: argparse.Namespace) -> int:
    sizes = sizes_between(args.min_size, args.max_size)
    engines, skipped = available_engines(args.engines)
    for name, why in skipped.items():
        print(f"dp-plugin bench: skipping {name}: {why}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    total = len(sizes) + len(engines) * len(args.world_sizes) * (len(sizes) + len(args.models))
    bar = Progress(total)
    t0 = time.monotonic()
    result: dict[str, Any] = {"sizes": sizes, "world_sizes": args.world_sizes, "skipped": skipped,
                              "references": references(sizes, args.reps, args.warmup, bar),
                              "sweep": [], "models": []}
    cmd = [sys.executable, "-m", "dp_plugin.cli.bench_worker", "--sizes",
           ",".join(map(str, sizes)), "--reps", str(args.reps), "--warmup", str(args.warmup),
           "--models", ",".join(args.models), *(["--per-tensor"] if args.per_tensor else []),
           *(["--shm-check"] if args.shm_check else [])]
    for engine in engines:
        for n in args.world_sizes:
            bar.label = f"{engine} x{n}"
            r = run_jobs(f"{engine} x{n}", _jobs(engine, n, cmd), args.timeout,
                         on_line=lambda line: bar.advance() if "PROGRESS" in line else None)
            for key in ("sweep", "models"):
                result[key] += [dict(row, engine=engine, size=n) for row in r[key]]
    bar.close()
    result["elapsed_s"] = time.monotonic() - t0
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    from dp_plugin.cli import report

    written = report.write(result, args.out, plots=not args.no_plots)
    print("\n".join(f"wrote {p}" for p in written))
    return 0
