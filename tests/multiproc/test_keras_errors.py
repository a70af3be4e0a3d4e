"""The Keras adapter's multi-rank errors, with 2 real workers (gloo).

One launch covers different models on different ranks (through
DistributedCallback's broadcast, through DistributedOptimizer's bridge and
through DistributedGradientTape: LayoutMismatchError on every rank, no hang)
``backward_passes_per_step`` > 1 with MirroredStrategy and a model under
MultiWorkerMirroredStrategy (refused). See
workers/keras_errors.py.
"""

from __future__ import annotations

from pathlib import Path

from tests.multiproc.harness import assert_ranks_ok, run_workers

WORKER = Path(__file__).parent / "workers" / "keras_errors.py"
ENV = {"DP_PLUGIN_TIMEOUT": "60", "DP_PLUGIN_ENGINE": "gloo", "TF_CPP_MIN_LOG_LEVEL": "2"}


def test_keras_errors_raise_on_every_rank() -> None:
    result = run_workers("env", 2, WORKER, env=ENV, timeout=180)
    for marker in ("CALLBACK-OK", "BRIDGE-OK", "TAPE-OK", "PASSES-OK", "STRATEGY-OK", "OK"):
        assert_ranks_ok(result, 2, marker=marker)
