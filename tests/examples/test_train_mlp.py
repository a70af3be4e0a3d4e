"""Smoke test of the README's main job: real workers, real engine, real training."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.multiproc.harness import run_workers

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_mlp.py"


def _losses(output: str) -> list[float]:
    return [float(m) for m in re.findall(r"loss (\d+\.\d+)", output)]


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("launcher", "nprocs", "batch"),
    [("torchrun", 2, "256"), ("mpirun", 3, "192")],
)
def test_main_job_trains_and_keeps_ranks_identical(
    launcher: str, nprocs: int, batch: str, tmp_path: Path
) -> None:
    result = run_workers(
        launcher, nprocs, SCRIPT,
        args=["--epochs", "3", "--samples", "4096", "--global-batch", batch],
        env={"DP_PLUGIN_TIMELINE": str(tmp_path / "trace.json")},
        timeout=180,
    )
    assert f"workers {nprocs}: parameters identical on all ranks" in result.output
    losses = _losses(result.output)
    assert len(losses) == 3, result.output
    assert losses[-1] < losses[0] * 0.8, f"loss did not fall: {losses}"
    accuracy = float(re.findall(r"held-out accuracy (\d\.\d+)", result.output)[0])
    assert accuracy > 0.5, result.output

    # One Chrome trace per rank, with the bucket spans of every step.
    for rank in range(nprocs):
        events = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())
        names = {e["name"].split()[0] for e in events if e.get("ph") == "X"}
        assert {"pack", "allreduce", "unpack", "step"} <= names, names
        steps = [e for e in events if e.get("ph") == "X" and e["name"].startswith("step")]
        assert len(steps) == 3 * (4096 // int(batch))
