"""The public call being served, named once where it enters dp_plugin.

Every message a call raises starts with the public function the user called
(``allreduce_async: op=hvd.Adasum is not supported ...``). The name is set
once, at the edge, by ``@public("allreduce_async")`` (or ``with
calling(...)`` for a part of a function); the code underneath reads it with
``caller()`` where it builds a message, instead of taking a ``what``
parameter only to pass it down.

The innermost public call names the message: ``hvd.allreduce`` runs
``allreduce_async``, and what goes wrong inside that says
``allreduce_async``, as Horovod's messages do. The name lives in a
``ContextVar``, so two threads calling at once each see their own; work that
runs later on another thread (a TensorFlow ``py_function`` run by the graph
executor) takes it along with ``deferred``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_CALLER: ContextVar[str | None] = ContextVar("dp_plugin_caller", default=None)


def caller(default: str = "dp_plugin") -> str:
    """The public call being served, or ``default`` outside any."""
    name = _CALLER.get()
    return default if name is None else name


@contextmanager
def calling(name: str) -> Iterator[None]:
    """Name ``name`` in the messages raised inside the block."""
    token = _CALLER.set(name)
    try:
        yield
    finally:
        _CALLER.reset(token)


def public(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a public function: its messages name ``name``."""
    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def named(*args: P.args, **kwargs: P.kwargs) -> R:
            with calling(name):
                return fn(*args, **kwargs)
        return named
    return wrap


def deferred(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn``, run later (maybe on another thread) under the caller named now."""
    return public(caller())(fn)
