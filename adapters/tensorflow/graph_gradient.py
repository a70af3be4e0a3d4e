"""Custom gradients whose functions are freed with their graph.

``tf.custom_gradient`` in a graph (a ``tf.function``, a TF1 graph) registers
a gradient function in TensorFlow's process-wide registry under a fresh name
for every op it wraps, and never removes it. That function holds the op's
tensors, so every graph that ever held a dp_plugin collective stayed alive:
each retrace (Keras recompiling a step, a new input shape) leaked a graph and
everything it captured.

``with_gradient`` gives the same gradients with one registered function,
``DpPluginGradient``, that finds each op's backward in a table kept on the
op's own graph, so the table goes when the graph goes. As in
``tf.custom_gradient``, the outputs and the inputs pass through one
``IdentityN`` op whose gradient is the backward (``tf.gradients``, and the
gradient of a ``tf.function`` taken from outside it), and the backward is
also recorded on the active ``GradientTape``s (a tape inside the function, or
eager code).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import record

_GRADIENT = "DpPluginGradient"
_TABLE = "_dp_plugin_gradients"
"""The graph attribute holding ``{IdentityN op name: backward}``."""


def with_gradient(ys: Sequence[Any], xs: Sequence[Any],
                  backward: Callable[..., Sequence[Any]]) -> list[Any]:
    """``ys`` (computed from the tensors ``xs``) with ``backward(*dys)`` as their
    gradient: it gets one gradient per ``y`` (zeros where none flows) and returns
    one per ``x``."""
    n = len(ys)

    def gradient(*dys: Any) -> list[Any]:
        dys = tuple(tf.zeros_like(y) if d is None else d
                    for y, d in zip(ys, dys[:n], strict=True))
        return [None] * n + list(backward(*dys))

    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    if graph is None:
        outs = tf.identity_n([*ys, *xs])
    else:
        with graph.gradient_override_map({"IdentityN": _GRADIENT}):
            outs = tf.identity_n([*ys, *xs])
        if not hasattr(graph, _TABLE):
            setattr(graph, _TABLE, {})
        getattr(graph, _TABLE)[outs[0].op.name] = gradient
    record.record_operation(_GRADIENT, outs, [*ys, *xs], gradient)
    return list(outs[:n])


@tf.RegisterGradient(_GRADIENT)
def _registered(op: Any, *dys: Any) -> list[Any]:
    return getattr(op.graph, _TABLE)[op.name](*dys)
