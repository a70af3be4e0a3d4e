"""The torch and TensorFlow adapters on the one request path, on 2 real ranks (gloo).

See workers/request_paths.py: zero-row alltoall, bool/uint16 all-gather and
all-to-all, integer Average reduce-scatter, torch and TF reduce-scatter
bitwise equal, float16 scaled in float32, and a TF all-gather costing the
engine calls of torch's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "request_paths.py"
ENV = {"DP_PLUGIN_TIMEOUT": "60", "DP_PLUGIN_ENGINE": "gloo", "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_both_adapters_on_the_request_path(case: str) -> None:
    result = run_workers("env", 2, WORKER, args=["--case", case], env=ENV, timeout=240)
    assert_ranks_ok(result, 2)
