"""Ray Train v2 with dp_plugin's backend (``dp_plugin.ray.train``).

The driver (workers/ray_train_v2.py) and the parser of what it prints,
and the refusal of a foreign backend config. The fits themselves run on
test_ray.py's two-host cluster, in its one driver (one Ray session): one
``HorovodTrainer`` and one ``TorchTrainer`` fit with a worker on each host,
and a ``HorovodTrainer`` fit with both workers on one host, one of them
SIGKILLing itself mid-run, which Ray restarts (``FailureConfig``), the loop
resuming from its last reported checkpoint; all end with the weights of a
single-process reference of the same loop, bitwise (the reference averages
the two ranks' gradients by hand).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("ray.train.v2")
DRIVER = Path(__file__).resolve().parent / "workers" / "ray_train_v2.py"


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


def test_a_foreign_backend_config_is_refused_with_the_fix() -> None:
    from ray.train.torch import TorchConfig

    from dp_plugin.ray.train import HorovodTrainer

    with pytest.raises(TypeError, match=r"dp_plugin.ray.train.BackendConfig.*DP_PLUGIN_TIMEOUT"):
        HorovodTrainer(lambda: None, backend_config=TorchConfig())
