"""Horovod's TensorFlow graph helpers: ``rank_op``, ``size_op``, ... , ``broadcast_``.

``horovod.tensorflow`` offers these for graphs built before the job's size is
known to the program (TF1 sessions). Under TF2 a ``tf.function`` traces with
the running process, so each is a constant of the current value; they exist
so that scripts written against Horovod run unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
from dp_plugin.agree.edge import public
from dp_plugin.api.process_sets import global_process_set, registered
from dp_plugin.tensorflow.basics import local_rank, local_size, rank
from dp_plugin.tensorflow.broadcast import broadcast_variables
from dp_plugin.tensorflow.functions import broadcast_global_variables, broadcast_object

__all__ = [
    "BroadcastGlobalVariablesHook", "broadcast_", "broadcast_object_fn", "local_rank_op",
    "local_size_op", "process_set_included_op", "rank_op", "size_op",
]


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank, as an int32 tensor."""
    return tf.constant(rank(), dtype=tf.int32, name=name)


@public("size_op")
def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks (of the job, or of process set ``process_set_id``)."""
    return tf.constant(registered(process_set_id).size() or 0, dtype=tf.int32, name=name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(local_rank(), dtype=tf.int32, name=name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    return tf.constant(local_size(), dtype=tf.int32, name=name)


@public("process_set_included_op")
def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this rank belongs to process set ``process_set_id``, else 0."""
    process_set = registered(process_set_id)
    return tf.constant(int(bool(process_set.included())), dtype=tf.int32, name=name)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: Any = global_process_set) -> Callable[[Any], Any]:
    """A function ``f(obj)`` that returns ``root_rank``'s ``obj`` on every rank
    (collective at each call, like ``broadcast_object``)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> Any:
    """Assign ``root_rank``'s values to ``variables`` in place and return their new
    values (a list of tensors, read after the assignment), as Horovod's
    ``broadcast_``; ``name`` is accepted for compatibility."""
    variables = list(variables)
    assigned = broadcast_variables(variables, root_rank, process_set=process_set, inplace=True)
    with tf.control_dependencies([] if assigned is None else [assigned]):
        return [v.read_value() if hasattr(v, "read_value") else tf.identity(v.value)
                for v in variables]


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Horovod's TF1 ``SessionRunHook``: once the session exists, set the graph's
    global variables to ``root_rank``'s values (``broadcast_global_variables``)::

        hooks = [dp.BroadcastGlobalVariablesHook(0)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess: ...

    ``device`` is accepted for compatibility (tensors travel through host memory).
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op: Any = None

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)
