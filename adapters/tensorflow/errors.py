"""dp_plugin's collective errors as the TensorFlow error types Horovod raises.

Horovod's TensorFlow ops fail with ``tf.errors.FailedPreconditionError``
when ranks disagree (shapes, dtypes, ops, roots, names) and with
``tf.errors.InvalidArgumentError`` for a bad argument one rank can see on
its own (invalid all-to-all splits, a root outside the set, an unsupported
dtype); scripts catch those. The core raises ``MismatchError``, whose
``problem`` says which of the two it is, or a plain ``ValueError`` /
``TypeError`` for an argument only this rank checked. The adapter re-raises
each as a class below that is *both* the core's and TensorFlow's, chosen
from the problem (never from the message), with the core's message
unchanged. The core never imports TensorFlow, so these classes live here.

``translated(fn)`` wraps a collective's data path (the numpy callback of a
``tf.numpy_function`` op, or the eager call). Inside a graph TensorFlow
would turn any exception of the callback into an error of its own choosing,
so there ``collectives.run_op`` returns the typed error's code and message
from the callback and ``status_op`` fails the step with them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import tensorflow as tf
from dp_plugin.errors import LayoutMismatchError, MismatchError, Problem

F = TypeVar("F", bound=Callable[..., Any])


class _TypedOpError:
    """A core error that is also a ``tf.errors.OpError``: the last of its
    class's bases, whose ``__init__`` (node, op, message) runs."""

    def __init__(self, message: str) -> None:
        type(self).__bases__[-1].__init__(self, None, None, message)  # type: ignore[misc]
        self.args = (message,)


class CollectiveMismatchError(_TypedOpError, MismatchError, tf.errors.FailedPreconditionError):
    """Ranks asked for different collectives or passed incompatible tensors."""


class CollectiveLayoutError(_TypedOpError, LayoutMismatchError,
                            tf.errors.FailedPreconditionError):
    """Ranks registered different tensors (names, shapes, dtypes or order)."""


class CollectiveArgumentError(_TypedOpError, ValueError, tf.errors.InvalidArgumentError):
    """A rank passed an argument the collective cannot take (splits, root, members)."""


class CollectiveTypeError(_TypedOpError, TypeError, tf.errors.InvalidArgumentError):
    """A rank passed a tensor of a dtype the collective cannot move."""


_DISAGREEING = {Problem.DIFFERENT: CollectiveMismatchError, Problem.LAYOUT: CollectiveLayoutError}
"""The problems of ranks that disagree, and the class each is raised as."""


def as_tensorflow_error(error: BaseException) -> tf.errors.OpError | None:
    """The TensorFlow-typed equivalent of a core collective error, or None when
    ``error`` is not one (or already is)."""
    if isinstance(error, tf.errors.OpError):
        return None
    message = str(error)
    if isinstance(error, MismatchError) and error.problem in _DISAGREEING:
        return _DISAGREEING[error.problem](message)
    if isinstance(error, TypeError):
        return CollectiveTypeError(message)
    if isinstance(error, ValueError):
        return CollectiveArgumentError(message)
    return None


def translated(fn: F) -> F:
    """``fn`` raising ``as_tensorflow_error`` of the core's collective errors."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError) as error:
            typed = as_tensorflow_error(error)
            if typed is None:
                raise
            raise typed from error

    return call  # type: ignore[return-value]
