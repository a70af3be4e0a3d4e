"""dp_plugin's collective errors as the TensorFlow error types Horovod raises.

Horovod's TensorFlow ops fail with ``tf.errors.FailedPreconditionError``
when ranks disagree (shapes, dtypes, ops, roots, names) and with
``tf.errors.InvalidArgumentError`` for a bad argument one rank can see on
its own (invalid all-to-all splits, a root outside the set, an unsupported
dtype); scripts catch those. The core raises its own types with the same
message on every rank, at the call: ``MismatchError`` (or
``LayoutMismatchError``) when ranks disagree, a plain ``ValueError`` /
``TypeError`` naming a rank's bad argument. The TensorFlow adapter
re-raises each as a class that is *both*: ``CollectiveMismatchError`` is a
``MismatchError`` and a ``FailedPreconditionError``,
``CollectiveArgumentError`` a ``ValueError`` and an
``InvalidArgumentError``, and so on; the message is the core's, unchanged.
The core never imports TensorFlow: these classes live here.

``translated(fn)`` wraps a collective's data path (the numpy callback of a
``tf.numpy_function`` op, or the eager call). Inside a graph TensorFlow
would turn any exception of the callback into an error of its own choosing,
so there ``collectives.run_op`` returns the typed error's code and message
from the callback and ``status_op`` fails the step with them (issue 36).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import tensorflow as tf
from dp_plugin.errors import LayoutMismatchError
from dp_plugin.request import MismatchError

F = TypeVar("F", bound=Callable[..., Any])


def _init_op_error(error: Any, op_error: type[tf.errors.OpError], message: str) -> None:
    op_error.__init__(error, None, None, message)
    error.args = (message,)


class CollectiveMismatchError(MismatchError, tf.errors.FailedPreconditionError):
    """Ranks asked for different collectives or passed incompatible tensors."""

    def __init__(self, message: str) -> None:
        _init_op_error(self, tf.errors.FailedPreconditionError, message)


class CollectiveLayoutError(LayoutMismatchError, tf.errors.FailedPreconditionError):
    """Ranks registered different tensors (names, shapes, dtypes or order)."""

    def __init__(self, message: str) -> None:
        _init_op_error(self, tf.errors.FailedPreconditionError, message)


class CollectiveArgumentError(ValueError, tf.errors.InvalidArgumentError):
    """A rank passed an argument the collective cannot take (splits, root, members)."""

    def __init__(self, message: str) -> None:
        _init_op_error(self, tf.errors.InvalidArgumentError, message)


class CollectiveTypeError(TypeError, tf.errors.InvalidArgumentError):
    """A rank passed a tensor of a dtype the collective cannot move."""

    def __init__(self, message: str) -> None:
        _init_op_error(self, tf.errors.InvalidArgumentError, message)


def as_tensorflow_error(error: BaseException) -> tf.errors.OpError | None:
    """The TensorFlow-typed equivalent of a core collective error, or None when
    ``error`` is not one (or already is)."""
    if isinstance(error, tf.errors.OpError):
        return None
    message = str(error)
    if isinstance(error, LayoutMismatchError):
        return CollectiveLayoutError(message)
    if isinstance(error, MismatchError):
        return CollectiveMismatchError(message)
    if isinstance(error, ValueError):
        return CollectiveArgumentError(message)
    if isinstance(error, TypeError):
        return CollectiveTypeError(message)
    return None


def translated(fn: F) -> F:
    """``fn`` raising ``as_tensorflow_error`` of the core's collective errors."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (LayoutMismatchError, ValueError, TypeError) as error:
            typed = as_tensorflow_error(error)
            if typed is None:
                raise
            raise typed from error

    return call  # type: ignore[return-value]
