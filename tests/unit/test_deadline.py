"""dp_plugin.engines.deadline.bounded: a wait without its own timeout gets one."""

from __future__ import annotations

import threading
import time

import pytest

from dp_plugin.engines.deadline import bounded
from dp_plugin.errors import CollectiveTimeoutError


def test_result_and_exception_pass_through() -> None:
    assert bounded(lambda: 42, what="x", rank=0, timeout_s=5) == 42

    def fail() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        bounded(fail, what="x", rank=0, timeout_s=5)


def test_a_wait_that_never_returns_raises_within_the_timeout() -> None:
    never = threading.Event()
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        bounded(never.wait, what="mpi Comm.Split (subgroup 'x')", rank=3, timeout_s=0.5)
    assert time.monotonic() - start < 5
    text = str(info.value)
    assert text.startswith("rank 3: mpi Comm.Split (subgroup 'x') did not finish within 0.5 s")
    assert "DP_PLUGIN_TIMEOUT" in text and "another rank" in text
    never.set()
