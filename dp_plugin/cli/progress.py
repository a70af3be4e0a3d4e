"""A one-line text progress bar on stderr (no dependency)."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Progress:
    """``[#####.....] 12/40 gloo x2 0:31``; ``advance`` may be called from threads.

    On a terminal the line redraws in place; into a file or pipe it is
    written on a line of its own at every tenth of the total, so logs stay short.
    """

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.label = ""
        self.width = width
        self.stream = stream or sys.stderr
        self._tty = self.stream.isatty()
        self._shown = -1
        self._start = time.monotonic()
        self._lock = threading.Lock()
        self._draw()

    def advance(self, steps: int = 1) -> None:
        with self._lock:
            self.done = min(self.total, self.done + steps)
            self._draw()

    def render(self) -> str:
        filled = self.width * self.done // self.total
        elapsed = int(time.monotonic() - self._start)
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{self.label} {elapsed // 60}:{elapsed % 60:02d}")

    def _draw(self) -> None:
        if self._tty:
            self.stream.write("\r" + self.render().ljust(self.width + 30))
        elif 10 * self.done // self.total != self._shown:
            self._shown = 10 * self.done // self.total
            self.stream.write(self.render() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
        self.stream.flush()
