"""A grouped all-reduce large enough to travel in chunks, and with tensors
reduced alone in place, in real processes (workers/grouped_pipeline.py):
exact Sum, Average within 1e-5, ranks bitwise equal. The out-of-place one
against the in-place one and a reference, every dtype, at 2 and 3 ranks
and on the hierarchical path (two fake hosts of two ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers

WORKER = Path(__file__).parent / "workers" / "grouped_pipeline.py"
FAKE_HOSTS = Path(__file__).parent / "workers" / "fake_hosts.py"


@pytest.mark.multiproc
@pytest.mark.parametrize(("engine", "nprocs"), [("gloo", 3)])
def test_chunked_grouped_allreduce_matches_reference(engine: str, nprocs: int) -> None:
    result = run_workers("env", nprocs, WORKER, args=["--engine", engine, "--case", "chunked"],
                         env={"DP_PLUGIN_TIMEOUT": "60", "DP_PLUGIN_SHARED_MEMORY": "0"},
                         timeout=180)
    assert_ranks_ok(result, nprocs)


@pytest.mark.multiproc
@pytest.mark.parametrize(("nprocs", "shared_memory"), [(2, "0"), (3, "1")],
                         ids=["2-gloo-tcp", "3-shared-memory"])
def test_out_of_place_grouped_allreduce_matches_in_place_and_reference(
        nprocs: int, shared_memory: str) -> None:
    result = run_workers("env", nprocs, WORKER, args=["--engine", "gloo", "--case", "out_of_place"],
                         env={"DP_PLUGIN_TIMEOUT": "60", "DP_PLUGIN_SHARED_MEMORY": shared_memory},
                         timeout=180)
    assert_ranks_ok(result, nprocs)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_out_of_place_grouped_allreduce_on_the_hierarchical_path() -> None:
    result = run_workers("env", 4, FAKE_HOSTS,
                         [str(WORKER), "--engine", "gloo", "--case", "out_of_place"],
                         env={"DP_PLUGIN_TIMEOUT": "60", "DP_TEST_RANKS_PER_HOST": "2",
                              "DP_PLUGIN_HIERARCHICAL_ALLREDUCE": "1"}, timeout=240)
    assert_ranks_ok(result, 4)
