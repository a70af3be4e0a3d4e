"""Keras 3 on the torch backend across 2 real workers equals one process on the global batch.

One launch per case of workers/keras_torch_train.py, under the torchrun-style
environment (gloo engine). The ranks are forks of the harness's
``keras-torch`` warm server (``KERAS_BACKEND=torch``): Keras already on the
torch backend, TensorFlow never imported (a Keras process keeps the backend
it first imported; the worker checks TensorFlow stays out).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "keras_torch_train.py"
ENV = {"DP_PLUGIN_TIMEOUT": "60", "KERAS_BACKEND": "torch"}


@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_keras_torch_training_matches_single_process(case: str) -> None:
    result = run_workers("env", 2, WORKER, args=["--case", case],
                         env={**ENV, "DP_PLUGIN_ENGINE": "gloo"}, timeout=240)
    assert_ranks_ok(result, 2)
    assert "engine gloo," in result.output
