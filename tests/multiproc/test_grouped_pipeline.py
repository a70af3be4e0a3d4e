"""A grouped all-reduce large enough to travel in chunks, and with tensors
reduced alone in place, in real processes (workers/grouped_pipeline.py):
exact Sum, Average within 1e-5, ranks bitwise equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiproc.harness import assert_ranks_ok, run_workers

WORKER = Path(__file__).parent / "workers" / "grouped_pipeline.py"


@pytest.mark.multiproc
@pytest.mark.parametrize(("engine", "nprocs"), [("gloo", 3)])
def test_chunked_grouped_allreduce_matches_reference(engine: str, nprocs: int) -> None:
    result = run_workers("env", nprocs, WORKER, args=["--engine", engine, "--case", "chunked"],
                         env={"DP_PLUGIN_TIMEOUT": "60", "DP_PLUGIN_SHARED_MEMORY": "0"},
                         timeout=180)
    assert_ranks_ok(result, nprocs)
