"""CPU time Horovod's background thread takes with nothing to reduce: a table.

Two workers under ``horovodrun --gloo`` call ``hvd.init()`` and sleep; the
process CPU time they use meanwhile is the background cycle's alone (each
cycle wakes, coordinates with the other rank and sleeps again). Run per
``HOROVOD_CYCLE_TIME``; on a machine with a core per worker, that share of a
core is taken from the training step whichever optimizer runs the
all-reduces (Horovod's own or dp_plugin's horovod engine).

    python benchmarks/horovod_idle_cpu.py [--cycles default,5,20] [--seconds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from dp_plugin.cli.jobs import clean_env, horovodrun_job, run_jobs


def worker(seconds: float) -> None:
    import horovod.torch as hvd

    hvd.init()
    time.sleep(1.0)  # past the start-up
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(seconds)
    share = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({"share": share}), flush=True)
    hvd.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--cycles", default="default,5,20",
                    help="HOROVOD_CYCLE_TIME values in ms, 'default' for unset")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.seconds)
        return
    print("HOROVOD_CYCLE_TIME   idle CPU of rank 0 (share of one core)")
    for cycle in args.cycles.split(","):
        env = clean_env()
        if cycle != "default":
            env["HOROVOD_CYCLE_TIME"] = cycle
        cmd = [sys.executable, os.path.abspath(__file__), "--worker",
               "--seconds", str(args.seconds)]
        result = run_jobs(f"cycle {cycle}", [horovodrun_job(cmd, 2, env)], args.seconds + 120)
        label = "1 (default)" if cycle == "default" else cycle
        print(f"{label:<20} {result['share'] * 100:5.1f}%")


if __name__ == "__main__":
    main()
