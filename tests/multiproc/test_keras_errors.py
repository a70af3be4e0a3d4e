"""The Keras adapter's multi-rank errors, with 2 real workers (gloo).

One launch per case: ``layout_mismatch`` covers different models on different ranks (through
DistributedCallback's broadcast, through DistributedOptimizer's bridge and
through DistributedGradientTape: LayoutMismatchError on every rank, no hang)
``strategies`` covers ``backward_passes_per_step`` > 1 with MirroredStrategy
and a model under MultiWorkerMirroredStrategy (refused). See
workers/keras_errors.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "keras_errors.py"
ENV = {"DP_PLUGIN_TIMEOUT": "60", "DP_PLUGIN_ENGINE": "gloo", "TF_CPP_MIN_LOG_LEVEL": "2"}


MARKERS = {
    "layout_mismatch": ("CALLBACK-OK", "BRIDGE-OK", "TAPE-OK"),
    "strategies": ("PASSES-OK", "STRATEGY-OK"),
    "uneven_shards": ("UNEVEN-OK", "STEPS-OK"),
}
assert set(worker_cases(WORKER)) == set(MARKERS)


@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_keras_errors_raise_on_every_rank(case: str) -> None:
    result = run_workers("env", 2, WORKER, args=["--case", case], env=ENV, timeout=180)
    for marker in (*MARKERS[case], "OK"):
        assert_ranks_ok(result, 2, marker=marker)
