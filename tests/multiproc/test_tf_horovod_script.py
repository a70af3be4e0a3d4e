"""Horovod's Keras example runs under horovodrun with only its import changed.

workers/horovod_keras_script.py is Horovod 0.28.1's tensorflow2_keras_mnist.py
(synthetic data, Keras 3's one compile() change) with ``import
dp_plugin.keras as hvd``: it spells ``hvd.callbacks.X``, wraps the optimizer,
warms the learning rate up and checkpoints on rank 0. Under horovodrun
(Horovod's ring as the engine) it must train, checkpoint, and leave both
ranks with the same weights.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.multiproc.harness import assert_ranks_ok, run_workers

SCRIPT = Path(__file__).parent / "workers" / "horovod_keras_script.py"
DP_IMPORT = "import dp_plugin.keras as hvd"


def test_horovod_keras_example_runs_unchanged_under_horovodrun(tmp_path: Path) -> None:
    text = SCRIPT.read_text()
    assert text.count(DP_IMPORT) == 1 and "dp_plugin" not in text.replace(DP_IMPORT, "")
    assert "hvd.callbacks.BroadcastGlobalVariablesCallback(0)" in text
    env = {"DP_PLUGIN_ENGINE": "horovod", "DP_PLUGIN_TIMEOUT": "60", "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = run_workers("horovodrun", 2, SCRIPT, args=[str(tmp_path)], env=env, timeout=240)
    assert_ranks_ok(result, 2)
    digests = dict(re.findall(r"rank (\d) weights ([0-9a-f]{64})", result.output))
    assert set(digests) == {"0", "1"}, result.output
    assert digests["0"] == digests["1"], "the ranks ended with different weights"
    assert "finished gradual learning rate warmup" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-1.keras", "checkpoint-2.keras"]
