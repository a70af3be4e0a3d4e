"""What a Horovod script gets under horovodrun by default: ``workers/horovodrun_default.py``.

``auto`` runs the gloo engine (measured faster than Horovod's ring on CPUs)
and never loads Horovod's library; ``DP_PLUGIN_ENGINE=horovod`` gets
Horovod's ring back. The Horovod calls a script makes answer the same under
both. A rank without Horovod takes part in the job's choice: an explicit
``horovod`` is refused on every rank at once, ``auto`` runs gloo.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers

WORKER = Path(__file__).parent / "workers" / "horovodrun_default.py"
COLLECTIVES = Path(__file__).parent / "workers" / "torch_collectives.py"


@pytest.mark.multiproc
@pytest.mark.parametrize(("engine", "n"), [("auto", 3), ("horovod", 3)])
def test_default_engine_under_horovodrun(engine: str, n: int) -> None:
    env = {"DP_PLUGIN_TIMEOUT": "30"}
    if engine != "auto":
        env["DP_PLUGIN_ENGINE"] = engine
    result = run_workers("horovodrun", n, WORKER, args=["--case", "default"], env=env,
                         timeout=180)
    assert_ranks_ok(result, n)
    expected = "gloo horovod loaded False" if engine == "auto" else "horovod horovod loaded True"
    assert len(re.findall(rf"rank \d engine {expected}", result.output)) == n, result.output


@pytest.mark.multiproc
def test_a_rank_without_horovod_takes_part_in_the_choice() -> None:
    """DP_PLUGIN_TIMEOUT (300 s) is longer than the run's timeout: a rank
    that waited for the others' check would fail the run, not slow it."""
    result = run_workers("horovodrun", 3, WORKER, args=["--case", "hidden"],
                         env={"DP_PLUGIN_TIMEOUT": "300"}, timeout=150)
    assert_ranks_ok(result, 3)
    refused = re.findall(r"refused horovod: rank (\d): engine 'horovod' cannot run this job: "
                         r"rank\(s\) 1: Horovod is not installed", result.output)
    assert sorted(refused) == ["0", "1", "2"], result.output


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["collectives", "mistakes"])
def test_every_torch_collective_under_horovodrun_by_default(case: str) -> None:
    """The collectives battery (every op, process sets, rank-dependent
    mistakes) at 3 ranks under horovodrun with auto, as it runs on each
    engine by name in test_torch_collectives.py."""
    result = run_workers("horovodrun", 3, COLLECTIVES, args=["--engine", "auto", "--case", case],
                         env={"DP_PLUGIN_TIMEOUT": "60"}, timeout=240)
    assert_ranks_ok(result, 3)
