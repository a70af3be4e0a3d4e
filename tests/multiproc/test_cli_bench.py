"""``dp-plugin bench`` end to end: 2 ranks of the gloo engine, tiny sizes.

The command starts its own workers (torchrun-style variables, like
``benchmarks/``); the test runs it as a user would, in a subprocess with a
deadline, from an environment without launcher variables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc.harness import BIN_DIR, is_launcher_variable


def test_bench_gloo_two_ranks_writes_table_plots_and_json(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    env["PATH"] = f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}"
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dp_plugin", "bench", "--out", str(out), "--engines", "gloo",
           "--world-sizes", "2", "--min-size", "4K", "--max-size", "16K", "--models", "none",
           "--reps", "3", "--warmup", "1", "--timeout", "50", "--no-plots"]
    # About 10 s of CPU; the deadline leaves room for a machine shared with other jobs.
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60,
                              start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"dp-plugin bench hung past 60 s; output so far:\n{exc.output}")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((out / "results.json").read_text())
    assert [(r["engine"], r["size"], r["bytes"]) for r in result["sweep"]] == \
        [("gloo", 2, 4096), ("gloo", 2, 8192), ("gloo", 2, 16384)]
    assert all(r["time_s"] > 0 for r in result["sweep"])
    assert [r["bytes"] for r in result["references"]] == [4096, 8192, 16384]
    md = (out / "results.md").read_text()
    assert "gloo x2 time / algbw / busbw" in md and "| 16 KiB |" in md
    assert not (out / "busbw.png").exists()  # --no-plots
    assert "6/6 gloo x2" in done.stderr  # the progress bar reached the end
