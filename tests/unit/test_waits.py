"""Wait notes (dp_plugin/engines/waits.py) with an in-memory store."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from dp_plugin.engines import waits
from dp_plugin.engines.handle import Handle
from dp_plugin.engines.waits import WaitBoard
from dp_plugin.errors import CollectiveTimeoutError


class DictStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]


class DeadStore:
    def __init__(self, block: bool) -> None:
        self.block = block
        self.release = threading.Event()

    def _fail(self, *args: Any) -> Any:
        if self.block:
            self.release.wait(5)
        raise RuntimeError("Connection refused")

    set = check = get = _fail


def test_report_names_silent_same_and_different_ranks() -> None:
    store = DictStore()
    boards = [WaitBoard(store, r, range(4)) for r in range(4)]
    boards[1].post("allreduce 'a'")
    boards[2].post("allgather 'b'")
    boards[3].post("allreduce 'a'")
    boards[3].clear()  # its wait ended
    text = boards[0].report("allreduce 'a'")
    assert "rank 1: waiting" in text and "in the same collective" in text, text
    assert "rank 2: waiting" in text and "a different collective, allgather 'b'" in text, text
    assert "rank 3: no note" in text and "Check the log of rank(s) [3] first" in text, text
    assert "rank 0:" not in text, text


def test_every_rank_waiting_elsewhere_points_at_the_order() -> None:
    store = DictStore()
    boards = [WaitBoard(store, r, range(2)) for r in range(2)]
    boards[1].post("broadcast 'x'")
    assert "different orders" in boards[0].report("allreduce 'a'")


def test_a_dead_or_unreachable_store_costs_at_most_the_report_bound(monkeypatch: Any) -> None:
    monkeypatch.setattr(waits, "REPORT_S", 0.2)
    for block in (False, True):
        store = DeadStore(block)
        board = WaitBoard(store, 0, range(2))
        board.post("allreduce 'a'")  # never raises
        text = board.report("allreduce 'a'")
        store.release.set()
        assert "is unknown" in text, text
        assert ("did not answer within 0.2 s" if block else "Connection refused") in text, text


def test_a_rank_that_lost_a_peer_says_which_and_the_report_points_there() -> None:
    store = DictStore()
    boards = [WaitBoard(store, r, range(4)) for r in range(4)]
    assert boards[0].lost_by(1) is None
    boards[1].post_lost([3], "its peer on another host, in the cross-host step")
    boards[1].post_lost([0], "its peer on the same host")  # what follows: not kept
    assert boards[0].lost_by(1) == ([3], "its peer on another host, in the cross-host step")
    text = boards[0].report("allreduce 'a'")
    assert ("rank 1: stopped, as rank 3 (its peer on another host, in the cross-host step) "
            "cannot be reached from it") in text, text
    assert "Check the log of rank(s) [3] first" in text, text
    assert waits.lost_text([3, 5], "") == "one of ranks 3, 5"


def test_reading_what_a_rank_lost_from_a_dead_store_is_bounded(monkeypatch: Any) -> None:
    monkeypatch.setattr(waits, "REPORT_S", 0.2)
    store = DeadStore(True)
    assert WaitBoard(store, 0, range(2)).lost_by(1) is None
    store.release.set()


def test_stall_warning_names_the_ranks_not_there_yet() -> None:
    store = DictStore()
    boards = [WaitBoard(store, r, range(4), stall_warning_s=60) for r in range(4)]
    boards[0].post("allreduce 'a'")
    boards[2].post("allreduce 'a'")
    boards[3].post("broadcast 'b'")
    text = boards[0].stall_warning("allreduce 'a'", 61.0, 1800.0)
    assert text.startswith("rank 0: allreduce 'a' has waited 61 s"), text
    assert "ranks not there yet: [1, 3] (rank 3 waits in broadcast 'b')" in text, text
    assert "waiting in it: [0, 2]" in text, text
    assert "raises after 1800 s (DP_PLUGIN_TIMEOUT)" in text, text
    assert "every 60 s (DP_PLUGIN_STALL_WARNING_SECONDS" in text, text


class _SlowHandle(Handle):
    """Finishes once ``release`` is set."""

    def __init__(self, board: WaitBoard, timeout_s: float) -> None:
        super().__init__("allreduce 'a'", 0, timeout_s, board=board)
        self.release = threading.Event()

    def _test(self) -> bool:
        return self.release.is_set()

    def _block(self, timeout_s: float) -> bool:
        return self.release.wait(timeout_s)


def test_a_long_wait_warns_periodically_then_finishes(caplog: Any) -> None:
    store = DictStore()
    handle = _SlowHandle(WaitBoard(store, 0, range(2), stall_warning_s=0.1), timeout_s=30)
    threading.Timer(0.45, handle.release.set).start()
    with caplog.at_level(logging.WARNING, logger="dp_plugin"):
        handle.wait()
    warnings = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert 3 <= len(warnings) <= 5, warnings
    assert all("ranks not there yet: [1]" in w for w in warnings), warnings
    assert store.data["dp_plugin/waits/0"] == b"", "the note is cleared when the wait ends"


def test_no_stall_warning_when_off_and_the_timeout_is_unchanged(caplog: Any) -> None:
    handle = _SlowHandle(WaitBoard(DictStore(), 0, range(2), stall_warning_s=0), timeout_s=0.3)
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="dp_plugin"), \
            pytest.raises(CollectiveTimeoutError, match=r"did not finish within 0\.3 s"):
        handle.wait()
    assert time.perf_counter() - started >= 0.3
    assert not [r for r in caplog.records if "has waited" in r.getMessage()]
