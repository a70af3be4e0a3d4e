"""``Trainer(strategy="horovod")`` (dp_plugin.lightning) in real processes, 2 ranks, Gloo.

The worker is ``workers/lightning_strategy.py`` (its docstring lists what each
case checks):

- ``fit`` under the env launcher, torchrun and horovodrun trains to the same
  weights as ``strategy="ddp"`` on the same seed (within 1e-6), ranks bitwise
  equal: plain, gradient accumulation, clipping by value and by norm,
  bf16-mixed. The DDP reference runs once, under the env launcher (DDP cannot
  run under horovodrun);
- ``features``: ``self.log(sync_dist=True)``, ``predict``, two optimizers in
  manual optimization, checkpoint save and resume;
- ``uneven``: 3 batches on one rank, 4 on the other (loaders of their own):
  under horovodrun, no hang, ranks bitwise equal, at the weights of DDP's
  ``Join``; on the gloo engine, a clear error on every rank;
- ``fabric``: ``Fabric(strategy="horovod")`` with ``fabric.backward`` and
  clipping equals one process on the global batches, ranks bitwise equal;
- ``raise``: a rank that raises in ``training_step`` ends every rank with an
  error naming it, within the timeout: no hang.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                       reason="needs the lightning extra: pip install 'dp_plugin[lightning]'"),
]

WORKER = Path(__file__).parent / "workers" / "lightning_strategy.py"
ENV = {"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "60"}
NPROCS = 2


def _fit(launcher: str, strategy: str, out: Path) -> list[dict[str, list[float]]]:
    """Each rank's final weights per fit configuration."""
    result = run_workers(launcher, NPROCS, WORKER, env=ENV, timeout=300,
                         args=["--case", "fit", "--strategy", strategy, "--out", str(out)])
    assert_ranks_ok(result, NPROCS)
    return [json.loads((out / f"fit.{strategy}.rank{r}.json").read_text())
            for r in range(NPROCS)]


@pytest.fixture(scope="module")
def ddp_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    ranks = _fit("env", "ddp", tmp_path_factory.mktemp("ddp"))
    assert ranks[0] == ranks[1], "DDP's ranks differ"
    return ranks[0]


@pytest.mark.parametrize("launcher", ["env", "torchrun", "horovodrun"])
def test_fit_trains_as_ddp_does(launcher: str, ddp_weights: dict[str, list[float]],
                                tmp_path: Path) -> None:
    ranks = _fit(launcher, "horovod", tmp_path)
    assert ranks[0].keys() == ddp_weights.keys()
    for name, want in ddp_weights.items():
        assert ranks[0][name] == ranks[1][name], f"{name}: the ranks' weights differ"
        worst = max(abs(a - b) for a, b in zip(ranks[0][name], want, strict=True))
        assert worst <= 1e-6, f"{name}: {worst:g} from strategy='ddp'"
    for name in ("accumulate", "clip_value", "clip_norm"):  # each changes the training
        assert ddp_weights[name] != ddp_weights["plain"], name


def test_sync_dist_predict_manual_optimization_and_resume(tmp_path: Path) -> None:
    result = run_workers("env", NPROCS, WORKER, env=ENV, timeout=300,
                         args=["--case", "features", "--out", str(tmp_path)])
    assert_ranks_ok(result, NPROCS)


def test_uneven_batches_join_as_ddp_join_does(tmp_path: Path) -> None:
    # Horovod's engine: torch.distributed stays uninitialized (see the next test).
    result = run_workers("horovodrun", NPROCS, WORKER, timeout=240,
                         env={**ENV, "DP_PLUGIN_ENGINE": "horovod"},
                         args=["--case", "uneven", "--out", str(tmp_path)])
    assert_ranks_ok(result, NPROCS)


def test_uneven_batches_on_gloo_are_refused_on_every_rank(tmp_path: Path) -> None:
    """On the gloo engine Lightning's own per-batch broadcast shares the group:
    a clear error at the epoch's first batch, on every rank."""
    result = run_workers("env", NPROCS, WORKER, env=ENV, timeout=240, check=False,
                         args=["--case", "uneven", "--out", str(tmp_path)])
    assert all(code != 0 for code in result.returncodes), result.output
    for rank in range(NPROCS):
        mine = "\n".join(line for line in result.output.splitlines()
                         if line.startswith(f"[rank {rank}]"))
        assert "different numbers of training batches per epoch (rank 0: 3; rank 1: 4)" \
            in mine, mine


@pytest.mark.parametrize("launcher", ["env", "horovodrun"])
def test_fabric_trains_as_one_process_on_the_global_batch(launcher: str, tmp_path: Path) -> None:
    result = run_workers(launcher, NPROCS, WORKER, env=ENV, timeout=240,
                         args=["--case", "fabric", "--out", str(tmp_path)])
    assert_ranks_ok(result, NPROCS)


def test_a_rank_that_raises_ends_every_rank_with_an_error() -> None:
    result = run_workers("env", NPROCS, WORKER, env=ENV, timeout=240, check=False,
                         args=["--case", "raise"])
    assert all(code != 0 for code in result.returncodes), result.output
    assert "RuntimeError: a deliberate failure on rank 1" in result.output, result.output
    rank0 = "\n".join(line for line in result.output.splitlines()
                      if line.startswith("[rank 0]"))
    # dp_plugin's error on rank 0 names the rank that is gone.
    assert "dp_plugin.errors." in rank0 and "rank 1" in rank0, rank0
