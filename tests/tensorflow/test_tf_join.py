"""TF's ``join()`` names the last rank by torch's rule, not by the hosts' clocks.

Three ranks on a fake thread group (``tests.unit.fakes``); each rank's
``time.time_ns`` is skewed by its own offset, as clocks on different hosts
are. A TF rank that joined answered none of the others' collectives, so
every rank joined "at the same point" and ``dp_plugin.agree.join.last_joined``
names the highest rank on every rank, whatever the clocks say.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from dp_plugin.launch import runtime
from dp_plugin.tensorflow import functions
from tests.unit.fakes import FakeEngine, make_thread_group, run_ranks

SKEW_NS = {0: 0, 1: 0, 2: -3_600 * 10**9}
"""Rank 2's clock runs an hour behind (the others' agree)."""


def test_join_ignores_clock_skew_between_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    engines = make_thread_group(3)
    mine = threading.local()
    real_time_ns = time.time_ns

    def skewed_time_ns() -> int:
        return real_time_ns() + SKEW_NS.get(getattr(mine, "rank", 0), 0)

    monkeypatch.setattr(time, "time_ns", skewed_time_ns)
    monkeypatch.setattr(runtime, "engine", lambda: mine.engine)

    def body(e: FakeEngine) -> Any:
        mine.rank, mine.engine = e.rank, e
        if e.rank == 2:  # joins last by the wall clock, though its clock says first
            time.sleep(0.2)
        return int(functions.join().numpy())

    assert run_ranks(engines, body) == [2, 2, 2]
