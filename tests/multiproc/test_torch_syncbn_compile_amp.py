"""SyncBatchNorm, torch.compile and AMP with real processes (gloo, torchrun-style env).

- SyncBatchNorm at 2 and 3 ranks, uneven (and empty) shards, against
  nn.BatchNorm on the global batch computed inside each worker;
- a ``torch.compile``d model trained with DistributedOptimizer equals an
  uncompiled single-process run. The default case uses the ``aot_eager``
  backend: it runs the same Dynamo capture and AOTAutograd graphs as
  ``inductor`` (which is what decides where gradient hooks fire), without
  inductor's C++ code generation, which costs ~20 s per process on a cold
  cache on 2 cores. The ``inductor`` case is marked ``slow``;
- AMP (bfloat16 autocast + GradScaler through ``synchronize()`` /
  ``skip_synchronize()``) keeps ranks identical, also across a skipped step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKERS = Path(__file__).parent / "workers"
SYNC_BN = WORKERS / "torch_sync_bn.py"
COMPILE_AMP = WORKERS / "torch_compile_amp.py"
ENV = {"DP_PLUGIN_TIMEOUT": "60", "DP_PLUGIN_ENGINE": "gloo"}


@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.parametrize("case", worker_cases(SYNC_BN))
def test_sync_batch_norm_matches_global_batch_norm(case: str, nprocs: int) -> None:
    result = run_workers("env", nprocs, SYNC_BN, args=["--case", case], env=ENV, timeout=120)
    assert_ranks_ok(result, nprocs)


@pytest.mark.parametrize(
    "backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]
)
def test_compiled_model_matches_single_process(backend: str) -> None:
    result = run_workers(
        "env", 2, COMPILE_AMP, args=["--case", "compile", "--backend", backend], env=ENV,
        timeout=240,
    )
    assert_ranks_ok(result, 2)


# Each worker case is one test above or below.
assert worker_cases(COMPILE_AMP) == ["compile", "amp"]


def test_amp_grad_scaler_keeps_ranks_identical() -> None:
    result = run_workers("env", 2, COMPILE_AMP, args=["--case", "amp"], env=ENV, timeout=120)
    assert_ranks_ok(result, 2)
