"""Horovod's ``horovod.tensorflow.util`` helpers, which Horovod-era code imports.

``_executing_eagerly`` (also ``dp._executing_eagerly``) is the one most
scripts and Keras callbacks reach for; the rest keep imports of the module
working.

``variable_ref`` is the one hashable key of a variable in the adapter (the
local sources of ``DistributedGradientTape`` too): ``tf.Variable.ref()``
where the variable has it; Keras 3 variables have no ``ref()`` and compare
elementwise with ``==`` (Horovod's own tape broke on them),
so they get a ``VariableRef`` by identity, which ``ref()`` also is.
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


_make_subgraph = tf.function
"""``_make_subgraph(fn)``: ``fn`` compiled as a ``tf.function``."""


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


class VariableRef:
    """A hashable reference to a variable without ``ref()`` (a Keras 3 variable):
    equal only to a reference to the same object; ``deref()`` returns it."""

    __slots__ = ("_variable",)

    def __init__(self, variable: Any) -> None:
        self._variable = variable

    def __hash__(self) -> int:
        return id(self._variable)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VariableRef) and other._variable is self._variable

    def deref(self) -> Any:
        return self._variable


def variable_ref(variable: Any) -> Any:
    """``variable.ref()``, or a ``VariableRef`` for a variable without it (module docstring)."""
    ref = getattr(variable, "ref", None)
    return ref() if callable(ref) else VariableRef(variable)


def vars_to_refs(variables: Any) -> Any:
    """``variables`` (a variable or nested lists of them) as hashable references (tuples)."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return variable_ref(variables)


def refs_to_vars(refs: Any) -> Any:
    """The inverse of ``vars_to_refs`` (tuples become lists again)."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
