"""Starting benchmark workers under a launcher and collecting rank 0's result.

Used by ``dp-plugin bench`` and the scripts in ``benchmarks/``: a worker
prints one ``RESULT {json}`` line (rank 0), which ``run_jobs`` returns; any
other line a worker prints can be followed live through ``on_line`` (the
bench's progress bar reads ``PROGRESS`` lines that way).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dp_plugin.launch.netif import free_port
from dp_plugin.launch.variables import is_launcher_variable

BINDIR = Path(sys.executable).parent
"""The environment's bin: mpiexec and horovodrun next to the interpreter."""

Job = tuple[list[str], dict[str, str]]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, one thread per worker."""
    # This shell may itself run under a launcher; tuning variables (DP_PLUGIN_*) stay.
    env = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    env.update(PATH=f"{BINDIR}:{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", **extra)
    return env


def torchrun_jobs(cmd: list[str], nprocs: int, env: dict[str, str]) -> list[Job]:
    """``nprocs`` processes with torchrun's variables (without torchrun's start-up)."""
    port = str(free_port())
    return [(cmd, dict(env, RANK=str(r), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(r),
                       LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port))
            for r in range(nprocs)]


def mpiexec_job(cmd: list[str], nprocs: int, env: dict[str, str]) -> Job:
    return [str(BINDIR / "mpiexec"), "-n", str(nprocs), *cmd], env


def horovodrun_job(cmd: list[str], nprocs: int, env: dict[str, str]) -> Job:
    return [str(BINDIR / "horovodrun"), "--gloo", "-np", str(nprocs),
            "-H", f"localhost:{nprocs}", *cmd], env


def _reader(proc: subprocess.Popen[str], lines: list[str],
            on_line: Callable[[str], None] | None) -> threading.Thread:
    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def run_jobs(label: str, jobs: list[Job], timeout: float,
             on_line: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the jobs to completion; return the RESULT one of them printed.

    A hang past ``timeout`` kills every job's process group; a failed job or a
    missing RESULT line ends the benchmark with the workers' output.
    """
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for cmd, env in jobs]
    outs: list[list[str]] = [[] for _ in procs]
    readers = [_reader(p, out, on_line) for p, out in zip(procs, outs, strict=True)]
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, 9)
            raise SystemExit(f"{label}: benchmark workers hung for {timeout:.0f} s") from None
    for r in readers:
        r.join(timeout=10)
    text = "\n".join("".join(out) for out in outs)
    if any(p.returncode for p in procs):
        raise SystemExit(f"{label}: a worker failed:\n{text}")
    for line in text.splitlines():
        if "RESULT " in line:  # horovodrun prefixes each line with the rank
            return dict(json.loads(line.split("RESULT ", 1)[1]))
    raise SystemExit(f"{label}: no RESULT line in:\n{text}")
