"""Integer handles of asynchronous tensor collectives: ``poll`` and ``synchronize``.

As in ``horovod.torch``, every ``*_async`` function returns a plain ``int``.

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

import itertools
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


# The process-wide table of every collective of the adapter: int handle ->
# (pending collective, its name key), and the names in flight.
_lock = threading.Lock()
_numbers = itertools.count(1)  # from 1: a handle is never falsy
_entries: dict[int, tuple[InFlight, Hashable | None]] = {}
_names: set[Hashable] = set()


def name_in_flight(name_key: Hashable) -> bool:
    with _lock:
        return name_key in _names


def new_handle(pending: InFlight, name_key: Hashable | None = None) -> int:
    """Register a started collective (and its name); return its handle."""
    with _lock:
        handle = next(_numbers)
        _entries[handle] = (pending, name_key)
        if name_key is not None:
            _names.add(name_key)
        return handle


def poll(handle: int) -> bool:
    """Non-blocking: True when the collective behind ``handle`` has finished,
    so that ``synchronize(handle)`` returns without waiting.

    Also accepts the callable that ``sparse_allreduce_async`` returns.
    """
    if callable(handle) and hasattr(handle, "done"):
        return bool(handle.done())
    return _lookup(handle, "poll")[0].done()


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
    pending, name_key = _lookup(handle, "synchronize")
    try:
        return pending.result()
    finally:
        # Forgotten even on error: the engine already reported it, and a
        # second synchronize() must not wait on a broken collective again.
        with _lock:
            _entries.pop(handle, None)
            if name_key is not None:
                _names.discard(name_key)


def reset() -> None:
    """Forget every handle and in-flight name (``init()`` after ``shutdown()``)."""
    with _lock:
        _entries.clear()
        _names.clear()


def _lookup(handle: int, what: str) -> tuple[InFlight, Hashable | None]:
    is_int = isinstance(handle, int) and not isinstance(handle, bool)
    with _lock:
        entry = _entries.get(handle) if is_int else None
    if entry is None:
        raise ValueError(
            f"{what}({handle!r}): no collective in flight has this handle; handles are "
            "the ints returned by the *_async functions and each can be synchronized "
            "once (it may already have been synchronized, or was issued before "
            "shutdown()/init())"
        )
    return entry
