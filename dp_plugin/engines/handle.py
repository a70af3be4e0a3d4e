"""Handles: in-flight collectives that honour the timeout (``Handle.wait``).
With a ``WaitBoard``, a long wait leaves a note and logs stall warnings, and
the timeout error says what every other rank was waiting in (``waits.py``).
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from dp_plugin.engines.deadline import poll
from dp_plugin.engines.waits import WaitBoard
from dp_plugin.errors import CollectiveTimeoutError

log = logging.getLogger("dp_plugin")


class Handle(ABC):
    """An in-flight collective. ``wait`` blocks until done or the timeout.

    ``on_timeout(description)`` runs when ``wait`` raises
    ``CollectiveTimeoutError``; engines pass their ``mark_broken``."""

    def __init__(self, description: str, rank: int, timeout_s: float,
                 on_timeout: Callable[[str], None] | None = None,
                 board: WaitBoard | None = None) -> None:
        self._description = description
        self.board = board
        self.context: Callable[[], str] | None = None
        """More about what is moved (e.g. which bucket), for the messages;
        called only when a message needs it."""
        self.payload_bytes: int | None = None
        """Bytes this rank hands to the engine for what the handle stands for,
        when a comm hook sends something other than the bucket's buffer
        (PowerSGD: its ``P``, ``Q`` and uncompressed members); None: the
        buffer's own bytes. ``comm_stats()`` counts it."""
        self.rank = rank
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout
        self.started_at = time.perf_counter()
        self.completed_at: float | None = None
        self._finishers: list[Any] = []

    @property
    def description(self) -> str:
        extra = "" if self.context is None else f" [{self.context()}]"
        return self._description + extra

    @abstractmethod
    def _test(self) -> bool:
        """Non-blocking: True once the collective has finished."""

    def _block(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s``; True if finished. Override where the
        library can block efficiently; the default polls ``_test``."""
        return poll(self._test, timeout_s, step=2e-5, longest=1e-3)

    def done(self) -> bool:
        if self.completed_at is None and self._observe(self._test):
            self.completed_at = time.perf_counter()
        return self.completed_at is not None

    def wait(self) -> None:
        """Wait for completion; raise ``CollectiveTimeoutError`` after the timeout."""
        if self.completed_at is None:
            if not self._observe(self._block_with_note):
                raise self._timed_out(self.timeout_error())
            self.completed_at = time.perf_counter()
        while self._finishers:
            self._finishers.pop(0)()

    def _block_with_note(self) -> bool:
        """``_block`` for the timeout; a long wait posts a note on the board
        and logs a stall warning every ``board.stall_warning_s``."""
        board = self.board
        if board is None:
            return self._block(self.timeout_s)
        warn_every = board.stall_warning_s
        start = time.perf_counter()
        end = start + self.timeout_s
        note_at = start + (min(self.timeout_s, warn_every) if warn_every else self.timeout_s) / 2
        warn_at = start + warn_every if warn_every else math.inf
        posted = False
        while True:
            now = time.perf_counter()
            if now >= end:
                return False
            until = min(end, warn_at, math.inf if posted else note_at)
            if self._block(max(0.0, until - now)):
                if posted:
                    board.clear()
                return True
            now = time.perf_counter()
            if not posted and now >= note_at:
                board.post(self.description)
                posted = True
            if now >= warn_at and now < end:
                log.warning("%s", board.stall_warning(self.description, now - start,
                                                      self.timeout_s))
                warn_at += warn_every

    def report(self) -> str:
        """What the other ranks were waiting in ("" without a board)."""
        return "" if self.board is None else self.board.report(self.description)

    def _observe(self, probe: Callable[[], bool]) -> bool:
        """``probe()``, reporting a timeout the library itself raised."""
        try:
            return probe()
        except CollectiveTimeoutError as exc:
            self._timed_out(exc)
            raise

    def _timed_out(self, error: CollectiveTimeoutError) -> CollectiveTimeoutError:
        if self._on_timeout is not None:
            self._on_timeout(self.description)
        return error

    def timeout_error(self) -> CollectiveTimeoutError:
        """The error for this collective passing ``timeout_s`` (also used by
        engines whose library reports the timeout itself)."""
        return CollectiveTimeoutError(
            f"rank {self.rank}: {self.description} did not finish within "
            f"{self.timeout_s:g} s (DP_PLUGIN_TIMEOUT).{self.report()} Another rank has "
            "probably stopped calling collectives, called them in a different order, or "
            "died; check its log. If the step is legitimately this slow, raise "
            "DP_PLUGIN_TIMEOUT."
        )

    def then(self, fn: Any) -> Handle:
        """Run ``fn()`` once, in the waiting thread, after completion."""
        self._finishers.append(fn)
        return self


class DoneHandle(Handle):
    """A collective that completed synchronously."""

    def __init__(self, description: str, rank: int, timeout_s: float) -> None:
        super().__init__(description, rank, timeout_s)
        self.completed_at = self.started_at

    def _test(self) -> bool:
        return True
