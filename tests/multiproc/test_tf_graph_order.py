"""Collectives built into graphs run in the same order on every rank.

One launch per case of workers/tf_graph_order.py: nine independent
collectives fetched together by a TF1 ``Session.run``, and inside one
``tf.function``, each run 30 times on 2 ranks; and Horovod's
``broadcast_global_variables`` in a TF1 graph. Without ``graph_order`` the
first two paired the wrong tensors, hung or aborted, and the third raised
``RuntimeError``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "tf_graph_order.py"
ENV = {"DP_PLUGIN_TIMEOUT": "30", "DP_PLUGIN_ENGINE": "gloo", "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_graph_collectives_in_construction_order(case: str) -> None:
    result = run_workers("env", 2, WORKER, args=["--case", case], env=ENV, timeout=300)
    assert_ranks_ok(result, 2)
