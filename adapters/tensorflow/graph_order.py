"""The order of dp_plugin's ops in a graph: construction order, on every rank.

The engines pair collectives across ranks by the order in which they are
called. Eagerly that is the program's order. In a graph (a TF1
``tf.compat.v1.Session`` graph, a ``tf.function``), TensorFlow's executor
runs ops that do not depend on each other concurrently and in any order, so
two independent all-reduces fetched by one ``Session.run`` could start in
one order on rank 0 and the other on rank 1: the ranks would pair the wrong
tensors (silently), or hang, or abort (issue 27).

``ordered(make)`` builds a dp_plugin op (``make()`` creates it) with a
control dependency on the previous dp_plugin op built in the same graph, so
that the executor runs them one after another, in the order the program
built them. Every rank builds the same graph from the same program, so that
order is the same on every rank. A ``tf.function`` already orders stateful
ops this way (its automatic control dependencies); the explicit edge makes
the rule ours rather than an implementation detail of tracing, and covers
TF1 graphs, where nothing else does.

Control-flow contexts of TF1 graphs (``tf.compat.v1.cond``/``while_loop``)
keep a chain of their own, started after the enclosing context's last op:
an edge out of a branch would make later ops "dead" when the branch is not
taken. (In a ``tf.function`` each branch or loop body is a graph of its own,
and the ``If``/``While`` op that holds it is ordered by TensorFlow.)

The consequence a user sees: fetching a dp_plugin op in ``Session.run`` also
runs the dp_plugin ops built before it in that graph (they are its control
inputs). Horovod matches collectives by name in a background thread instead;
without one, this is the order every rank can agree on when the graph is
built. The one exception is ``chain_start``, for ops that only read
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

T = TypeVar("T")

_lock = threading.Lock()
# graph -> {control-flow context (None outside one): last dp_plugin op built there}
_tails: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
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


def _context(graph: Any) -> Any:
    return graph._get_control_flow_context()  # TF1 cond/while; None in tf.function graphs


def _first_op(result: Any) -> Any:
    """The op that produced ``result`` (a tensor, an op or a list of them)."""
    for item in tf.nest.flatten(result):
        op = item if isinstance(item, tf.Operation) else getattr(item, "op", None)
        if op is not None:
            return op
    raise TypeError(f"a dp_plugin graph op built nothing TensorFlow can order: {result!r}")


def ordered(make: Callable[[], T]) -> T:
    """``make()``, which builds one dp_plugin op, after the previous one of this graph.

    Eagerly ``make()`` is simply called.
    """
    if tf.executing_eagerly():
        return make()
    graph = tf.compat.v1.get_default_graph()
    context = _context(graph)
    starts = getattr(_starting, "graph", None) is graph
    if starts:
        _starting.graph = None  # only the first op inside new_chain()
    with _lock:
        tails = _tails.setdefault(graph, {})
        previous = None if starts else tails.get(context, tails.get(None))
    # An op built inside a TF1 context may wait for one outside (TensorFlow routes
    # the edge into the context); never the other way (see the module docstring).
    with graph.control_dependencies([previous] if previous is not None else []):
        result = make()
    with _lock:
        tails[context] = _first_op(result)
    return result

