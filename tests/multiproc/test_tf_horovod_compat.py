"""Horovod's TensorFlow error types and worker-local gradients on 2 ranks.

One launch per case of workers/tf_horovod_compat.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "tf_horovod_compat.py"
ENV = {"DP_PLUGIN_TIMEOUT": "30", "DP_PLUGIN_ENGINE": "gloo", "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_horovod_tensorflow_compat_on_two_ranks(case: str) -> None:
    result = run_workers("env", 2, WORKER, args=["--case", case], env=ENV, timeout=300)
    assert_ranks_ok(result, 2)
