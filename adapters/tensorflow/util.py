"""Horovod's ``horovod.tensorflow.util`` helpers, which Horovod-era code imports.

``_executing_eagerly`` (also ``dp._executing_eagerly``) is the one most
scripts and Keras callbacks reach for; the rest keep imports of the module
working: ``_make_subgraph`` (a ``tf.function``), ``_cache`` (memoize a
function per argument tuple and eager/graph mode) and ``vars_to_refs`` /
``refs_to_vars`` (hashable references of (nested lists of) variables).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf


def _executing_eagerly() -> bool:
    """True when TensorFlow runs eagerly here (False while tracing a ``tf.function``
    and inside a TF1 graph)."""
    return bool(tf.executing_eagerly())


def _make_subgraph(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled as a ``tf.function``."""
    return tf.function(fn)


def _cache(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` computed once per (arguments, eager or not); the arguments must be hashable."""
    results: dict[tuple[Any, bool], Any] = {}

    @functools.wraps(fn)
    def cached(*args: Any) -> Any:
        key = (args, _executing_eagerly())
        if key not in results:
            results[key] = fn(*args)
        return results[key]

    return cached


def vars_to_refs(variables: Any) -> Any:
    """``variables`` (a variable or nested lists of them) as hashable references (tuples)."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return variables.ref()


def refs_to_vars(refs: Any) -> Any:
    """The inverse of ``vars_to_refs`` (tuples become lists again)."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
