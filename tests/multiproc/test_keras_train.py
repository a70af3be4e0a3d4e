"""Keras 3 training across 2 real workers equals one process on the global batch.

Under the torchrun-style environment (gloo engine) every case of
workers/keras_train.py runs; under horovodrun (Horovod's ring) and mpirun
(MPI) the three equivalence cases: ``model.fit`` with the default strategy
and with MirroredStrategy over 2 logical CPUs, and a custom loop with
DistributedGradientTape. One launch per case, except under mpirun, whose
ranks start fresh (TensorFlow's import in every rank costs more than a
case): one launch runs the three one after the other (``--case A B C``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_cases_ok, assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "keras_train.py"
ENV = {"DP_PLUGIN_TIMEOUT": "60", "TF_CPP_MIN_LOG_LEVEL": "2"}
CORE_CASES = ("fit", "mirrored", "tape")
AUTOTUNE = {"DP_PLUGIN_AUTOTUNE": "1", "DP_PLUGIN_AUTOTUNE_CANDIDATES": "64",
            "DP_PLUGIN_AUTOTUNE_WARMUP_STEPS": "0", "DP_PLUGIN_AUTOTUNE_STEPS": "1"}
"""For ``fit_autotune``: 64 bytes and the default plan, 1 + 2 steps of tuning out of 4."""
RUNS = [
    *(pytest.param("env", "gloo", case, id=f"{case}-env") for case in worker_cases(WORKER)),
    *(pytest.param("horovodrun", "horovod", case, id=f"{case}-horovodrun")
      for case in CORE_CASES),
]


@pytest.mark.parametrize(("launcher", "engine", "case"), RUNS)
def test_keras_training_matches_single_process(launcher: str, engine: str, case: str) -> None:
    env = {**ENV, "DP_PLUGIN_ENGINE": engine, **(AUTOTUNE if case == "fit_autotune" else {})}
    # fit-env and fit-horovodrun start fresh interpreters (the others are
    # forked from the harness's warm server): TensorFlow's own start and exit.
    fresh = case == "fit" and launcher in ("env", "horovodrun")
    result = run_workers(launcher, 2, WORKER, args=["--case", case], env=env, timeout=240,
                         fresh=fresh)
    assert_ranks_ok(result, 2)
    assert f"engine {engine}," in result.output


def test_keras_training_matches_single_process_under_mpirun_in_one_launch() -> None:
    result = run_workers("mpirun", 2, WORKER, args=["--case", *CORE_CASES],
                         env={**ENV, "DP_PLUGIN_ENGINE": "mpi"}, timeout=300)
    assert_cases_ok(result, 2, CORE_CASES)
    assert "engine mpi," in result.output
