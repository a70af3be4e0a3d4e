"""examples/recommender.py: per-worker shard files, sparse embedding gradients.

Under torchrun with 2 workers: each worker's shard file exists; the run
with sparse reduction (all-gather of indices and values) and the one with
sparse_as_dense end with the same losses and parameters within 1e-5; the
model's hit-rate@10 beats the popularity baseline.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.multiproc.harness import run_workers

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "recommender.py"


@pytest.mark.multiproc
@pytest.mark.slow
def test_sparse_reduction_matches_dense_and_beats_popularity(tmp_path: Path) -> None:
    # Two epochs: long enough to beat popularity, short enough that the two
    # reductions' different float summation orders stay below 1e-5.
    args = ["--data-dir", str(tmp_path), "--users", "1200", "--items", "200", "--epochs", "2",
            "--lr", "0.2", "--dim", "16", "--hidden", "32"]
    runs = {}
    for dense in (False, True):  # dense under the harness's env launcher (ranks forked warm)
        result = run_workers("env" if dense else "torchrun", 2, SCRIPT,
                             args=[*args, *(["--sparse-as-dense"] if dense else [])],
                             env={"DP_PLUGIN_TIMEOUT": "60"}, timeout=180)
        runs[dense] = result.output
    assert sorted(p.name for p in tmp_path.glob("*.npz")) == [
        "interactions-00000-of-00002.npz", "interactions-00001-of-00002.npz"]
    for output in runs.values():
        model, pop = map(float, re.findall(r"hit-rate@10 model (\S+) popularity (\S+)",
                                           output)[0])
        assert model > pop + 0.03, output
        losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", output)]
        assert losses[-1] < losses[0], output
    sparse, dense = ([float(v) for v in re.findall(r"(?:loss|checksum|model) (\d+\.\d+)",
                                                    runs[d])] for d in (False, True))
    assert len(sparse) == len(dense) == 4  # 2 losses, hit-rate, sum of |parameters|
    for a, b in zip(sparse, dense, strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (sparse, dense)
