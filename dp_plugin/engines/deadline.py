"""A bound on the waits a library gives no timeout: run it in a helper thread.

``MPI_Comm_split``, ``hvd.init()``, ``hvd.add_process_set`` and
``torch.distributed.destroy_process_group`` block until every rank arrives
and take no timeout. ``bounded(fn, what=..., rank=..., timeout_s=...)`` runs
``fn`` in a daemon thread and waits at most ``timeout_s``: its result, its
exception, or ``CollectiveTimeoutError`` naming the wait, the rank and what
to check. A thread that never returns is left behind (a daemon: it does not
keep the process alive); the engine is broken after such a timeout.
A wait the library can test without blocking (a request, an HTTP key) uses
``poll``: test, sleep a little longer each time, until the deadline.

A joined rank's standing all-reduce (``dp_plugin.agree.join.Listener``) has
no deadline of its own: join issues it inside ``standing()``, and engines
read ``is_standing()`` as they issue (torch.distributed fixes a timeout then).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from dp_plugin.errors import CollectiveTimeoutError

T = TypeVar("T")

_issuing = threading.local()


@contextlib.contextmanager
def standing(on: bool = True) -> Iterator[None]:
    """Collectives issued in this block, by this thread, have no deadline of
    their own (module docstring); ``on=False``: no change."""
    before = is_standing()
    _issuing.standing = before or on
    try:
        yield
    finally:
        _issuing.standing = before


def is_standing() -> bool:
    """Is this thread issuing a standing collective (``standing``)?"""
    return getattr(_issuing, "standing", False)


def bounded(fn: Callable[[], T], *, what: str, rank: int, timeout_s: float) -> T:
    """``fn()``, or ``CollectiveTimeoutError`` if it takes longer than ``timeout_s``."""
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the waiting thread
            outcome["error"] = exc

    thread = threading.Thread(target=body, name=f"dp_plugin: {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CollectiveTimeoutError(
            f"rank {rank}: {what} did not finish within {timeout_s:g} s (DP_PLUGIN_TIMEOUT): "
            "another rank has probably not reached the same call (it died, stalls, or runs a "
            "different code path); check its log. If it is legitimately this slow, raise "
            "DP_PLUGIN_TIMEOUT."
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def bounded_on(engine: Any, fn: Callable[[], T], what: str) -> T:
    """``bounded`` with ``engine``'s rank and timeout; a timeout breaks ``engine``
    (its library may still be inside the call, so nothing else may run there)."""
    try:
        return bounded(fn, what=what, rank=engine.rank, timeout_s=engine.config.timeout_s)
    except CollectiveTimeoutError:
        engine.mark_broken(what)
        raise


def poll(ready: Callable[[], bool], timeout_s: float, *, step: float, longest: float) -> bool:
    """Call ``ready()`` until it is True (True) or ``timeout_s`` has passed
    (False), sleeping 0, ``step``, ``3 * step`` ... s between calls, at most ``longest``."""
    deadline = time.perf_counter() + timeout_s
    pause = 0.0
    while not ready():
        if time.perf_counter() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2 + step, longest)
    return True
