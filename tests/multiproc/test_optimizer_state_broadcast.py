"""broadcast_optimizer_state with frozen parameters (workers/optimizer_state_frozen.py)."""

from __future__ import annotations

from pathlib import Path

from tests.multiproc.harness import assert_ranks_ok, run_workers

WORKER = Path(__file__).parent / "workers" / "optimizer_state_frozen.py"


def test_a_frozen_parameter_has_no_state_to_broadcast() -> None:
    result = run_workers("env", 2, WORKER, args=["--case", "frozen"],
                         env={"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "60"}, timeout=120)
    assert_ranks_ok(result, 2)


def test_horovods_broadcast_state_no_grad() -> None:
    """Horovod's ``test_broadcast_state_no_grad``: a zero ``.grad`` after
    ``broadcast_optimizer_state`` (it was None, and ``hvd.broadcast`` of it
    raised ``'NoneType' object is not iterable``); 3 ranks."""
    result = run_workers("env", 3, WORKER, args=["--case", "no_grad"],
                         env={"DP_PLUGIN_ENGINE": "gloo", "DP_PLUGIN_TIMEOUT": "60"}, timeout=120)
    assert_ranks_ok(result, 3)
