"""Running scheduler commands (srun, sbatch, drivers) with a deadline.

A command that outlives its deadline is a hang: its whole process group is
killed and the test fails with its output. The environment is this
process's, minus every launcher variable (the test itself may run under a
launcher), with the venv first on PATH and one OpenMP thread per process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from dp_plugin.launch.variables import is_launcher_variable

ROOT = Path(__file__).resolve().parents[2]
BERT = ROOT / "examples" / "bert_pretrain.py"
TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "16",
        "--vocab-size", "500", "--global-batch", "8", "--steps", "4", "--warmup-steps", "1",
        "--log-every", "1", "--checkpoint-every", "0", "--no-progress"]
"""A BERT small enough for a few steps in seconds: the point is the plumbing."""


def clean_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not is_launcher_variable(k)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(argv: Sequence[str], env: Mapping[str, str], timeout: float,
        cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to completion; fail the test if it takes over ``timeout`` s."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(env), cwd=cwd, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"`{' '.join(argv)}` hung: still running after {timeout:g} s; "
                             f"its output:\n{out}") from None
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, "")


def losses(output: str) -> dict[int, float]:
    """The example's ``step N loss X`` lines."""
    import re

    return {int(s): float(v) for s, v in re.findall(r"step (\d+) loss (\d+\.\d+)", output)}


def assert_same_losses(got: dict[int, float], want: dict[int, float], output: str,
                       tolerance: float = 1e-5) -> None:
    assert sorted(got) == sorted(want), f"steps {sorted(got)} != {sorted(want)}:\n{output}"
    for step, value in want.items():
        assert abs(got[step] - value) <= tolerance, (step, got[step], value, output)
