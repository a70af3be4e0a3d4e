"""dp_plugin.tensorflow's Horovod tensor API on 2 real ranks (gloo, torchrun-style environment).

One launch per case of workers/tf_collectives.py: values of every tensor
collective eagerly and in ``tf.function``, their Horovod gradients, object
collectives / join / process sets / build queries, SyncBatchNormalization and
sparse (``tf.IndexedSlices``) gradients.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "tf_collectives.py"
ENV = {"DP_PLUGIN_TIMEOUT": "60", "DP_PLUGIN_ENGINE": "gloo", "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.parametrize("case", worker_cases(WORKER))
def test_tensorflow_collectives_on_two_ranks(case: str) -> None:
    result = run_workers("env", 2, WORKER, args=["--case", case], env=ENV, timeout=240)
    assert_ranks_ok(result, 2)
