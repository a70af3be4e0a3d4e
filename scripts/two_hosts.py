#!/usr/bin/env python3
"""Two hosts on one machine: ``scripts/cluster.py --hosts 2`` with this
script's older options, kept for the commands already written down.

    sudo .venv/bin/python scripts/two_hosts.py                  # torchrun, 1 worker per host
    sudo .venv/bin/python scripts/two_hosts.py --launcher mpirun --nproc-per-host 2
    sudo .venv/bin/python scripts/two_hosts.py -- --steps 20    # arguments for the example

Arguments after ``--`` go to the training script (``--script``, the BERT
example by default); the link is unshaped unless ``--link`` says otherwise.
See scripts/cluster.py and docs/multinode.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--enter":
        return cluster.enter_host(argv[1:])
    ap = argparse.ArgumentParser(description="Run the BERT example across two network "
                                 "namespaces (scripts/cluster.py --hosts 2).")
    ap.add_argument("--launcher", choices=["torchrun", "mpirun"], default="torchrun")
    ap.add_argument("--nproc-per-host", type=int, default=1, help="workers per host")
    ap.add_argument("--link", default="none", help="link rate (tc units), none: unshaped")
    ap.add_argument("--subnet", default="10.211.0.0/24")
    ap.add_argument("--port", type=int, default=29411)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--script", type=Path, default=cluster.EXAMPLE)
    ap.add_argument("example_args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    extra = args.example_args[1:] if args.example_args[:1] == ["--"] else args.example_args
    command = [str(args.script.resolve()), *(extra or cluster.DEFAULT_COMMAND[1:])]
    return cluster.main(["--hosts", "2", "--ranks-per-host", str(args.nproc_per_host),
                         "--link", args.link, "--launcher", args.launcher,
                         "--subnet", args.subnet, "--port", str(args.port),
                         "--timeout", str(args.timeout), "--", *command])


if __name__ == "__main__":
    sys.exit(main())
