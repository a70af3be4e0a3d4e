"""Ray Train v2 with dp_plugin's backend (``dp_plugin.ray.train``), on a
one-node Ray head that the driver starts (1 CPU, two workers of 0.5 CPU).

One fit under ``HorovodTrainer``, with a worker that SIGKILLs itself
mid-run, which Ray restarts (``FailureConfig``), the loop resuming from its
last reported checkpoint: every rank ends with the weights of a
single-process reference of the same loop, bitwise (the reference averages
the two ranks' gradients by hand). The comparison with Ray's ``TorchTrainer``
(DDP) is the two-host run in test_ray.py. The
two-host run is in test_ray.py (it shares that module's cluster).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.schedulers import proc

pytest.importorskip("ray.train.v2")
DRIVER = Path(__file__).resolve().parent / "workers" / "ray_train_v2.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def parse(out: str) -> tuple[dict[str, list[str]], dict[str, list[list[int]]], dict[str, str]]:
    """(weights per kind by rank, dp_plugin's ranks per kind, attempts per kind)."""
    weights: dict[str, list[str]] = {}
    for kind, _rank, hexed in re.findall(r"^weights (\w+) ([\d-]) (\w+)$", out, flags=re.M):
        weights.setdefault(kind, []).append(hexed)
    ranks: dict[str, list[list[int]]] = {}
    for kind, _rank, text in re.findall(r"^ranks (\w+) (\d) (\[.*\])$", out, flags=re.M):
        ranks.setdefault(kind, []).append(json.loads(text))
    attempts = dict(re.findall(r"^attempts (\w+) (.*)$", out, flags=re.M))
    return weights, ranks, attempts


def test_horovod_trainer_resumes_a_killed_worker_to_the_reference_weights(
        tmp_path: Path) -> None:
    done = proc.run([sys.executable, str(DRIVER), str(tmp_path), "--local", "killed"],
                    proc.clean_env(), timeout=840)
    out = done.stdout
    assert done.returncode == 0, out
    assert "error killed None" in out, out
    weights, ranks, attempts = parse(out)
    # both ranks hold the reference's weights, after the kill and the resume
    assert len(weights["killed"]) == 2 and len(weights["reference"]) == 1, out
    assert set(weights["killed"]) == set(weights["reference"]), weights
    # dp_plugin's rank is Ray Train's world rank; both workers on the one node
    assert sorted(ranks["killed"]) == [[0, 0, 2, 0], [1, 1, 2, 1]], out
    # both workers restarted once, resuming after a checkpoint of the first
    # attempt (the last that Ray had registered when rank 1 died: step 1 or 3)
    starts = sorted(attempts["killed"].split(), key=lambda a: (a.split(":")[1], a))
    assert starts[:2] == ["0:0", "1:0"], out
    assert starts[2:] in (["0:2", "1:2"], ["0:4", "1:4"]), out
    assert (tmp_path / "killed-once").exists()


def test_a_foreign_backend_config_is_refused_with_the_fix() -> None:
    from ray.train.torch import TorchConfig

    from dp_plugin.ray.train import HorovodTrainer

    with pytest.raises(TypeError, match=r"dp_plugin.ray.train.BackendConfig.*DP_PLUGIN_TIMEOUT"):
        HorovodTrainer(lambda: None, backend_config=TorchConfig())
