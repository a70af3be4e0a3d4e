"""examples/keras_digits.py: MirroredStrategy over 2 logical CPUs in each of
2 processes, dp.DistributedCallback across them; the loss falls and the
held-out accuracy is far above chance."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.multiproc.harness import run_workers

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "keras_digits.py"


@pytest.mark.multiproc
@pytest.mark.slow
def test_keras_cnn_trains_across_processes_and_local_replicas() -> None:
    result = run_workers("torchrun", 2, SCRIPT, args=["--epochs", "4"],
                         env={"DP_PLUGIN_TIMEOUT": "60"}, timeout=240)
    assert "processes 2 x replicas 2" in result.output, result.output
    losses = [float(v) for v in re.findall(r"epoch \d+/4 loss (\d+\.\d+)", result.output)]
    assert len(losses) == 4 and losses[-1] < losses[0] * 0.7, result.output
    accuracy = float(re.findall(r"held-out accuracy (\d\.\d+)", result.output)[0])
    assert accuracy > 0.6, result.output  # chance: 0.1; 44 steps only
