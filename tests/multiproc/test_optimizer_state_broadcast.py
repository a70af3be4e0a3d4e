"""broadcast_optimizer_state with a frozen parameter (workers/optimizer_state_frozen.py)."""

from __future__ import annotations

from pathlib import Path

from tests.multiproc.harness import assert_ranks_ok, run_workers

WORKER = Path(__file__).parent / "workers" / "optimizer_state_frozen.py"


def test_a_frozen_parameter_has_no_state_to_broadcast() -> None:
    result = run_workers("env", 2, WORKER, args=["--case", "frozen"],
                         env={"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "60"}, timeout=120)
    assert_ranks_ok(result, 2)
