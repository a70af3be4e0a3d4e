"""dp_plugin.torch end to end: real processes, real launchers and engines.

- ``torch_equivalence.py``: DistributedOptimizer (SGD with momentum, Adam,
  backward_passes_per_step=2, float32 Adam) after broadcast_parameters and
  broadcast_optimizer_state ends bitwise identical on all ranks and within
  1e-5 of a single-process run; ``join()`` with uneven data; ``groups=``
  trains bitwise as without groups, each group one bucket. One launch per
  case where the ranks are forked warm (env, horovodrun); under torchrun and
  mpirun, whose ranks start fresh, one launch runs every case one after the
  other (``--case A B ...``): there a launch costs more than a case.
- ``typical_horovod_script.py``: a typical Horovod PyTorch script whose only
  dp_plugin line is its import; it trains, checkpoints, and its loss falls.
  The same text with ``import horovod.torch as hvd`` runs under real Horovod.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.multiproc.harness import assert_cases_ok, assert_ranks_ok, run_workers, worker_cases

WORKERS = Path(__file__).parent / "workers"
EQUIVALENCE = WORKERS / "torch_equivalence.py"
TYPICAL = WORKERS / "typical_horovod_script.py"
DP_IMPORT = "import dp_plugin.torch as hvd"
HOROVOD_IMPORT = "import horovod.torch as hvd"

WARM_RUNS = [("env", "gloo", 3), ("horovodrun", "horovod", 2)]
FRESH_RUNS = [  # gloo at 2 ranks runs under torchrun (the env launcher sets the same variables)
    ("torchrun", "gloo", 2),
    ("mpirun", "mpi", 2),
    ("mpirun", "mpi", 3),
]


@pytest.mark.parametrize(("launcher", "engine", "nprocs"), WARM_RUNS)
@pytest.mark.parametrize("case", worker_cases(EQUIVALENCE))
def test_training_matches_single_process(case: str, launcher: str, engine: str,
                                         nprocs: int) -> None:
    result = run_workers(
        launcher, nprocs, EQUIVALENCE, args=["--case", case],
        env={"DP_PLUGIN_ENGINE": engine, "DP_PLUGIN_TIMEOUT": "60"}, timeout=240,
    )
    assert_ranks_ok(result, nprocs)


@pytest.mark.parametrize(("launcher", "engine", "nprocs"), FRESH_RUNS)
def test_training_matches_single_process_every_case_in_one_launch(
        launcher: str, engine: str, nprocs: int) -> None:
    cases = worker_cases(EQUIVALENCE)
    result = run_workers(
        launcher, nprocs, EQUIVALENCE, args=["--case", *cases],
        env={"DP_PLUGIN_ENGINE": engine, "DP_PLUGIN_TIMEOUT": "60"}, timeout=300,
    )
    assert_cases_ok(result, nprocs, cases)


COPIES = {"DP_PLUGIN_GRADIENT_AS_BUCKET_VIEW": "0", "DP_PLUGIN_FUSION_THRESHOLD": "256"}
"""Gradients copied into 256-byte buckets: several copy-mode buckets take
turns on two slabs (``dp_plugin.reduce.bucket``), so later ones wait for earlier
ones, and a joined rank defers them instead of blocking."""


@pytest.mark.parametrize(("case", "launcher", "engine", "nprocs"), [
    ("optimizers", "env", "gloo", 3),
    ("join_process_set", "env", "gloo", 3),
    ("join_process_set", "horovodrun", "horovod", 2),
])
def test_copies_in_small_buckets_match_single_process(case: str, launcher: str, engine: str,
                                                      nprocs: int) -> None:
    result = run_workers(
        launcher, nprocs, EQUIVALENCE, args=["--case", case],
        env={"DP_PLUGIN_ENGINE": engine, "DP_PLUGIN_TIMEOUT": "60", **COPIES}, timeout=240,
    )
    assert_ranks_ok(result, nprocs)
    fused = re.findall(r"(\d+) buckets, slabs (\d+) bytes", result.output)
    assert len(fused) >= nprocs, result.output  # a line per rank (and optimizer)
    for buckets, slab_bytes in fused:
        assert int(buckets) >= 4 and 0 < int(slab_bytes) <= 2 * 256, result.output


def _final_losses(output: str) -> list[float]:
    return [float(m) for m in re.findall(r"epoch \d+ loss ([0-9.]+)", output)]


def test_typical_horovod_script_runs_with_only_the_import_changed(tmp_path: Path) -> None:
    env = {"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "60"}
    first = run_workers("env", 2, TYPICAL, args=[str(tmp_path), "--epochs", "2"], env=env,
                        timeout=180)
    assert (tmp_path / "checkpoint.pt").exists(), first.output
    # Resume: only rank 0 loads the checkpoint; the broadcasts give the
    # other rank its parameters and (not yet created) optimizer state.
    second = run_workers("env", 2, TYPICAL, args=[str(tmp_path), "--epochs", "4"], env=env,
                         timeout=180)
    assert "resumed from epoch 2" in second.output, second.output
    losses = _final_losses(first.output) + _final_losses(second.output)
    assert len(losses) == 4, first.output + second.output
    assert losses[-1] < losses[1] < losses[0], f"loss did not fall: {losses}"


def test_typical_script_differs_from_horovod_only_in_the_import(tmp_path: Path) -> None:
    text = TYPICAL.read_text()
    assert text.count(DP_IMPORT) == 1
    assert "dp_plugin" not in text.replace(DP_IMPORT, ""), (
        "the typical script must use dp_plugin only through its import line"
    )
    horovod_version = tmp_path / "horovod_script.py"
    horovod_version.write_text(text.replace(DP_IMPORT, HOROVOD_IMPORT))
    checkpoints = tmp_path / "ckpt"
    checkpoints.mkdir()
    result = run_workers("horovodrun", 2, horovod_version, args=[str(checkpoints)], timeout=180)
    losses = _final_losses(result.output)
    assert len(losses) >= 2 and losses[-1] < losses[0], result.output
    assert (checkpoints / "checkpoint.pt").exists(), result.output
