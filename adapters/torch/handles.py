"""Integer handles of asynchronous tensor collectives: ``poll`` and ``synchronize``.

As in ``horovod.torch``, every ``*_async`` function returns a plain ``int``.
``poll(handle)`` says without blocking whether the collective has finished;
``synchronize(handle)`` waits for it, returns its result (a tensor, a tuple
of tensors for grouped ops and alltoall) and forgets the handle.

Names: a named collective owns its name, within its process set, from the
call that starts it until ``synchronize`` returns (or raises) for it.
Horovod releases a name when the operation completes in its background
thread, which depends on timing; releasing it at ``synchronize`` depends only
on program order, so every rank of an SPMD program agrees on whether a name
is still in flight (the duplicate-name check is then the same everywhere).

The table is per process; ``reset()`` forgets everything (``init`` after
``shutdown``), as Horovod's ``init`` clears its handle map.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from dp_plugin.engines.base import Handle


class InFlight:
    """One submitted collective, as the handle table sees it: engine handles
    still running, and the step that turns their buffers into the result
    (scaling, copy-back, reshape) once they are done."""

    def __init__(self, handles: Sequence[Handle], finish: Callable[[], Any]) -> None:
        self._handles = list(handles)
        self._finish = finish

    def done(self) -> bool:
        """Non-blocking: True once ``result`` would return without waiting."""
        return all(h.done() for h in self._handles)

    def result(self) -> Any:
        """Wait (with the engine's timeout) and return the collective's output."""
        for h in self._handles:
            h.wait()
        return self._finish()


class Ready(InFlight):
    """A collective that finished when it was submitted."""

    def __init__(self, value: Any) -> None:
        super().__init__((), lambda: value)


class HandleTable:
    """Thread-safe map ``int handle -> (pending collective, its name key)``,
    plus the names in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 1  # start at 1: a handle is never falsy
        self._entries: dict[int, tuple[InFlight, Hashable | None]] = {}
        self._names: set[Hashable] = set()

    def name_in_flight(self, name_key: Hashable) -> bool:
        with self._lock:
            return name_key in self._names

    def add(self, pending: InFlight, name_key: Hashable | None = None) -> int:
        """Register a started collective (and its name); return its handle."""
        with self._lock:
            handle = self._next
            self._next += 1
            self._entries[handle] = (pending, name_key)
            if name_key is not None:
                self._names.add(name_key)
            return handle

    def poll(self, handle: int) -> bool:
        return self._lookup(handle, "poll")[0].done()

    def synchronize(self, handle: int) -> Any:
        pending, name_key = self._lookup(handle, "synchronize")
        try:
            return pending.result()
        finally:
            # Forgotten even on error: the engine already reported it, and a
            # second synchronize() must not wait on a broken collective again.
            with self._lock:
                self._entries.pop(handle, None)
                if name_key is not None:
                    self._names.discard(name_key)

    def reset(self) -> None:
        with self._lock:
            self._entries.clear()
            self._names.clear()

    def _lookup(self, handle: int, what: str) -> tuple[InFlight, Hashable | None]:
        is_int = isinstance(handle, int) and not isinstance(handle, bool)
        with self._lock:
            entry = self._entries.get(handle) if is_int else None
        if entry is None:
            raise ValueError(
                f"{what}({handle!r}): no collective in flight has this handle; handles are "
                "the ints returned by the *_async functions and each can be synchronized "
                "once (it may already have been synchronized, or was issued before "
                "shutdown()/init())"
            )
        return entry


TABLE = HandleTable()
"""The process-wide handle table used by every collective of the adapter."""


def poll(handle: int) -> bool:
    """Non-blocking: True when the collective behind ``handle`` has finished,
    so that ``synchronize(handle)`` returns without waiting.

    Also accepts the callable that ``sparse_allreduce_async`` returns.
    """
    if callable(handle) and hasattr(handle, "done"):
        return bool(handle.done())
    return TABLE.poll(handle)


def synchronize(handle: int) -> Any:
    """Wait for the collective behind ``handle`` and return its output.

    A tensor for single-tensor ops, a tuple of tensors for grouped ops, and
    ``(output, received_splits)`` for alltoall. A handle can be synchronized
    once; an unknown or already-synchronized handle raises ``ValueError``
    (Horovod silently returns None there, which hides bugs). Raises the
    engine's error (e.g. ``CollectiveTimeoutError``) if the collective failed.
    Also accepts the callable that ``sparse_allreduce_async`` returns.
    """
    if callable(handle):
        return handle()
    return TABLE.synchronize(handle)


def reset() -> None:
    """Forget every handle and in-flight name (``init()`` after ``shutdown()``)."""
    TABLE.reset()
