"""MetricAverageCallback with real processes (gloo, torchrun-style environment).

One launch of 2 workers per case: ``metric_average`` covers epoch-end logs averaged over ranks (also
validation metrics and a vector entry) and identical on every rank, and the
errors for different metric names or a non-numeric value, raised on every
rank instead of hanging; ``horovod_callbacks`` the three callbacks of a Horovod script
(DistributedCallback, MetricAverageCallback, LearningRateWarmupCallback)
in one fit. See workers/keras_metric_average.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "keras_metric_average.py"
ENV = {"DP_PLUGIN_TIMEOUT": "60", "DP_PLUGIN_ENGINE": "gloo", "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_metric_average_and_warmup_callbacks_on_two_ranks(case: str) -> None:
    result = run_workers("env", 2, WORKER, args=["--case", case], env=ENV, timeout=180)
    assert_ranks_ok(result, 2)
    if case != "horovod_callbacks":
        return
    # verbose=1: the end of the warmup is announced once, by rank 0.
    announced = "Epoch 1: finished gradual learning rate warmup to 0.1."
    assert f"[rank 0] {announced}" in result.output, result.output
    assert result.output.count(announced) == 1, result.output
