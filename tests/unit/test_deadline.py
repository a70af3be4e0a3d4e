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


def test_standing_holds_for_the_issuing_thread_only_and_nests() -> None:
    """join's listener issues inside ``standing()``; a collective another
    thread issues meanwhile (a transport's, an optimizer's) keeps its deadline."""
    from dp_plugin.engines.deadline import is_standing, standing

    seen: list[bool] = []
    inside, checked = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait(5)
        seen.append(is_standing())
        checked.set()

    thread = threading.Thread(target=other)
    thread.start()
    assert not is_standing()
    with standing():
        with standing(False):  # nested: stays standing
            assert is_standing()
        inside.set()
        checked.wait(5)
        assert is_standing()
    thread.join(5)
    assert seen == [False] and not is_standing()
    with standing(False):
        assert not is_standing()
