"""Starting benchmark workers under a launcher and collecting rank 0's result.

Shared by the benchmark scripts, which start themselves again with
``--worker ...`` under the launcher a configuration needs; a worker prints one
``RESULT {json}`` line (rank 0), which ``run_jobs`` returns.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dp_plugin.launch import is_launcher_variable

BINDIR = Path(sys.executable).parent
"""The venv's bin: mpiexec and horovodrun next to the interpreter."""

Job = tuple[list[str], dict[str, str]]

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, one thread per worker."""
    # This shell may itself run under a launcher; dp_plugin.launch owns the one
    # list of launcher variables. Tuning variables (DP_PLUGIN_FUSION_THRESHOLD...) stay.
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


def run_jobs(label: str, jobs: list[Job], timeout: float) -> dict[str, Any]:
    """Run the jobs to completion; return the RESULT one of them printed.

    A hang past ``timeout`` kills every job's process group; a failed job or a
    missing RESULT line ends the benchmark with the workers' output.
    """
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for cmd, env in jobs]
    outs = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, 9)
            raise SystemExit(f"{label}: benchmark workers hung for {timeout:.0f} s") from None
    if any(p.returncode for p in procs):
        raise SystemExit(f"{label}: a worker failed:\n" + "\n".join(outs))
    for line in "\n".join(outs).splitlines():
        if "RESULT " in line:  # horovodrun prefixes each line with the rank
            return dict(json.loads(line.split("RESULT ", 1)[1]))
    raise SystemExit(f"{label}: no RESULT line in:\n" + "\n".join(outs))
