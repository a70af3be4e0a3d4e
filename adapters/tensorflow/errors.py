"""dp_plugin's collective errors as the TensorFlow error types Horovod raises.

Horovod's TensorFlow ops fail with ``tf.errors.FailedPreconditionError``
when ranks disagree (shapes, dtypes, ops, roots) and with
``tf.errors.InvalidArgumentError`` for bad all-to-all splits; scripts catch
those. The class follows the problem the check found
(``request.problem_of``), never words of the message, so every rank raises
the same class. The core raises its own types (``MismatchError`` from the
request check, ``LayoutMismatchError``, or ``ValueError`` / ``TypeError``
naming the bad input), with the same message on every rank, at the call.
The TensorFlow adapter re-raises each as a class that is *both*:
``CollectiveMismatchError`` is a ``MismatchError`` and a
``FailedPreconditionError``, ``CollectiveValueError`` a ``ValueError`` and a
``FailedPreconditionError``, and so on; the message is the core's, unchanged.
The core never imports TensorFlow: these classes live here.

``translated(fn)`` wraps a collective's data path (the numpy callback of a
``tf.numpy_function`` op, or the eager call). Inside a graph TensorFlow
turns a Python exception raised by the callback into an op error of its own
(``InvalidArgumentError`` for ``ValueError``, ``UnknownError`` for most
others); an ``OpError`` subclass keeps its error code, so a Horovod
``except tf.errors.FailedPreconditionError`` catches it there too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import tensorflow as tf
from dp_plugin.errors import LayoutMismatchError
from dp_plugin.request import MismatchError, Problem, problem_of

F = TypeVar("F", bound=Callable[..., Any])


def _init_op_error(error: Any, op_error: type[tf.errors.OpError], message: str) -> None:
    op_error.__init__(error, None, None, message)
    error.args = (message,)


class CollectiveMismatchError(MismatchError, tf.errors.FailedPreconditionError):
    """Ranks asked for different collectives or passed incompatible tensors."""

    def __init__(self, message: str) -> None:
        _init_op_error(self, tf.errors.FailedPreconditionError, message)


class CollectiveValueError(ValueError, tf.errors.FailedPreconditionError):
    """Ranks passed inputs that do not match (shape, dtype, op, root...)."""

    def __init__(self, message: str) -> None:
        _init_op_error(self, tf.errors.FailedPreconditionError, message)


class CollectiveTypeError(TypeError, tf.errors.FailedPreconditionError):
    """A rank passed a dtype the collective cannot move, or the ranks' dtypes differ."""

    def __init__(self, message: str) -> None:
        _init_op_error(self, tf.errors.FailedPreconditionError, message)


class CollectiveLayoutError(LayoutMismatchError, tf.errors.FailedPreconditionError):
    """Ranks registered different tensors (names, shapes, dtypes or order)."""

    def __init__(self, message: str) -> None:
        _init_op_error(self, tf.errors.FailedPreconditionError, message)


class SplitsError(ValueError, tf.errors.InvalidArgumentError):
    """A rank passed invalid all-to-all splits (Horovod: ``InvalidArgumentError``)."""

    def __init__(self, message: str) -> None:
        _init_op_error(self, tf.errors.InvalidArgumentError, message)


def as_tensorflow_error(error: BaseException) -> BaseException | None:
    """The TensorFlow-typed equivalent of a core collective error, or None when
    ``error`` is not one (or already is)."""
    if isinstance(error, tf.errors.OpError):
        return None
    message = str(error)
    if isinstance(error, LayoutMismatchError):
        return CollectiveLayoutError(message)
    if problem_of(error) is Problem.BAD_SPLITS:
        return SplitsError(message)
    if isinstance(error, MismatchError):
        return CollectiveMismatchError(message)
    if isinstance(error, ValueError):
        return CollectiveValueError(message)
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
