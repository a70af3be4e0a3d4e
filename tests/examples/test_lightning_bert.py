"""examples/lightning_bert.py under torchrun and horovodrun: a tiny BERT's loss falls.

The loss lines are ``self.log(..., sync_dist=True)``'s mean over the ranks,
printed by rank 0.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tests.multiproc.harness import run_workers

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "lightning_bert.py"
TINY = ["--layers", "2", "--hidden", "64", "--heads", "2", "--seq-len", "32",
        "--vocab-size", "1000", "--global-batch", "16", "--steps", "12", "--warmup-steps", "2",
        "--lr", "2e-3", "--log-every", "1", "--no-progress"]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                    reason="needs the lightning extra: pip install 'dp_plugin[lightning]'")
@pytest.mark.parametrize("launcher", ["torchrun", "horovodrun"])
def test_loss_falls(launcher: str) -> None:
    result = run_workers(launcher, 2, SCRIPT, args=TINY, timeout=400,
                         env={"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "60"})
    losses = {int(s): float(v) for s, v in re.findall(r"step (\d+) loss (\d+\.\d+)",
                                                      result.output)}
    assert sorted(losses) == list(range(1, 13)), result.output
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (10, 11, 12)) / 3
    assert last < first - 0.1, f"loss did not fall: {losses}"
