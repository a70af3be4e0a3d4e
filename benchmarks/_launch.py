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

BINDIR = Path(sys.executable).parent
"""The venv's bin: mpiexec and horovodrun next to the interpreter."""

Job = tuple[list[str], dict[str, str]]

# What a launcher sets (this shell may itself run under one). Tuning variables
# such as HOROVOD_CYCLE_TIME or DP_PLUGIN_FUSION_THRESHOLD are kept.
_LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "HYDRA_", "SLURM_", "TORCHELASTIC_",
                      "HOROVOD_GLOO_")
_LAUNCHER_NAMES = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
    "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS",
})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, one thread per worker."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES}
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
