"""``DP_PLUGIN_AUTOTUNE=1`` end to end: two ranks (gloo; horovod), a DistributedOptimizer.

One launch per case of ``workers/torch_autotune.py``: with a fake clock each
rank measures other step times and every rank still adopts rank 0's choice
(same step, same plan); with the real clock and one rank sleeping the ranks
still agree; in every case the ranks end bitwise equal and within 1e-5 of a
single process, and the run with autotune ends within 1e-5 of the run
without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multiproc.harness import assert_ranks_ok, run_workers, worker_cases

WORKER = Path(__file__).parent / "workers" / "torch_autotune.py"
assert worker_cases(WORKER) == ["fake_clock", "sleepy", "plain"]

TUNE = {"DP_PLUGIN_AUTOTUNE": "1", "DP_PLUGIN_AUTOTUNE_CANDIDATES": "256,1024,2048",
        "DP_PLUGIN_AUTOTUNE_WARMUP_STEPS": "1", "DP_PLUGIN_AUTOTUNE_STEPS": "2"}


def launch(case: str, out: Path, extra: dict[str, str], launcher: str = "env",
           engine: str = "gloo") -> torch.Tensor:
    # DP_PLUGIN_MIN_BUCKETS=1: the configured 25 MiB stays a candidate as it is.
    env = {"DP_PLUGIN_ENGINE": engine, "DP_PLUGIN_TIMEOUT": "60", "DP_PLUGIN_MIN_BUCKETS": "1",
           **extra}
    result = run_workers(launcher, 2, WORKER, args=["--case", case, "--out", str(out)], env=env,
                         timeout=180)
    assert_ranks_ok(result, 2)
    return torch.load(out / f"{case}.pt")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    """The final parameters of the run without autotune."""
    return launch("plain", tmp_path_factory.mktemp("plain"), {})


@pytest.mark.parametrize(("case", "launcher", "engine"), [
    ("fake_clock", "env", "gloo"),
    ("sleepy", "env", "gloo"),
    ("fake_clock", "horovodrun", "horovod"),  # collectives matched by name
])
def test_every_rank_adopts_rank_zeros_choice(case: str, launcher: str, engine: str,
                                             tmp_path: Path, plain: torch.Tensor) -> None:
    tuned = launch(case, tmp_path, TUNE, launcher, engine)
    assert (tuned - plain).abs().max().item() <= 1e-5
