"""Retracing a step that holds dp_plugin collectives keeps memory flat.

Each retrace (a new input shape, Keras recompiling) builds a new graph. Every
graph that held a dp_plugin op used to stay alive for good: ``graph_order``'s
table (graph -> last op) held each graph through its value, and the gradient
of each collective was registered in TensorFlow's process-wide gradient
registry by ``tf.custom_gradient``. A plain ``tf.numpy_function`` step frees
all of them; so must dp_plugin's.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework.func_graph import FuncGraph

import dp_plugin.tensorflow as dp

RETRACES = 50


def _collectives(x: Any) -> Any:
    """Collectives and their gradients inside the step (every differentiable
    collective goes through the same gradient wrapper)."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        total = tf.reduce_sum(dp.allreduce(x * x)) + tf.reduce_sum(dp.allgather(x))
    return tape.gradient(total, x)


def _tape_step(model: keras.Model) -> Callable[[Any], Any]:
    """A custom loop's step: DistributedGradientTape and a plain SGD update."""

    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        grads = dp.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        for variable, grad in zip(model.trainable_variables, grads, strict=True):
            variable.assign_sub(0.01 * grad)
        return loss

    return step


def _live_func_graphs() -> int:
    gc.collect()
    return sum(isinstance(o, FuncGraph) for o in gc.get_objects())


@pytest.mark.parametrize("case", ["collectives", "distributed_gradient_tape"])
def test_retracing_a_step_50_times_leaves_no_graph_alive(case: str) -> None:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    body = _collectives if case == "collectives" else _tape_step(model)
    body(tf.ones([2, 3]))  # eager first: whatever is made once per process
    before = _live_func_graphs()
    graphs = []
    for rows in range(1, RETRACES + 1):
        step = tf.function(body)
        traced = step.get_concrete_function(tf.TensorSpec([rows, 3], tf.float32))
        np.asarray(traced(tf.ones([rows, 3])))
        graphs.append(weakref.ref(traced.graph))
        del step, traced
    gc.collect()
    alive = sum(ref() is not None for ref in graphs)
    assert alive == 0, f"{alive} of {RETRACES} retraced graphs are still alive"
    assert _live_func_graphs() == before
