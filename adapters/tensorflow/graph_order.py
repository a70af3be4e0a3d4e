"""The order of dp_plugin's ops in a graph: construction order, on every rank.

The engines pair collectives across ranks by the order in which they are
called. Eagerly that is the program's order. In a graph (a TF1
``tf.compat.v1.Session`` graph, a ``tf.function``), TensorFlow's executor
runs ops that do not depend on each other concurrently and in any order, so
two independent all-reduces fetched by one ``Session.run`` could start in
one order on rank 0 and the other on rank 1: the ranks would pair the wrong
tensors (silently), or hang, or abort.

``ordered(make)`` builds a dp_plugin op (``make()`` creates it) with a
control dependency on the previous dp_plugin op built in the same graph, so
that the executor runs them one after another, in the order the program
built them. Every rank builds the same graph from the same program, so that
order is the same on every rank. A ``tf.function`` already orders stateful
ops this way (its automatic control dependencies); the explicit edge makes
the rule ours rather than an implementation detail of tracing, and covers
TF1 graphs, where nothing else does.

Collectives inside ``tf.compat.v1.cond``/``while_loop`` of a TF1 graph are
refused when they are built. There the construct's ops live in
v1 control-flow contexts (``disable_control_flow_v2``) or in the branch and
body graphs of an ``If``/``While`` op (TensorFlow 2's default, also in TF1
graphs), and nothing orders an op built after the construct against the
collectives inside it: with rank 0's predicate slow and rank 1's outer input
slow, an all-reduce in the branch paired with a different all-reduce on the
other rank. Ordering them soundly would need an edge out of every branch
that does not kill the op after the construct when its branch is not taken,
and, in a loop, from each iteration's last collective to the next
iteration's first; TensorFlow exposes neither after the construct is built.
Inside a ``tf.function`` TensorFlow's automatic control dependencies order
the ``If``/``While`` op among the function's stateful ops, so there they
are allowed.

The consequence a user sees: fetching a dp_plugin op in ``Session.run`` also
runs the dp_plugin ops built before it in that graph (they are its control
inputs). Horovod matches collectives by name in a background thread instead;
without one, this is the order every rank can agree on when the graph is
built. The one exception is ``new_chain``, for ops that only read
variables and are run on their own (the broadcast of the global variables,
which Horovod's ``BroadcastGlobalVariablesHook`` builds after the training
step): they depend on no earlier op, and later ops follow them.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import tensorflow as tf
from dp_plugin.agree.edge import caller

T = TypeVar("T")

_lock = threading.Lock()
_tails: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
"""graph -> the name of its last dp_plugin op. A name, not the op: an op holds its
graph, so a value holding one would keep its own key, and every graph that
ever held a dp_plugin op, alive (retracing builds a new graph each time)."""
_starting = threading.local()  # .graph: the graph whose next op starts a new chain


@contextlib.contextmanager
def new_chain() -> Iterator[None]:
    """The first dp_plugin op built inside depends on no earlier one (module docstring)."""
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    saved = getattr(_starting, "graph", None)
    _starting.graph = graph
    try:
        yield
    finally:
        _starting.graph = saved


def _refuse_tf1_control_flow(graph: Any) -> None:
    """Raise when ops built now in ``graph`` land inside ``cond`` or ``while_loop`` of
    a TF1 graph (not of a ``tf.function``)."""
    context = graph._get_control_flow_context()  # v1 control flow: CondContext, WhileContext
    if context is not None and (context.IsCondContext() or context.IsWhileContext()):
        construct = "while_loop" if context.GetWhileContext() is not None else "cond"
    elif getattr(graph, "is_control_flow_graph", False) and not graph._add_control_dependencies:
        # v2 control flow: a branch or body graph; inside a tf.function it is traced with
        # automatic control dependencies, in a TF1 graph without them.
        construct = "while_loop" if type(graph).__name__.startswith("While") else "cond"
    else:
        return
    outside = ("before the cond: reduce every candidate there and pick the result with "
               "tf.where, or use the reduced tensors inside the branches" if construct == "cond"
               else "outside the while_loop: a Python loop builds one collective per iteration")
    raise ValueError(
        f"{caller()}: a dp_plugin collective cannot be built inside "
        f"tf.compat.v1.{construct} of a TF1 graph: nothing orders it against the "
        f"collectives built before and after the {construct}, so ranks could pair it with "
        f"a different collective. Build it {outside}; or build the step in a "
        f"tf.function, where TensorFlow orders the {construct} as one op.")


def _first_op(result: Any) -> Any:
    """The op that produced ``result`` (a tensor, an op or a list of them)."""
    for item in tf.nest.flatten(result):
        op = item if isinstance(item, tf.Operation) else getattr(item, "op", None)
        if op is not None:
            return op
    raise TypeError(f"a dp_plugin graph op built nothing TensorFlow can order: {result!r}")


def ordered(make: Callable[[], T]) -> T:
    """``make()``, which builds one dp_plugin op, after the previous one of this graph.

    Eagerly ``make()`` is simply called. Inside TF1 control flow it raises
    ``ValueError`` (module docstring).
    """
    if tf.executing_eagerly():
        return make()
    graph = tf.compat.v1.get_default_graph()
    _refuse_tf1_control_flow(graph)
    starts = getattr(_starting, "graph", None) is graph
    if starts:
        _starting.graph = None  # only the first op inside new_chain()
    with _lock:
        tail = None if starts else _tails.get(graph)
    previous = [] if tail is None else [graph.get_operation_by_name(tail)]
    with graph.control_dependencies(previous):
        result = make()
    with _lock:
        _tails[graph] = _first_op(result).name
    return result
