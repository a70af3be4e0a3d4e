"""The one writer of each Chrome-trace file in a process.

Every ``Timeline`` (``dp_plugin.api.timeline``) is a handle on a ``TraceWriter``
taken from a module-level registry keyed by the file's real path: two
schedulers (two optimizers, an optimizer and SyncBatchNorm, one TensorFlow
scheduler per gradient layout) that name the same file share one writer, so
their events interleave as whole lines instead of two ``open(path, "w")``
truncating and overwriting each other. The file is closed, with its ``]``,
when the last handle is closed, or at interpreter exit.

Crash safety: the file is ``[`` and then one event per line, the separator
``,`` written *before* each event; events are buffered as whole lines and
handed to ``os.write`` together, never cut, so at any moment the file is a
valid trace under Chrome's rule for unterminated arrays (append ``]``).

Size: at most ``max_bytes`` (``DP_PLUGIN_TIMELINE_MAX_BYTES``) of events; the
first event past the limit is replaced by a ``timeline truncated`` note in the
trace and one warning, and later events are dropped (and counted).

The file is opened with ``O_NOFOLLOW``: a symbolic link at the path is refused
instead of followed (a link planted in a shared directory cannot make a rank
overwrite another file).
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import threading
import time
import warnings
from typing import Any

_FLUSH_AT = 1 << 20  # bytes of pending events that trigger an os.write
_NOTE_NAME = "timeline truncated"


def open_no_follow(path: str) -> int:
    """A write-only descriptor on ``path``, created or truncated, never through a symlink."""
    parent = os.path.dirname(path)
    try:
        if parent:
            os.makedirs(parent, exist_ok=True)
        if os.path.islink(path):  # also where O_NOFOLLOW does not exist
            raise OSError(errno.ELOOP, "it is a symbolic link")
        flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                 | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        return os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(
                errno.ELOOP,
                f"refusing to write the timeline file {path!r}: it is a symbolic link, which "
                "dp_plugin does not follow; remove the link or set DP_PLUGIN_TIMELINE (or "
                "HOROVOD_TIMELINE) to a path that is not one",
            ) from exc
        raise OSError(
            exc.errno,
            f"cannot write the timeline file {path!r} ({exc.strerror or exc}); set "
            "DP_PLUGIN_TIMELINE (or HOROVOD_TIMELINE) to a writable path, or unset it",
        ) from exc


class TraceWriter:
    """Appends events to one trace file; shared by every handle on that file."""

    def __init__(self, path: str, rank: int, max_bytes: int) -> None:
        self.path = path
        self.rank = rank
        self.max_bytes = max_bytes
        """Largest size of the events in bytes; 0 means no limit."""
        self.origin = time.perf_counter()
        self.lock = threading.Lock()
        self.refs = 0
        self.key = ""
        """The registry's key: the real path of the file."""
        self.dropped = 0
        """Events not written because the file reached ``max_bytes``."""
        self._fd = open_no_follow(path)
        self._pending: list[str] = ["[\n"]
        self._pending_bytes = 2
        self._events_bytes = 0
        self._full = False
        self._closed = False
        self._lanes: dict[str, int] = {}
        self._used_tids: set[int] = set()
        self.metadata("process_name", 0, {"name": f"rank {rank}"})
        self.metadata("process_sort_index", 0, {"sort_index": rank})
        self.flush()

    # -- called with ``lock`` held ------------------------------------------

    def us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 3)

    def tid(self, lane: str | int) -> int:
        """Named lanes get small ids in first-use order, and a name in the viewer."""
        if isinstance(lane, int) and not isinstance(lane, bool):
            self._used_tids.add(lane)
            return lane
        name = str(lane)
        tid = self._lanes.get(name)
        if tid is None:
            tid = len(self._lanes) + 1
            while tid in self._used_tids:
                tid += 1
            self._lanes[name] = tid
            self._used_tids.add(tid)
            self.metadata("thread_name", tid, {"name": name})
            self.metadata("thread_sort_index", tid, {"sort_index": tid})
        return tid

    def metadata(self, kind: str, tid: int, args: dict[str, Any]) -> None:
        self.write({"name": kind, "ph": "M", "pid": self.rank, "tid": tid, "args": args})

    def write(self, event: dict[str, Any]) -> None:
        if self._closed:
            return
        if self._full:
            self.dropped += 1
            return
        # The separator goes before each event, never after the last one, so
        # the file is valid JSON once ']' is appended, whenever it is cut.
        line = json.dumps(event, separators=(",", ":"))  # ASCII: len() is the byte count
        if self.max_bytes and self._events_bytes + len(line) + 2 > self.max_bytes:
            self._hit_limit(event)
            return
        self._append(line)

    def flush(self) -> None:
        if self._closed or not self._pending:
            return
        data = "".join(self._pending).encode("ascii")
        self._pending.clear()
        self._pending_bytes = 0
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._pending.append("\n]\n")
            self.flush()
        finally:
            self._closed = True
            os.close(self._fd)

    # -- internals -----------------------------------------------------------

    def _append(self, line: str) -> None:
        if self._events_bytes:  # not the first event
            line = ",\n" + line
        self._pending.append(line)
        self._pending_bytes += len(line)
        self._events_bytes += len(line)
        if self._pending_bytes >= _FLUSH_AT:
            self.flush()

    def _hit_limit(self, event: dict[str, Any]) -> None:
        self._full = True
        self.dropped += 1
        message = (
            f"the timeline file {self.path!r} reached DP_PLUGIN_TIMELINE_MAX_BYTES="
            f"{self.max_bytes} bytes; later events are dropped. Raise the limit (0 means none) "
            "or record fewer steps (hvd.start_timeline()/stop_timeline() around them)"
        )
        t = event.get("ts", self.us(time.perf_counter()))
        self._append(json.dumps({
            "name": _NOTE_NAME, "cat": "timeline", "ph": "i", "s": "g", "ts": t,
            "pid": self.rank, "tid": 0, "args": {"message": message},
        }, separators=(",", ":")))
        self.flush()
        warnings.warn(message, RuntimeWarning, stacklevel=4)


# -- the registry: one writer per file per process ---------------------------------

_REGISTRY_LOCK = threading.Lock()
_OPEN: dict[str, TraceWriter] = {}


def acquire(path: str, rank: int, max_bytes: int) -> TraceWriter:
    """The writer of ``path`` (opened now if no handle holds it), with one more reference."""
    absolute = os.path.abspath(path)
    key = os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))
    with _REGISTRY_LOCK:
        writer = _OPEN.get(key)
        if writer is None:
            writer = TraceWriter(path, rank, max_bytes)
            writer.key = key
            _OPEN[key] = writer
        elif writer.rank != rank:
            raise ValueError(
                f"the timeline file {path!r} is already written by this process for rank "
                f"{writer.rank}, not rank {rank}; give each rank its own file ('{{rank}}' in "
                "DP_PLUGIN_TIMELINE)"
            )
        writer.refs += 1
        return writer


def release(writer: TraceWriter) -> None:
    """Drop one reference; the last one closes the file with its ``]``."""
    with _REGISTRY_LOCK:
        writer.refs -= 1
        if writer.refs > 0:
            return
        if _OPEN.get(writer.key) is writer:
            del _OPEN[writer.key]
    with writer.lock:
        writer.close()


def close_all() -> None:
    """Close every open trace file (at interpreter exit: schedulers never closed)."""
    with _REGISTRY_LOCK:
        writers = list(_OPEN.values())
        _OPEN.clear()
    for writer in writers:
        with writer.lock:
            writer.close()


atexit.register(close_all)
